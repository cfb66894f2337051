"""Peer runner: NVIDIA's kvpress presses on headscope's RULER rows, in kvpress's own environment.

    bash bench/peers/setup_kvpress.sh                      # once: .venv-kvpress (torch 2.13 CPU, kvpress 0.5.5)
    .venv-kvpress/bin/python -m bench.peers.kvpress_ruler --rows rows.jsonl \\
        --model-dir ~/.cache/headscope/models/smollm2-135m [--presses none,streaming,snapkv,expected] \\
        [--ratios 0.25,0.5,0.75] [--duo DIR ...] [--query-aware] [--threads N] [--limit N] --out kvpress.json

Run from the repository root. It imports the standard library, torch, transformers, kvpress, and three light
headscope modules that need neither transformers nor headscope's dependencies (analysis.compress.export.duo:
the DuoAttention pattern files; analysis.compress.kvpress_bridge: a plan as a DuoAttentionPress;
analysis.core.atomic: the output written atomically).

Rows (JSONL, one object a line; what headscope's RULER builder exports; nothing else is assumed):
    task            str        e.g. "niah_single_1"
    length          int        the row's nominal context length (tokens), for grouping
    index           int        the sample's index within (task, length)
    context_ids     [int]      the tokens of the context (BOS and any template already in: fed as given)
    question_ids    [int]      the question and the answer prefix (fed as given, after the context)
    references      [str]      the strings the answer must contain
    max_new_tokens  int        greedy tokens at most
    until           [str]      stop strings: generation stops when the answer holds one; the answer is cut there

What is compressed: the context only. The question is read after the compression, through the compressed
cache (kvpress's own benchmark default, evaluation/evaluate.py with query_aware=False, the setting of its
RULER leaderboard): the press cannot see the question, so a context compressed once serves any question, and
no press (SnapKV's observation window) is helped by the question sitting at the end of what it scores.
headscope's side reads the same rows the same way: the same context ids, then the same question ids, then
greedy answers. `--query-aware` compresses the context and the question but its last token (kvpress's
query_aware=True; the last token is fed after, so that the first answer token reads the compressed cache).

Presses (kvpress's `compression_ratio` = the share of the context's KV pairs REMOVED):
    none        no press (dense)
    streaming   StreamingLLMPress(compression_ratio, n_sink=--sinks)
    snapkv      SnapKVPress(compression_ratio, window_size=--snap-window)
    expected    ExpectedAttentionPress(compression_ratio)
    knorm       KnormPress(compression_ratio): keeps the keys of the lowest L2 norm
    kvzip       KVzipPress(compression_ratio): scores each pair by how well the context is reconstructed from it
    <press>+q   any of the above with the question in view (query-aware for that setting only: as --query-aware)
    duo         --duo DIR (repeatable): a DuoAttention pattern folder, e.g. headscope's own plan written by
                `python -m analysis kv-plan ... --to-duo DIR`, as a DuoAttentionPress with that folder's
                streaming heads, sink_size and recent_size (analysis.compress.kvpress_bridge.duo_press); a
                published pattern's real-valued gates are thresholded by --duo-threshold / --duo-sparsity.

Per row and setting: the answer, its score, the KV cache after the prefill, the speeds.
- score: RULER's string_match_all (NVIDIA/RULER scripts/eval/synthetic/constants.py; kvpress's
  evaluation/benchmarks/ruler/calculate_metrics.py for non-"qa" tasks): the share of the references contained
  in the answer, case-insensitive (kvpress first strips the answer and drops control characters: done here too);
- kv_bytes_held: the bytes of every K and V tensor the cache holds after the prefill (what the memory really
  holds); kv_bytes_read: those minus the keys and values DuoAttentionPress hides (kvpress masks a streaming
  head's evicted keys with a fake key instead of freeing them, kvpress/attention_patch.py: held = dense there);
  kv_bytes_dense: what the dense cache holds for the same tokens (2 x layers x KV heads x head_dim x tokens x
  bytes per value);
- prefill_s (the context's forward pass, the press's work included), question_s (the question's pass and the
  first answer token), decode_tokens_per_s (every later answer token, one forward pass each; None when the
  answer was one token).
For every --duo folder the runner checks that the press runs the folder's pattern: the press's per-KV-head
streaming mask, sink_size and recent_size after it met the model equal the pattern's, equal the folder's
kv_plan.json (headscope's plan, when the folder has one, read as plain JSON: the check's independent oracle),
and after each prefill the keys kvpress hides are exactly the streaming heads' tokens sink_size ..
T - recent_size - 1. A failed check stops the run (exit 1).

Out: one JSON (atomic): the run's settings and versions, every row's result, per setting and task the mean
score, and per setting the mean KV held / read / dense ratios and speeds. Bad input is one line, exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROW_FIELDS = {"task": str, "length": int, "index": int, "context_ids": list, "question_ids": list,
              "references": list, "max_new_tokens": int, "until": list}
KIND_WORDS = {str: "string", int: "whole number", list: "list"}
MAX_ROWS_BYTES = 4 * 2**30                 # 4 GiB of JSONL: 128k-token rows by the thousand
CONTROL = re.compile(r"[\x00-\x1f]")


class Refused(Exception):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class Row:
    task: str
    length: int
    index: int
    context_ids: list
    question_ids: list
    references: list
    max_new_tokens: int
    until: list


@dataclass(frozen=True)
class Setting:
    name: str          # "none", "streaming@0.5", "duo:<folder>"
    press: str         # "none" | "streaming" | "snapkv" | "expected" | "knorm" | "kvzip" | "duo"
    ratio: float | None
    folder: str | None = None
    query_aware: bool = False          # a "+q" press: the question compressed with the context


# ---- scoring -------------------------------------------------------------------------------------

def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all for one row: the share of references contained, case-insensitive."""
    answer = CONTROL.sub("", prediction.strip()).strip().lower()
    return sum(r.lower() in answer for r in references) / len(references)


