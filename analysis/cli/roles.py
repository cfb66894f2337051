"""`python -m analysis roles`: what heads do (analysis.measure.detectors), and whether MP-G finds them.

    python -m analysis roles [--model M] [--detector NAME ...] [--format json|csv] [--text-file F]
                             [--lengths 1024,2048 --depths 0.1,0.5,0.9 --needles 2 --sinks 4 --recent 256]
                             [--versus-mpg [--sparsity S] [--permutations N]]

Without --detector the quick detectors run; the long-context ones (retrieval, streaming: minutes on a CPU)
run when named (or with --detector all), and are kept on disk (analysis.score.longscan): the same options on the
same model and code are read back (`"stored"` in the JSON), `--refresh` measures again.

JSON: {"model": ..., "detectors": {NAME: {"scores": [L][H], "threshold", "unit", "tagged", extras}}}
(+ "versus_mpg": per role the ROC AUC of the MP-G score (z) and its permutation p-value, and
with --sparsity which roles the MP-G mask's pruned heads had). CSV: one row per head, one column
per detector. `--model` may be an export folder: a pruned export (head_layout.json) is loaded with
analysis.compress.export.load_pruned and its kept heads land in their original slots.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from analysis.cli.common import (add_output_arguments, add_source_arguments, add_store_arguments, check_counts,
                                 load_source, progress_bar, refused_line, register, stored_words)
from analysis.core.atomic import path_problem
from analysis.core.errors import InputError, first_line
from analysis.core.text import MAX_TOKENS_LIMIT
from analysis.score.masks import check_sparsity


def _arguments(parser):
    from analysis.measure.detector_registry import DETECTORS
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--detector", action="append", choices=tuple(DETECTORS) + ("all",), default=None,
                        help="detector to run (repeat for several; default: every quick one; all: the long-context "
                             "ones too): " + "; ".join(
                            f"{name}: {spec.help}" for name, spec in DETECTORS.items()).replace("%", "%%"))
    parser.add_argument("--text-file", dest="text_file", default=None,
                        help="UTF-8 text for the text detectors (previous-token, dla); default: the built-in "
                             "evaluation split")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, default=256, help="tokens of text to use")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--length", type=int, default=50, help="random tokens per copy (induction, duplicate)")
    parser.add_argument("--n-sequences", dest="n_sequences", type=int, default=8,
                        help="repeated random sequences (induction, duplicate)")
    parser.add_argument("--lengths", default=None,
                        help="long-context detectors: context lengths in tokens, comma-separated (default: retrieval "
                             "1024,2048, streaming and retrieval-aware 2048; at most the model's context)")
    parser.add_argument("--depths", default=None,
                        help="retrieval, retrieval-aware: needle depths, fractions of the context, comma-separated "
                             "(default 0.1,0.5,0.9)")
    parser.add_argument("--needles", type=int, default=None,
                        help="retrieval, retrieval-aware: needles per length and depth (default 2)")
    parser.add_argument("--sinks", type=int, default=None,
                        help="streaming, retrieval-aware: sink tokens the window keeps (default 4)")
    parser.add_argument("--recent", type=int, default=None,
                        help="streaming, retrieval-aware: recent tokens the window keeps, the query's own included "
                             "(default 256)")
    parser.add_argument("--queries", type=int, default=None,
                        help="streaming: query rows sampled beyond the window per sequence (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sequences and permutations")
    parser.add_argument("--versus-mpg", dest="versus_mpg", action="store_true",
                        help="ROC AUC + permutation p-value of the MP-G score for every role")
    parser.add_argument("--z", type=float, default=2.0, help="MP-G threshold z (with --versus-mpg)")
    parser.add_argument("--sparsity", type=float, default=None,
                        help="with --versus-mpg: the roles of the heads MP-G's global mask prunes at this sparsity")
    parser.add_argument("--permutations", type=int, default=10_000, help="permutations for the p-value")
    add_store_arguments(parser, precision=False)
    add_output_arguments(parser)


def _load(ns, report):
    """(loaded-like with .model/.tokenizer, head layout or None, info dict). A folder with anything named
    head_layout.json is a pruned export: its layout is read by load_pruned's own checked reader (a FIFO,
    a link to /dev/zero or a folder there is one error line, never a plain-model load)."""
    from analysis.arch.checkpoint import TOKENIZER_FILES
    from analysis.compress.export.pruned import has_layout, load_pruned, read_layout
    folder = Path(ns.model) if ns.model else None
    if folder is not None and path_problem(folder) is None and has_layout(folder):
        from transformers import AutoTokenizer

        layout = read_layout(folder)
        model = load_pruned(folder, attn_implementation="eager", trust_remote_code=ns.trust_remote_code)
        tokenizer, problem = None, "has no tokenizer files"   # transformers builds an empty one from no files
        if any((folder / f).is_file() for f in TOKENIZER_FILES):
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            except Exception as err:          # tokenizers' own errors are no ValueErrors: said below if needed
                problem = f"has a tokenizer that does not load ({first_line(err, 80)})"
        info = dict(source=str(folder), pruned_export=True, n_layers=layout.n_layers, n_heads=layout.n_heads)
        return SimpleNamespace(model=model, tokenizer=tokenizer, tokenizer_problem=problem), layout, info
    _, loaded, info = load_source(ns, report)
    return loaded, None, info


def run(ns):
    from analysis.core.text import read_text_file, text_file_cap
    from analysis.measure.detectors import (DETECTORS, MAX_PATTERN_TOKENS, MAX_REPEAT, MAX_SEQUENCES, MIN_REPEAT,
                                            detect_heads)
    from analysis.measure.profiles import check_z
    from analysis.score.specialization import MAX_PERMUTATIONS
    check_counts(ns, {"max_tokens": (2, MAX_TOKENS_LIMIT), "seq_len": (2, MAX_PATTERN_TOKENS),  # before any work
                      "length": (MIN_REPEAT, MAX_REPEAT), "n_sequences": (1, MAX_SEQUENCES),
                      "permutations": (1, MAX_PERMUTATIONS)})          # the seed: cli.main.check_seeds
    check_z(ns.z)
    if ns.sparsity is not None:
        check_sparsity(ns.sparsity)
    from analysis.measure.detector_registry import default_detectors
    from analysis.measure.long_options import MAX_NEEDLES, MAX_QUERIES
    check_counts(ns, {"needles": (1, MAX_NEEDLES), "queries": (1, MAX_QUERIES)})
    long_options = long_detector_options(ns)
    names = (default_detectors() if not ns.detector else list(DETECTORS) if "all" in ns.detector
             else list(dict.fromkeys(ns.detector)))
    text = None
    if ns.text_file is not None:
        text = read_text_file(ns.text_file, text_file_cap(ns.max_tokens), what="--text-file")
    with progress_bar("loading", not ns.quiet) as report:
        loaded, layout, info = _load(ns, report)
    needs_text = any(DETECTORS[n].needs_text for n in names)
    if loaded.tokenizer is None and needs_text:
        problem = getattr(loaded, "tokenizer_problem", "has no tokenizer")
        raise InputError(f"{ns.model} {problem}, which the text detectors need; run only --detector "
                         f"induction/duplicate-token/copying, or export with the tokenizer.")
    long_names = [n for n in names if DETECTORS[n].long] if layout is None else []
    quick = [n for n in names if n not in long_names]
    stored = {}
    with progress_bar("head detectors", not ns.quiet) as report:
        results = {}
        from analysis.core.progress import scaled
        if long_names:                       # kept on disk: the same options on the same model are read back
            from analysis.score.longscan import stored_detections
            part = scaled(report, 0.0, len(long_names) / len(names))
            found_dets, stored = stored_detections(loaded, long_names, dict(seed=ns.seed, **long_options),
                                                   progress=part, refresh=ns.refresh, on_refused=refused_line)
            results.update(found_dets)
        if quick:
            results.update(detect_heads(loaded, quick, text, max_tokens=ns.max_tokens, seq_len=ns.seq_len,
                                        layout=layout, options=dict(length=ns.length, n_sequences=ns.n_sequences,
                                                                    seed=ns.seed, **long_options),
                                        progress=scaled(report, len(long_names) / len(names), 1.0)))
        results = {n: results[n] for n in names}
    stored_words(stored, ns.quiet)
    payload = dict(model=info, stored={n: f.status for n, f in stored.items()}, detectors={
        name: dict(scores=d.scores, threshold=d.threshold, unit=d.unit,
                   tagged=[dict(layer=l, head=h, score=s) for l, h, s in d.tagged()],
                   **{k: v for k, v in d.extras.items() if k not in ("per_token", "targets")})
        for name, d in results.items()})
    if ns.versus_mpg:
        payload["versus_mpg"] = versus_mpg(loaded, results, z=ns.z, sparsity=ns.sparsity,
                                           n_permutations=ns.permutations, seed=ns.seed)
    L, H = next(iter(results.values())).scores.shape
    rows = [dict(layer=l, head=h, **{name: float(d.scores[l, h]) for name, d in results.items()})
            for l in range(L) for h in range(H)]
    return payload, rows


def number_list(text: str | None, what: str, cast=int) -> tuple | None:
    """"1024,2048" -> (1024, 2048); None stays None; anything else is one line naming the option."""
    if text is None:
        return None
    try:
        values = tuple(cast(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise InputError(f"{what} takes comma-separated numbers, e.g. {'1024,2048' if cast is int else '0.1,0.5,0.9'}; "
                         f"got {text!r}.") from None
    if not values:
        raise InputError(f"{what} is empty; give at least one number.")
    return values


def long_detector_options(ns) -> dict:
    """The long-context detectors' options that were given (the others keep their defaults), checked."""
    from analysis.arch.window import Window
    from analysis.measure.longheads import check_depths, check_lengths
    out = dict(lengths=number_list(ns.lengths, "--lengths"), depths=number_list(ns.depths, "--depths", float),
               needles=ns.needles, sinks=ns.sinks, recent=ns.recent, queries=ns.queries)
    if out["lengths"] is not None:
        check_lengths(out["lengths"])
    if out["depths"] is not None:
        check_depths(out["depths"])
    if ns.recent is not None or ns.sinks is not None:
        Window(**{k: v for k, v in (("sinks", ns.sinks), ("recent", ns.recent)) if v is not None})   # checked
    return {k: v for k, v in out.items() if v is not None}


