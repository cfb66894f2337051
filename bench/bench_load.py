"""Benchmark: loading the built-in SmolLM2 through `load_model` vs a bare `from_pretrained`.

Both sides read the same converted plain checkpoint (model + tokenizer); `load_model` adds the
config checks, the adapter lookup and the meta-device memory estimate. The runs alternate
(A B, B A, ...) in one process so both see the same machine load; medians are compared.
Also prints the one-time GGUF -> safetensors conversion cost, measured in a fresh cache folder.

    .venv/bin/python -m bench.bench_load [--repeats 7]
Target: load_model / from_pretrained <= 1.2x.
"""
import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from analysis.arch.models import load_model  # noqa: E402
from bench._timing import compare, timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="headscope-bench-") as cache:
        convert = timed(lambda: load_model("smollm2-135m", cache_dir=cache))
        folder = Path(cache) / "models" / "smollm2-135m"

        def ours():
            load_model("smollm2-135m", cache_dir=cache)

        def bare():
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False).eval()
            AutoTokenizer.from_pretrained(folder, trust_remote_code=False)

        cmp = compare({"load_model": ours, "from_pretrained": bare}, min_pairs=args.repeats,
                      max_pairs=4 * args.repeats + 1, collect=True)  # warms both first

    print(f"one-time conversion (GGUF -> safetensors, first load_model): {convert:.1f} s")
    cmp.report("load_model vs bare from_pretrained (+ tokenizer)", target="<= 1.2x")
    ratio = cmp.ratio
    print(f"ratio load_model / from_pretrained (median of interleaved pairs): {ratio:.2f}x (target <= 1.2x) "
          f"-> {'OK' if ratio <= 1.2 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