def cut_at(text: str, until: list[str]) -> tuple[str, bool]:
    """(text up to the first stop string, whether one occurred)."""
    hits = [i for i in (text.find(u) for u in until if u) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


# ---- input ---------------------------------------------------------------------------------------

def read_rows(path: str, limit: int | None) -> list[Row]:
    """The rows of a JSONL file (capped, regular files only: analysis.core.files' reader)."""
    from analysis.core.errors import InputError
    from analysis.core.files import read_file_text
    fix = "give the JSONL of RULER rows headscope exports (one object a line; see this script's header)"
    try:
        text = read_file_text(path, MAX_ROWS_BYTES, what="The rows file", fix=fix)
    except InputError as err:
        raise Refused(str(err)) from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            raise Refused(f"{path}, line {number}: not a JSON object; {fix}.") from None
        rows.append(_row(data, f"{path}, line {number}", fix))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise Refused(f"{path} holds no rows; {fix}.")
    return rows


def _row(data, where: str, fix: str) -> Row:
    if not isinstance(data, dict):
        raise Refused(f"{where}: not a JSON object; {fix}.")
    for name, kind in ROW_FIELDS.items():
        value = data.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise Refused(f"{where}: {name} must be a {KIND_WORDS[kind]}; {fix}.")
    for name in ("context_ids", "question_ids"):
        ids = data[name]
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise Refused(f"{where}: {name} must be a non-empty list of token ids; {fix}.")
    for name in ("references", "until"):
        if not all(isinstance(s, str) for s in data[name]):
            raise Refused(f"{where}: {name} must be a list of strings; {fix}.")
    if not data["references"] or data["max_new_tokens"] < 1:
        raise Refused(f"{where}: a row needs at least one reference and max_new_tokens >= 1; {fix}.")
    return Row(**{name: data[name] for name in ROW_FIELDS})


def settings_of(ns) -> list[Setting]:
    names = [p.strip() for p in ns.presses.split(",") if p.strip()]
    unknown = [p for p in names if p.removesuffix(QUESTION_IN_VIEW) not in RATIO_PRESSES and p != "none"]
    if unknown:
        raise Refused(f"--presses: unknown {', '.join(unknown)}; choose from none, {', '.join(RATIO_PRESSES)} "
                      f"(each with {QUESTION_IN_VIEW} for the question in view; duo comes from --duo DIR).")
    try:
        ratios = [float(r) for r in ns.ratios.split(",") if r.strip()]
    except ValueError:
        raise Refused(f"--ratios: {ns.ratios!r} is not a comma-separated list of numbers.") from None
    if not ratios or any(not 0.0 < r < 1.0 for r in ratios):
        raise Refused("--ratios: each compression ratio (the share of KV pairs removed) is above 0 and below 1.")
    out = [Setting("none", "none", None)] if "none" in names else []
    out += [Setting(f"{p}@{r:g}", p.removesuffix(QUESTION_IN_VIEW), r, query_aware=p.endswith(QUESTION_IN_VIEW))
            for p in names if p != "none" for r in ratios]
    out += [Setting(f"duo:{Path(d).name}", "duo", None, d) for d in ns.duo]
    if not out:
        raise Refused("Nothing to run: give --presses and/or --duo.")
    return out


# ---- the runs ------------------------------------------------------------------------------------

RATIO_PRESSES = {
    "streaming": lambda kv, r, ns: kv.StreamingLLMPress(compression_ratio=r, n_sink=ns.sinks),
    "snapkv": lambda kv, r, ns: kv.SnapKVPress(compression_ratio=r, window_size=ns.snap_window),
    "expected": lambda kv, r, ns: kv.ExpectedAttentionPress(compression_ratio=r),
    "knorm": lambda kv, r, ns: kv.KnormPress(compression_ratio=r),
    "kvzip": lambda kv, r, ns: kv.KVzipPress(compression_ratio=r),
}
QUESTION_IN_VIEW = "+q"             # a press name's suffix: that setting compresses the context with the question


def make_press(setting: Setting, ns):
    import kvpress
    from analysis.compress.kvpress_bridge import duo_press
    if setting.press == "none":
        return None
    if setting.press == "duo":
        return duo_press(setting.folder, threshold=ns.duo_threshold, sparsity=ns.duo_sparsity)
    return RATIO_PRESSES[setting.press](kvpress, setting.ratio, ns)


def cache_bytes(cache) -> int:
    """Bytes of every K and V tensor the cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def hidden_keys(model) -> list:
    """Per layer, kvpress's masked_key_indices (batch, head, position) or None."""
    return [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]


def run_row(model, tokenizer, row: Row, press, ns, stop_ids: set, query_aware: bool = False) -> tuple[dict, list]:
    """One row under one press: greedy answer, score, cache bytes, times; and kvpress's hidden keys. The question
    is compressed with the context under --query-aware or when the setting asks (`query_aware`)."""
    import torch
    from transformers import DynamicCache
    context, question = list(row.context_ids), list(row.question_ids)
    if ns.query_aware or query_aware:
        context, question = context + question[:-1], question[-1:]
    config, dtype_bytes = model.config, next(model.parameters()).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = DynamicCache()
    layers = model.model.layers
    try:
        with torch.no_grad():
            start = time.perf_counter()
            with press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=torch.tensor([context]), past_key_values=cache)   # [1, T] -> cache
            prefill_s = time.perf_counter() - start
            held = cache_bytes(cache)
            hidden = hidden_keys(model)
            n_hidden = sum(int(h[0].numel()) for h in hidden if h is not None)
            start = time.perf_counter()
            positions = torch.arange(len(context), len(context) + len(question))[None]      # [1, q]
            out = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=positions,
                        logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            question_s = time.perf_counter() - start
            text, stopped = _answer(tokenizer, tokens, row.until, stop_ids)
            steps, start = 0, time.perf_counter()
            position = len(context) + len(question)
            while not stopped and len(tokens) < row.max_new_tokens:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                            position_ids=torch.tensor([[position + steps]]))
                tokens.append(int(out.logits[0, -1].argmax()))
                steps += 1
                text, stopped = _answer(tokenizer, tokens, row.until, stop_ids)
            decode_s = time.perf_counter() - start
    finally:
        for layer in layers:                                  # nothing of this row's masking reaches the next
            layer.self_attn.masked_key_indices = None
    dense = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * len(context) * dtype_bytes
    result = dict(task=row.task, length=row.length, index=row.index, context_tokens=len(context),
                  question_tokens=len(question), answer=text, references=row.references,
                  score=string_match_all(text, row.references), generated_tokens=len(tokens),
                  kv_bytes_held=held, kv_bytes_read=held - 2 * n_hidden * head_dim * dtype_bytes,
                  kv_bytes_dense=dense, prefill_s=prefill_s, question_s=question_s,
                  decode_tokens_per_s=steps / decode_s if steps else None)
    return result, hidden


