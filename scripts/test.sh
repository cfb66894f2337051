#!/usr/bin/env bash
# Set up (if needed) and run the test suite; arguments go to pytest (e.g. -k models, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup.sh --test-tools     # qemu-user: ONNX Runtime's AVX2 kernels, emulated (tests/test_cpu_paths.py)
exec .venv/bin/python -m pytest -q "$@"
