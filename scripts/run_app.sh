#!/usr/bin/env bash
# Set up (if needed) and start the headscope app on http://127.0.0.1:8501 (the default model is
# the built-in SmolLM2-135M; its one-time conversion takes about 20 s on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamlit run app.py "$@"
