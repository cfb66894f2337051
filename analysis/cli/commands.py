"""The analysis commands: score, mask, sweep, evaluate, ablate (each `_x_arguments` + `run_x`, registered
at the bottom; every one splits its work over the processes of a launch)."""
from __future__ import annotations


import os
import sys

import numpy as np

from analysis.cli.common import (add_cut_arguments, add_kv_policy_argument, add_output_arguments, add_param_option,
                                 add_policy_arguments, add_scorer_arguments, add_source_arguments, check_counts,
                                 check_one_cut, compute_scores, cut_from, load_source, plan_from, progress_bar,
                                 register, resolve_policy, resolve_scorer, team_of, warn)
from analysis.core.errors import HeadscopeError, InputError
from analysis.score.masks import summarize_mask


def _score_arguments(parser):
    add_source_arguments(parser)
    add_scorer_arguments(parser)
    add_output_arguments(parser)


def run_score(ns):
    scores, _, info = compute_scores(ns)
    rows = [dict(layer=layer, head=head, score=float(scores.scores[layer, head]))
            for layer in range(scores.scores.shape[0]) for head in range(scores.scores.shape[1])]
    return dict(model=info, **scores.as_dict()), rows


def _mask_arguments(parser):
    _score_arguments(parser)
    parser.add_argument("--sparsity", type=float, required=True, help="fraction of heads to prune, in [0, 1)")
    add_policy_arguments(parser)
    parser.add_argument("--flops-seq-len", dest="flops_seq_len", type=int, default=512,
                        help="sequence length for the attention FLOP count (projections + causal scores: "
                             "n (n + 1) / 2 pairs per head)")
    add_kv_policy_argument(parser)


def run_mask(ns):
    from analysis.core.text import MAX_TOKENS_LIMIT
    check_counts(ns, {"flops_seq_len": (1, MAX_TOKENS_LIMIT)})
    plan, scores, loaded, info = plan_from(ns)
    bias = loaded is not None and loaded.adapter.has_qkv_bias(loaded.model)  # unknown when streamed
    dtype_bytes = next(loaded.model.parameters()).element_size() if loaded is not None else 4
    summary = summarize_mask(plan, scores, head_dim=info["head_dim"], hidden=info["hidden"],
                             seq_len=ns.flops_seq_len, bias=bias, kv_policy=ns.kv_policy, dtype_bytes=dtype_bytes)
    stock = _stock(ns, loaded, plan)
    warn(summary.warnings)
    rank = np.empty(plan.order.size, dtype=int)  # [L*H]
    rank[plan.order] = np.arange(plan.order.size)
    H = plan.pruned.shape[1]
    rows = [dict(layer=flat // H, head=flat % H, score=float(scores.scores.flat[flat]), rank=int(rank[flat]),
                 pruned=bool(plan.pruned.flat[flat])) for flat in range(plan.order.size)]
    payload = dict(model=info, scorer=scores.name, params=scores.params, cost=scores.cost.as_dict(),
                   sparsity=ns.sparsity, policy=ns.policy, kv_policy=ns.kv_policy, summary=summary.as_dict(),
                   stock=stock, pruned=plan.pruned.astype(int), kv_pruned=plan.kv_pruned.astype(int))
    return payload, rows


def _stock(ns, loaded, plan) -> dict:
    """Whether a stock config describes the mask (analysis.compress.export.stock_check), as JSON."""
    from analysis.compress.export import stock_check

    if loaded is not None:
        config = loaded.model.config
    else:
        from analysis.arch.checkpoint import checkpoint_folder, load_config
        config = load_config(checkpoint_folder(ns.checkpoint))
    try:
        check = stock_check(config, plan.pruned, kv_policy=ns.kv_policy, sparsity=ns.sparsity)
    except HeadscopeError as err:            # e.g. a family with no surgery entry
        return dict(ok=False, message=str(err), nearest=[])
    return dict(ok=check.ok, message=check.message(),
                nearest=[dict(sparsity=s, policy=p, kv_policy=kv, heads=h, kv_heads=k)
                         for s, p, kv, (h, k) in check.nearest[:3]])


