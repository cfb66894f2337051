#!/usr/bin/env bash
# The peers environment for NVIDIA's kvpress (bench/peers/kvpress_ruler.py runs in it): a virtual environment of
# its own, .venv-kvpress at the repository root (gitignored; KVPRESS_VENV=DIR puts it elsewhere), so headscope's
# own .venv (transformers 5.23) never changes. It installs:
#   - torch==2.13.0, the CPU build only (the wheel pip finds on local disk through find-links, else the PyTorch
#     CPU index; a CUDA build is refused at the end);
#   - kvpress==0.5.5 and its dependencies (accelerate, datasets, peft, pandas, cachetools, fire, requests, ...);
#   - transformers==5.2.0: kvpress 0.5.5 requires transformers >=4.56,<5.3; 5.2.0 is the newest it accepts, and a
#     5.x release reads the `rope_parameters` that headscope's converted SmolLM2 config.json holds.
# Safe to run again: a finished environment (its stamp matches this script) is left alone; anything else at that
# path (an older or half-built one: the stamp is written last, after the check) is removed and built again.
# Time here: 76 s (2-core Intel Xeon shared with other work; torch from the local wheel, the rest from the PyPI
# mirror; 1.4 GB on disk).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
VENV=${KVPRESS_VENV:-$ROOT/.venv-kvpress}
TORCH=2.13.0
TRANSFORMERS=5.2.0
KVPRESS=0.5.5
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
STAMP="$VENV/.kvpress-setup-$(sha256sum "$0" | cut -c1-16)"

pick_python() {
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "setup_kvpress: need python3.11 (or python3 >= 3.10)." >&2
  return 1
}

if [ -f "$STAMP" ]; then
  echo "setup_kvpress: $VENV is ready"; exit 0
fi
start=$(date +%s)
python=$(pick_python)
rm -rf "$VENV"
"$python" -m venv "$VENV"
PY="$VENV/bin/python"
# torch alone from local disk first (no index), else the CPU index: never a CUDA build
if ! "$PY" -m pip install -q --no-index --no-deps "torch==$TORCH" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --retries 2 "torch==$TORCH" --index-url "$TORCH_CPU_INDEX"
fi
have=$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')
# the rest; torch pinned to the exact build just installed so no resolver step swaps it for a CUDA wheel
echo "torch==$have" > "$VENV/constraints.txt"
"$PY" -m pip install -q -c "$VENV/constraints.txt" "torch==$have" "transformers==$TRANSFORMERS" "kvpress==$KVPRESS"
"$PY" - <<PYCHECK
import torch, transformers, kvpress, importlib.metadata as m
assert torch.version.cuda is None, f"a CUDA build of torch came in ({torch.__version__})"
assert torch.__version__.split("+")[0] == "$TORCH", torch.__version__
assert transformers.__version__ == "$TRANSFORMERS", transformers.__version__
assert m.version("kvpress") == "$KVPRESS", m.version("kvpress")
print("setup_kvpress: torch", torch.__version__, "transformers", transformers.__version__, "kvpress", m.version("kvpress"))
PYCHECK
touch "$STAMP"
echo "setup_kvpress: done in $(( $(date +%s) - start )) s: $VENV"
