#!/usr/bin/env bash
# Set up (if needed) and start the headscope app on http://127.0.0.1:8501 (the default model is
# the built-in SmolLM2-135M; its one-time conversion takes about 20 s on first use). llama.cpp
# (llama-cpp-python) builds in the background meanwhile (setup.sh --app); the two features that need it,
# the k-quant GGUF types and the deployment report, say so until it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --app
exec .venv/bin/streamlit run app.py "$@"