def _evaluate_arguments(parser):
    add_source_arguments(parser, streaming=False)
    add_cut_arguments(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--text-file", dest="text_file", default=None,
                        help="UTF-8 text to evaluate on (default: the built-in evaluation split); only its "
                             "first 64 KiB + 64 bytes per --max-tokens token are read")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=512, help="tokens to evaluate")
    parser.add_argument("--format", choices=("json", "csv"), default="json")
    parser.add_argument("--out", default=None, help="write here instead of stdout")


def run_evaluate(ns):
    """The model's metric (perplexity, pseudo-perplexity or embedding fidelity), dense and under the cut (any
    kind: a mask is measured in the same batched passes as dense)."""
    from analysis.measure.evaluation import evaluate
    from analysis.core.text import check_max_tokens, read_text_file, text_file_cap

    check_max_tokens(ns.max_tokens, "--max-tokens")   # before anything is read or allocated
    check_one_cut(ns, required=True)
    text = None
    if ns.text_file is not None:   # read (capped) before the model loads: a bad path fails at once
        text = read_text_file(ns.text_file, text_file_cap(ns.max_tokens), what="--text-file")
    cut, loaded, info = cut_from(ns, required=True)
    with progress_bar("evaluating", not ns.quiet) as report:
        if cut.kind == "mask":
            pruned = np.stack([np.zeros_like(cut.mask), cut.mask])    # [2, L, H]: dense, masked
            result = evaluate(loaded, text, pruned=pruned, max_tokens=ns.max_tokens, progress=report,
                              team=team_of(ns))
            dense, masked = (float(v) for v in result.values)
        else:
            result = evaluate(loaded, text, max_tokens=ns.max_tokens, progress=lambda f, m: report(f / 2, m),
                              team=team_of(ns))
            dense = float(result.value)
            masked = float(evaluate(loaded, text, cut=cut, max_tokens=ns.max_tokens,
                                    progress=lambda f, m: report(0.5 + f / 2, m), team=team_of(ns)).value)
    n_pruned = None if cut.mask is None else int(cut.mask.sum())
    payload = dict(model=info, cut=cut.as_dict(), metric=result.metric, higher_is_better=result.higher_is_better,
                   n_tokens=result.n_tokens, dense=dense, masked=masked, n_pruned=n_pruned,
                   **{k: cut.info[k] for k in ("sparsity", "scorer", "params", "policy") if k in cut.info})
    return payload, [dict(metric=result.metric, dense=dense, masked=masked, n_pruned=n_pruned)]


def _sweep_arguments(parser):
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--scorer", choices=("mp", "mp-g"), default=None,
                        help="default: mp-g on GQA/MQA models, mp on MHA models")
    from analysis.score.scorer_registry import scorer_declarations
    for name, param in scorer_declarations("mp-g").items():   # the threshold scorers' own, at their defaults
        if name != "z":
            add_param_option(parser, name, param, default=param.default)
    parser.add_argument("--sparsity", type=float, required=True)
    parser.add_argument("--z-values", dest="z_values", default=None,
                        help="comma-separated z values (default 0.5, 0.75, ..., 3.0)")
    add_policy_arguments(parser)
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=512,
                        help="tokens of each split to evaluate")
    parser.add_argument("--evaluate-all", dest="evaluate_all", action="store_true",
                        help="evaluation split for every z, not only the suggested one")
    add_output_arguments(parser)


def parse_floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"--z-values must be comma-separated numbers, e.g. 1.5,2,2.5; got {text!r}.") from None


def run_sweep(ns):
    from analysis.core.schemas import MAX_HEADS
    from analysis.core.text import MAX_TOKENS_LIMIT
    from analysis.measure.profiles import profile_model
    from analysis.score.sweep import split_evaluators, sweep_z

    check_counts(ns, {"max_tokens": (2, MAX_TOKENS_LIMIT), "min_per_layer": (0, MAX_HEADS)})   # before loading
    zs = parse_floats(ns.z_values) if ns.z_values else None

    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    resolve_scorer(ns, loaded.geometry.group_size)
    ns.policy = resolve_policy(ns, loaded.geometry.group_size)
    profile = profile_model(loaded.model, adapter=loaded.adapter, source=loaded.name)
    calibration, evaluation, metric, higher = split_evaluators(loaded, max_tokens=ns.max_tokens, team=team_of(ns))
    with progress_bar("z sweep", not ns.quiet) as report:
        result = sweep_z(profile, ns.sparsity, calibration, evaluation, zs=zs, scorer=ns.scorer,
                         scope=ns.scope, ord=ns.ord, a_q=ns.a_q, a_kv=ns.a_kv, std=ns.std, policy=ns.policy,
                         min_per_layer=ns.min_per_layer, metric=metric, higher_is_better=higher,
                         evaluate_all=ns.evaluate_all, progress=report)
    return dict(model=info, scorer=ns.scorer, **result.as_dict()), result.rows()