def _answer(tokenizer, tokens: list, until: list, stop_ids: set) -> tuple[str, bool]:
    ended = tokens[-1] in stop_ids
    text = tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
    text, hit = cut_at(text, until)
    return text, ended or hit


# ---- the DuoAttention check ----------------------------------------------------------------------

def check_duo_press(press, model, folder: str, ns) -> dict:
    """The press's pattern after it met the model == the folder's pattern == its kv_plan.json (if any)."""
    import numpy as np
    from analysis.compress.kvpress_bridge import plan_pattern, press_pattern
    press.post_init_from_model(model)
    ran = press_pattern(press)
    wanted = plan_pattern(folder, threshold=ns.duo_threshold, sparsity=ns.duo_sparsity)
    checks = {"pattern": bool(np.array_equal(ran[0], wanted[0]) and ran[1:] == wanted[1:])}
    plan_file = Path(folder) / "kv_plan.json"
    if plan_file.is_file() and ns.duo_threshold is None and ns.duo_sparsity is None:
        from analysis.core.files import read_file_text
        plan = json.loads(read_file_text(plan_file, 64 * 2**20, what="kv_plan.json", fix="write the folder again"))
        windowed = np.array([[m == "window" for m in row] for row in plan["modes"]], dtype=bool)
        checks["kv_plan.json"] = bool(np.array_equal(ran[0], windowed) and ran[1:] == (plan["sinks"], plan["recent"]))
    return dict(streaming=int(ran[0].sum()), of=int(ran[0].size), sink_size=ran[1], recent_size=ran[2], **checks)


