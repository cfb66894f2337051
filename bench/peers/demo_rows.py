"""A few hand-made RULER-style rows for trying bench/peers/kvpress_ruler.py end to end (not a benchmark).

    .venv/bin/python -m bench.peers.demo_rows --model-dir ~/.cache/headscope/models/smollm2-135m \\
        [--length 512] [--out /tmp/demo_rows.jsonl]

Three rows of about --length tokens in the runner's format (its header): built-in Wikipedia text as the haystack
(analysis.core.text, CC BY-SA 4.0), RULER's needle-in-a-haystack wording (NVIDIA/RULER
scripts/data/synthetic/constants.py, niah): a single magic number at depth 0.25, another at 0.75, and two
magic numbers for one key (niah_multivalue: both must be in the answer). BOS first, no chat template; the
question and its answer prefix are the question_ids. The real rows come from headscope's RULER builder.
"""
from __future__ import annotations

import argparse
import json
import random

INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz "
         "you about the numbers afterwards.\n")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = ("\nWhat {ask} the special magic {noun} for {key} mentioned in the provided text? The special magic "
            "{noun} for {key} mentioned in the provided text {verb}")
KEYS = ("quiet-harbor", "amber-falcon", "silver-meadow")


def build(tokenizer, length: int, seed: int = 0) -> list[dict]:
    from analysis.core.text import evaluation_text
    rng = random.Random(seed)
    sentences = [s.strip() + "." for s in evaluation_text(max_chars=200_000).split(". ") if s.strip()]
    specs = [("niah_single_1", [0.25], 1), ("niah_single_1", [0.75], 1), ("niah_multivalue", [0.3, 0.7], 2)]
    rows = []
    for index, (task, depths, n_values) in enumerate(specs):
        key = KEYS[index]
        values = [str(rng.randrange(1_000_000, 9_999_999)) for _ in range(n_values)]
        plural = n_values > 1
        question = QUESTION.format(ask="are all" if plural else "is", verb="are" if plural else "is",
                                   noun="numbers" if plural else "number", key=key) + ":"
        needles = [NEEDLE.format(key=key, value=v) for v in values]
        budget = length - 1 - sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in
                                  [INTRO, question, *(" " + n for n in needles)])
        hay, used = [], 0
        for sentence in sentences[index * 400:]:
            n = len(tokenizer.encode(" " + sentence, add_special_tokens=False))
            if used + n > budget:
                if budget - used < 8:
                    break
                continue                                   # a shorter sentence may still fit
            hay.append(sentence)
            used += n
        for depth, needle in sorted(zip(depths, needles), reverse=True):
            hay.insert(round(depth * len(hay)), needle)
        context = [tokenizer.bos_token_id] + tokenizer.encode(INTRO + " ".join(hay), add_special_tokens=False)
        rows.append(dict(task=task, length=length, index=index, context_ids=context,
                         question_ids=tokenizer.encode(question, add_special_tokens=False), references=values,
                         max_new_tokens=24, until=["\n"]))
    return rows


def main(argv=None) -> int:
    from transformers import AutoTokenizer
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", dest="model_dir", required=True)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--out", default="/tmp/demo_rows.jsonl")
    ns = p.parse_args(argv)
    rows = build(AutoTokenizer.from_pretrained(ns.model_dir), ns.length)
    with open(ns.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for r in rows:
        print(r["task"], len(r["context_ids"]) + len(r["question_ids"]), "tokens, references", r["references"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