def _ablate_arguments(parser):
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--text-file", dest="text_file", default=None,
                        help="UTF-8 text to ablate on (default: the built-in evaluation split); only its first "
                             "64 KiB + 64 bytes per --max-tokens token are read")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=256, help="tokens of text to use")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=256,
                        help="causal LMs: the tokens are cut into sequences of at most this length")
    parser.add_argument("--method", choices=("fast", "naive"), default="fast",
                        help="fast (prefix reuse, batched gates) or naive (one full forward per head); same numbers")
    parser.add_argument("--no-groups", dest="groups", action="store_false",
                        help="skip the KV-group ablations of GQA models")
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=16, help="sequences per forward pass")
    add_output_arguments(parser)


def run_ablate(ns):
    """The metric change when each head alone (and each KV group) is removed."""
    from analysis.measure.ablation import head_ablation
    from analysis.core.text import read_text_file, text_file_cap

    from analysis.core.text import MAX_TOKENS_LIMIT
    check_counts(ns, {"max_tokens": (2, MAX_TOKENS_LIMIT), "seq_len": (2, MAX_TOKENS_LIMIT),
                      "batch_size": (1, 2**16)})                # before anything is read or allocated
    text = None
    if ns.text_file is not None:
        text = read_text_file(ns.text_file, text_file_cap(ns.max_tokens), what="--text-file")
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    with progress_bar("ablation sweep", not ns.quiet) as report:
        result = head_ablation(loaded, text, max_tokens=ns.max_tokens, seq_len=ns.seq_len, method=ns.method,
                               groups=ns.groups, batch_size=ns.batch_size, progress=report, team=team_of(ns))
    G = loaded.geometry.group_size
    L, H = result.head_delta.shape
    rows = [dict(layer=l, head=h, kv_group=h // G, delta=float(result.head_delta[l, h]),
                 group_delta=None if result.group_delta is None else float(result.group_delta[l, h // G]))
            for l in range(L) for h in range(H)]
    payload = dict(model=info, metric=result.metric, method=result.method, base=result.base_loss,
                   n_tokens=result.n_tokens, processes=team_of(ns).world, head_delta=result.head_delta,
                   group_delta=result.group_delta, seconds={k: round(v, 4) for k, v in result.timings.items()})
    return payload, rows


register("score", "score every head with one scorer", _score_arguments, run_score, distributed=True)
register("mask", "the pruning mask at a sparsity, with its summary", _mask_arguments, run_mask, distributed=True)
register("sweep", "MP / MP-G metric vs z at a fixed sparsity", _sweep_arguments, run_sweep, distributed=True)
register("evaluate", "the model's metric dense and under the mask", _evaluate_arguments, run_evaluate,
         distributed=True)
register("ablate", "the metric change when each head alone (and each KV group) is removed", _ablate_arguments,
         run_ablate, distributed=True)


def _deploy_arguments(parser):
    parser.add_argument("--dense", required=True, help="the dense model's GGUF file (same weight type as --pruned)")
    parser.add_argument("--pruned", required=True, action="append",
                        help="a pruned GGUF file, or a gguf export folder (its mask.json gives headscope's "
                             "own perplexity next to llama.cpp's); repeatable")
    parser.add_argument("--model", default="smollm2-135m",
                        help="the model the files came from: its tokenizer gives the evaluation ids (and "
                             "with a mask.json, headscope's perplexity); default smollm2-135m")
    parser.add_argument("--cache-dir", default=None, help="headscope cache folder for built-ins")
    parser.add_argument("--max-tokens", type=int, default=512, help="evaluation tokens (default 512)")
    parser.add_argument("--speed-context", type=int, default=512, help="prefill length for tokens/s")
    parser.add_argument("--threads", type=int, default=2)
    add_output_arguments(parser)


def _refuse_windows(folder) -> None:
    """An export folder whose kv_plan.json windows KV heads: llama.cpp runs every head full, so this report
    would measure the model without the plan's windows; refused with the reason (pruned KV heads are in the
    file itself: fine)."""
    from analysis.compress.export.kvfile import has_kv_plan, read_export_plan
    from analysis.core.atomic import path_problem
    if path_problem(folder) is not None or not folder.is_dir() or not has_kv_plan(folder):
        return
    plan = read_export_plan(folder)
    if plan.windowed.any():
        raise InputError(f"{folder}'s kv_plan.json windows {int(plan.windowed.sum())} KV heads, and llama.cpp runs "
                         f"every head full (it has no per-head windows): this report would measure the model "
                         f"without them. Measure the plan in PyTorch (headscope longctx / ruler / evaluate --export "
                         f"{folder}), or export the GGUF without the plan.")


def run_deploy_report(ns):
    """llama.cpp's numbers for a dense and pruned GGUF files (size, perplexity, speed, KV cache)."""
    from pathlib import Path
    from analysis.arch.models import load_model
    from analysis.compress.export.gguf.deploy import check_files, check_options, compare, verdict
    from analysis.compress.export import MASK_FILE, read_mask_json
    from analysis.compress.export.gguf.writer import GGUF_FILE
    from analysis.core.atomic import path_problem
    from analysis.measure.evaluation import default_text, evaluate, token_ids

    check_options(max_tokens=ns.max_tokens, speed_context=ns.speed_context, threads=ns.threads)

    def file_of(given: str) -> tuple[Path, Path | None]:
        path = Path(given)
        if path_problem(path) is None and path.is_dir():   # an export folder: its model.gguf (and mask.json)
            return path / GGUF_FILE, (path / MASK_FILE if os.path.lexists(path / MASK_FILE) else None)
        return path, None

    files = [file_of(ns.dense)] + [file_of(p) for p in ns.pruned]
    for given in [ns.dense, *ns.pruned]:                               # a plan is applied or refused, never dropped
        _refuse_windows(Path(given))
    check_files(files[0][0], [path for path, _ in files[1:]])          # every header, before any work
    masks = {path: read_mask_json(mask_file) for path, mask_file in files if mask_file is not None}
    loaded = load_model(ns.model, cache_dir=ns.cache_dir)
    ids = token_ids(loaded.tokenizer, default_text(), max_tokens=ns.max_tokens).tolist()
    check_files(files[0][0], [path for path, _ in files[1:]], ids)     # --model's ids fit every vocabulary
    for record in masks.values():
        record.check_geometry(loaded.geometry)
    with progress_bar("measuring in llama.cpp", not ns.quiet) as report:
        rows, ratios = compare(files[0][0], [path for path, _ in files[1:]], ids, speed_context=ns.speed_context,
                               threads=ns.threads, progress=report)
    for row, (path, _) in zip(rows, files):
        row.pop("paired", None)
        if path in masks:
            row["headscope_perplexity"] = float(evaluate(loaded, pruned=masks[path].pruned(),
                                                         max_tokens=ns.max_tokens).value)
    verdicts = [verdict(r) for r in ratios]
    for (path, _), lines in zip(files[1:], verdicts):
        for line in lines:
            sys.stderr.write(f"{path.name}: {line}\n")
    payload = {"model": ns.model, "n_tokens": len(ids), "rows": rows, "ratios": ratios, "verdicts": verdicts,
               "kv_cache": "f16 K/V; kv_mib_* with flash attention (llama.cpp's exact per-layer sizes), "
                           "kv_mib_*_no_fa without (V padded to the widest layer)",
               "speed": "steady state: interleaved rounds against the dense file after warm-up rounds; "
                        "*_no_fa without flash attention"}
    return payload, rows


register("deploy-report", "llama.cpp's size, perplexity, speed and KV cache of dense vs pruned GGUF files",
         _deploy_arguments, run_deploy_report)