def check_hidden(hidden: list, streaming, sinks: int, recent: int, tokens: int) -> bool:
    """kvpress hid exactly the streaming heads' tokens sinks .. tokens - recent - 1 in every layer."""
    import numpy as np
    evicted = np.arange(sinks, max(sinks, tokens - recent))
    for layer, indices in enumerate(hidden):
        want = {(int(h), int(p)) for h in np.flatnonzero(streaming[layer]) for p in evicted}
        got = set() if indices is None else set(zip(indices[1].tolist(), indices[2].tolist()))
        if got != want:
            return False
    return True


# ---- the whole run ---------------------------------------------------------------------------------

def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if not (Path(model_dir) / "config.json").is_file():
        raise Refused(f"--model-dir {model_dir} holds no config.json; give a local Hugging Face model folder (e.g. "
                      f"~/.cache/headscope/models/smollm2-135m after headscope converted its built-in model).")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model.eval(), tokenizer


def summarize(results: list[dict]) -> dict:
    out = {}
    for name in dict.fromkeys(r["setting"] for r in results):
        mine = [r for r in results if r["setting"] == name]
        tasks = {t: _mean([r["score"] for r in mine if r["task"] == t]) for t in dict.fromkeys(r["task"] for r in mine)}
        speeds = [r["decode_tokens_per_s"] for r in mine if r["decode_tokens_per_s"] is not None]
        out[name] = dict(rows=len(mine), score=_mean([r["score"] for r in mine]), score_by_task=tasks,
                         kv_held_vs_dense=_mean([r["kv_bytes_held"] / r["kv_bytes_dense"] for r in mine]),
                         kv_read_vs_dense=_mean([r["kv_bytes_read"] / r["kv_bytes_dense"] for r in mine]),
                         prefill_s=_mean([r["prefill_s"] for r in mine]),
                         decode_tokens_per_s=_mean(speeds) if speeds else None)
    return out