def versus_mpg(loaded, results, *, z: float = 2.0, sparsity: float | None = None,
               n_permutations: int = 10_000, seed: int = 0) -> dict:
    """The MP-G-vs-roles section of the payload (see analysis.score.specialization)."""
    from analysis.score.masks import plan_mask
    from analysis.score.specialization import mpg_scores, pruned_roles, role_tests, strengths_of
    if getattr(loaded, "geometry", None) is None:
        raise InputError("--versus-mpg scores the dense model's weights; give the original model, not a pruned "
                         "export.")
    scores = mpg_scores(loaded, z)
    strengths = strengths_of(results)
    out = dict(z=z, zero_score_heads=scores.zero_count,
               roles=[t.as_dict() for t in role_tests(scores.scores, strengths, n_permutations=n_permutations,
                                                       seed=seed)])
    if sparsity is not None:
        plan = plan_mask(scores, sparsity, group_size=loaded.geometry.group_size)
        out["mask"] = dict(sparsity=sparsity, pruned_roles=pruned_roles(np.asarray(plan.pruned), strengths))
    return out


register("roles", "what heads do: induction, duplicate-token, previous-token, copying, successor and DLA scores, "
         "retrieval and streaming heads on long contexts (and --versus-mpg: does MP-G find them?)", _arguments, run)
