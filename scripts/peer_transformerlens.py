"""Peer check: TransformerLens' head detector vs headscope's detectors, same model, same tokens.

    .venv/bin/python scripts/peer_transformerlens.py [--model-dir DIR] [--tl-python /tmp/tlvenv/bin/python]

TransformerLens lives in its own virtual environment (so it cannot change the project's):
    python3 -m venv /tmp/tlvenv && /tmp/tlvenv/bin/pip install torch==2.13.0 && /tmp/tlvenv/bin/pip install transformer-lens

Step 1 (project venv): headscope builds the repeated random sequences of its induction /
duplicate-token detectors and scores previous-token, duplicate-token and induction on them;
ids and scores go to a JSON file. Step 2 (this same script, run by the TransformerLens venv with
--tl-side): TransformerBridge.boot_transformers on the same local folder (the converted SmolLM2),
run_with_cache on exactly those ids, and TransformerLens' own detection patterns and scoring
(`get_*_detection_pattern`, `compute_head_attention_similarity_score`, error_measure "mul": the
code path of `detect_head`, fed ids instead of a string). Its score divides the matched
attention by ALL attention of the sequence (every query row sums to 1, so by T), where headscope
averages over the queries that have a target; so headscope's score is also printed rescaled by
(#target queries / T), which must equal TransformerLens' number. Prints, per detector, the max
and mean |difference| over the L x H heads and the heads with the largest difference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEFAULT_DIR = Path(tempfile.gettempdir()) / f"headscope-test-cache-{os.getuid()}" / "models" / "smollm2-135m"
TL_NAMES = {"previous-token": "previous_token_head", "duplicate-token": "duplicate_token_head",
            "induction": "induction_head"}


def headscope_side(model_dir: Path, length: int, n_sequences: int, seed: int) -> dict:
    from analysis.arch.models import load_model
    from analysis.measure.detectors import get_detector
    loaded = load_model(str(model_dir))
    out = {"ids": None, "scores": {}, "targets": {}}
    ind = get_detector("induction", loaded.tokenizer, length=length, n_sequences=n_sequences, seed=seed)
    ids = ind.inputs(loaded.model)                                     # [n, T] the detectors' own input
    out["ids"] = ids.tolist()
    T = ids.shape[1]
    offset = 0 if ind.bos_id is None else 1
    for name in TL_NAMES:
        det = get_detector(name, loaded.tokenizer, length=length, n_sequences=n_sequences, seed=seed)
        res = det.detect(loaded.model, ids)                            # previous-token reads these ids as its text
        out["scores"][name] = res.scores.tolist()
    # queries with a target, per sequence: previous-token T-1; duplicate-token and induction N (second copy)
    out["targets"] = {"previous-token": T - 1, "duplicate-token": length, "induction": length}
    out["T"], out["bos"], out["offset"] = T, ind.bos_id, offset
    return out


def tl_side(model_dir: Path, data: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformer_lens import head_detector as hd
    from transformer_lens.model_bridge import TransformerBridge
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    bridge = TransformerBridge.boot_transformers(str(model_dir), hf_model=hf, tokenizer=tok, device="cpu")
    ids = torch.tensor(data["ids"])
    scores = {name: torch.zeros(bridge.cfg.n_layers, bridge.cfg.n_heads, dtype=torch.float64) for name in TL_NAMES}
    for row in ids:
        _, cache = bridge.run_with_cache(row[None])
        for name, tl_name in TL_NAMES.items():
            pattern = getattr(hd, f"get_{tl_name}_detection_pattern")(row[None])
            for layer in range(bridge.cfg.n_layers):
                attn = cache["pattern", layer][0]                      # [H, T, T]
                for head in range(bridge.cfg.n_heads):
                    scores[name][layer, head] += hd.compute_head_attention_similarity_score(
                        attn[head].float(), pattern, exclude_bos=False, exclude_current_token=False,
                        error_measure="mul")
    from importlib.metadata import version
    return {"version": version("transformer-lens"),
            "scores": {k: (v / len(ids)).tolist() for k, v in scores.items()}}


def _head(scores) -> str:
    import numpy as np
    l, h = np.unravel_index(int(np.argmax(scores)), np.shape(scores))
    return f"L{l}H{h}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(DEFAULT_DIR))
    p.add_argument("--tl-python", default="/tmp/tlvenv/bin/python")
    p.add_argument("--length", type=int, default=50)
    p.add_argument("--n-sequences", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tl-side", default=None, help=argparse.SUPPRESS)   # internal: JSON in -> JSON out
    args = p.parse_args(argv)
    model_dir = Path(args.model_dir)
    if args.tl_side:
        data = json.loads(Path(args.tl_side).read_text())
        Path(args.tl_side).write_text(json.dumps({**data, "tl": tl_side(model_dir, data)}))
        return 0
    import numpy as np
    data = headscope_side(model_dir, args.length, args.n_sequences, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / "peer.json"
        f.write_text(json.dumps(data))
        subprocess.run([args.tl_python, __file__, "--model-dir", str(model_dir), "--tl-side", str(f)], check=True)
        data = json.loads(f.read_text())
    tl = data["tl"]
    print(f"model {model_dir}; {len(data['ids'])} sequences of {data['T']} tokens ([BOS={data['bos']}] + "
          f"{args.length} random tokens twice, seed {args.seed}); TransformerLens {tl['version']}")
    for name in TL_NAMES:
        ours = np.array(data["scores"][name])                          # [L, H] mean over target queries
        theirs = np.array(tl["scores"][name])                          # [L, H] matched / all attention
        rescaled = ours * data["targets"][name] / data["T"]
        diff = np.abs(rescaled - theirs)
        worst = np.dstack(np.unravel_index(np.argsort(-diff, axis=None)[:3], diff.shape))[0]
        print(f"{name:16s} max |headscope*(targets/T) - TL| = {diff.max():.3e}, mean {diff.mean():.3e}; "
              f"largest at " + ", ".join(f"L{l}H{h} ({rescaled[l, h]:.5f} vs {theirs[l, h]:.5f})" for l, h in worst)
              + f"; best head: headscope {_head(ours)} {ours.max():.3f}, TL {_head(theirs)} {theirs.max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