def _mean(values: list) -> float:
    return math.fsum(values) / len(values)


def run(ns) -> dict:
    from analysis.core.atomic import check_output_file
    from analysis.compress.kvpress_bridge import SETUP
    check_output_file(ns.out, "--out")
    settings = settings_of(ns)
    rows = read_rows(ns.rows, ns.limit)
    try:
        import torch
        import kvpress
        import transformers
    except ImportError as err:
        raise Refused(f"{err}: this runner runs in kvpress's own environment: {SETUP}.") from None
    if ns.threads:
        torch.set_num_threads(ns.threads)
    model, tokenizer = load(ns.model_dir)
    eos = model.generation_config.eos_token_id
    stop_ids = (set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}) - {None}
    presses = {s.name: make_press(s, ns) for s in settings}
    checks = {s.name: check_duo_press(presses[s.name], model, s.folder, ns) for s in settings if s.press == "duo"}
    if not all(v for c in checks.values() for k, v in c.items() if k in ("pattern", "kv_plan.json")):
        raise SystemExit(f"error: a DuoAttention press does not run its folder's pattern: {json.dumps(checks)}")
    results, started = [], time.perf_counter()
    for i, row in enumerate(rows):
        for s in settings:
            result, hidden = run_row(model, tokenizer, row, presses[s.name], ns, stop_ids, s.query_aware)
            if s.press == "duo":
                press = presses[s.name]
                ok = check_hidden(hidden, press.streaming_mask.cpu().numpy(), press.sink_size, press.recent_size,
                                  result["context_tokens"])
                checks[s.name]["hidden_keys_rows"] = checks[s.name].get("hidden_keys_rows", 0) + ok
                if not ok:
                    raise SystemExit(f"error: {s.name}: the keys kvpress hid after row {i} are not the streaming "
                                     f"heads' evicted tokens.")
            results.append({"setting": s.name, "press": s.press, "ratio": s.ratio, **result})
        print(f"row {i + 1}/{len(rows)} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return dict(tool="bench/peers/kvpress_ruler.py", rows_file=ns.rows, model_dir=ns.model_dir,
                query_aware=ns.query_aware, threads=torch.get_num_threads(),
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              kvpress=getattr(kvpress, "__version__", _version("kvpress")),
                              python=platform.python_version()),
                machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count()),
                settings=[s.__dict__ for s in settings], duo_checks=checks, summary=summarize(results),
                results=results)


def _version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", required=True, help="JSONL of RULER rows (see the header)")
    p.add_argument("--model-dir", dest="model_dir", required=True, help="a local Hugging Face model folder")
    p.add_argument("--presses", default="none,streaming,snapkv,expected",
                   help="comma-separated: none, streaming, snapkv, expected (default: all)")
    p.add_argument("--ratios", default="0.25,0.5,0.75", help="compression ratios (share removed), comma-separated")
    p.add_argument("--duo", action="append", default=[], help="a DuoAttention pattern folder (repeatable)")
    p.add_argument("--duo-threshold", dest="duo_threshold", type=float, default=None,
                   help="a KV head is full when its gate >= this (default 0.5)")
    p.add_argument("--duo-sparsity", dest="duo_sparsity", type=float, default=None,
                   help="instead of a threshold: this share of KV heads streaming (DuoAttention's quantile rule)")
    p.add_argument("--sinks", type=int, default=4, help="StreamingLLMPress's sink tokens (default 4)")
    p.add_argument("--snap-window", dest="snap_window", type=int, default=64, help="SnapKV's window (default 64)")
    p.add_argument("--query-aware", dest="query_aware", action="store_true",
                   help="compress the question with the context (all but its last token)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N rows")
    p.add_argument("--out", required=True, help="the JSON written (atomic)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from analysis.core.atomic import atomic_write
    from analysis.core.errors import HeadscopeError
    ns = parse(argv)
    try:
        payload = run(ns)
        atomic_write(ns.out, json.dumps(payload, indent=1) + "\n", what="--out")
    except (Refused, HeadscopeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(payload["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
