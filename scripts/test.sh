#!/usr/bin/env bash
# Set up (if needed) and run the test suite; arguments go to pytest (e.g. -k models, -x).
# The suite runs on the machine's cores (pytest-xdist, one module per worker at a time; tests/conftest.py
# gives each worker its share of the threads and starts the longest modules first; --no-loadscope-reorder
# keeps that order, xdist's default re-sorts the modules by their test count): up to 4 workers,
# one per core. HEADSCOPE_TEST_WORKERS=N overrides (1 or 0: one process, no xdist).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup.sh --test-tools     # qemu-user: ONNX Runtime's AVX2 kernels, emulated (tests/test_cpu_paths.py)
cores=$(.venv/bin/python -c "import os; print(len(os.sched_getaffinity(0)))")
workers=${HEADSCOPE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [ "$workers" -ge 2 ]; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
