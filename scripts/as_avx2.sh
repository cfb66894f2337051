#!/usr/bin/env bash
# Run a command on the AVX2 code paths of the libraries headscope uses, on a machine with AVX-512
# (docs/ARCHITECTURE.md, "Testing on other CPUs"). CI may land on an AVX2-only CPU (AMD Zen 2/3, many
# cloud VMs); this reproduces it here.
#
#   bash scripts/as_avx2.sh .venv/bin/python -m pytest -q tests/test_surgery.py
#       torch's own kernels (ATEN_CPU_CAPABILITY), MKL (MKL_ENABLE_INSTRUCTIONS) and oneDNN
#       (ONEDNN_MAX_CPU_ISA) forced to AVX2; full speed. ONNX Runtime (MLAS) has no such switch: it
#       reads CPUID itself. llama.cpp needs none: setup builds it with GGML_NATIVE=OFF, AVX2 + FMA +
#       F16C only, on every machine (`llama_cpp.llama_print_system_info()` says so).
#   bash scripts/as_avx2.sh --emulate .venv/bin/python script.py
#       the whole process under qemu-user with an AVX2-only CPU model (Haswell: AVX2, FMA, no
#       AVX-512, no VNNI), so CPUID says AVX2 to every library, ONNX Runtime included; 100x-1000x
#       slower: for small cases (tests/test_cpu_paths.py; SmolLM2's 256 tokens took 28 min for 4 files).
set -euo pipefail
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
if [ "${1:-}" = "--emulate" ]; then
  shift
  command -v qemu-x86_64 >/dev/null 2>&1 || {
    echo "as_avx2: --emulate needs qemu-user (apt-get install qemu-user)." >&2; exit 2; }
  # qemu lists the host-only CPUID bits it cannot emulate on every start: not errors
  exec qemu-x86_64 -cpu "${HEADSCOPE_EMULATED_CPU:-Haswell}" "$@" 2> >(grep -v "TCG doesn't support" >&2)
fi
exec "$@"
