#!/usr/bin/env bash
# Set up (if needed) and run the test suite; arguments go to pytest (e.g. -k models, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
