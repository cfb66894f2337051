"""Can a GGUF file headscope writes carry a KV plan's windows into llama.cpp? Run it, don't guess.

llama.cpp has sliding-window attention (`{arch}.attention.sliding_window`, per-layer patterns in
`llama_hparams.swa_layers`, a separate iSWA KV cache for those layers), but only the architectures whose graph
builds that cache use it, and its window (`llama_hparams::is_masked_swa`, STANDARD: a key is masked when
p1 - p0 >= n_swa) keeps no sink tokens. headscope writes the built-in SmolLM2 as `llama` (dense, or a uniform
cut) or `deci` (per-layer head counts). This script writes both with a window of --window tokens on every layer
(the key alone, and with a per-layer `sliding_window_pattern`) and compares llama.cpp's logits with the plain
file's and with PyTorch's windowed model (every KV head on `recent = window`, no sinks):

- llama.cpp's logits equal the plain file's bit for bit  -> the architecture ignores the window;
- they equal PyTorch's windowed model within the export self-check's bound -> it honours it.

Usage: .venv/bin/python scripts/gguf_window_check.py [--window 16] [--tokens 64]
Measured with llama-cpp-python 0.3.36 (docs/EXPORT.md, "A KV plan with the export"): both architectures load
the files and ignore the window: max |logit difference| to the plain file 0 (llama: dense, deci: an uneven cut),
to PyTorch's full model 7.3e-05 / 5.9e-05, while PyTorch's windowed model differs from its full one by 33.8 /
25.2 (a 16-token window, 64 tokens of the built-in evaluation text).
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from analysis.arch.models import load_model
from analysis.arch.spans import windowed
from analysis.arch.window import Window
from analysis.compress.export.gguf import llamacpp, writer
from analysis.compress.export.gguf.format import tokenizer_source
from analysis.compress.surgery import prune_heads
from analysis.core.text import evaluation_text

VARIANTS = {
    "plain": lambda arch, n, w: [],
    "sliding_window": lambda arch, n, w: [(f"{arch}.attention.sliding_window", w, "UINT32", None)],
    "sliding_window + per-layer pattern": lambda arch, n, w: [
        (f"{arch}.attention.sliding_window", w, "UINT32", None),
        (f"{arch}.attention.sliding_window_pattern", [True] * n, "ARRAY", "BOOL")],
}


def write_variant(small, layout, path: Path, extra, tokenizer_gguf) -> str:
    """The cut as an F32 GGUF with `extra` metadata added to the plan the export writes; its architecture."""
    original = writer.plan_gguf

    def plan(*args, **kwargs):
        p = original(*args, **kwargs)
        p.metadata.extend(extra(p.arch, layout.n_layers))
        return p
    writer.plan_gguf = plan
    try:
        return writer.write_gguf(small, layout, path, weight_type="f32", tokenizer_gguf=tokenizer_gguf).arch
    finally:
        writer.plan_gguf = original


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args(argv)
    loaded = load_model("smollm2-135m")
    m, g = loaded.model, loaded.geometry
    ids = loaded.tokenizer(evaluation_text(4000))["input_ids"][:args.tokens]
    uneven = np.zeros((g.n_layers, g.n_heads), bool)
    uneven[::2, 0] = True                                                # one head in every other layer: deci
    cuts = {"dense": np.zeros((g.n_layers, g.n_heads), bool), "uneven cut": uneven}
    with tempfile.TemporaryDirectory(prefix="gguf-window-") as tmp:
        for cut, pruned in cuts.items():
            small, layout = prune_heads(m, pruned)
            with torch.no_grad():
                full = small(torch.tensor([ids])).logits[0].numpy()
                with windowed(small, [np.ones(len(kv), bool) for kv in layout.kv_heads], Window(0, args.window)):
                    banded = small(torch.tensor([ids])).logits[0].numpy()
            print(f"{cut}: PyTorch windowed vs full, max |logit difference| {np.abs(banded - full).max():.4g}")
            plain = None
            for name, extra in VARIANTS.items():
                path = Path(tmp) / f"{cut}-{len(name)}.gguf"
                arch = write_variant(small, layout, path, lambda a, n, e=extra: e(a, n, args.window),
                                     tokenizer_source(m))
                got = llamacpp.logits(path, ids)
                plain = got if plain is None else plain
                print(f"  {arch:>5} {name:<36} vs plain file {np.abs(got - plain).max():.4g}, vs PyTorch windowed "
                      f"{np.abs(got - banded).max():.4g}, vs PyTorch full {np.abs(got - full).max():.4g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
