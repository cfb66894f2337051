"""`python -m analysis probes` and `python -m analysis domains`: what a model can do, what a cut breaks,
which heads carry each probe, and which heads matter more for one text than another.

    python -m analysis probes [--model M] [--probe NAME ...] [--items N] [--probe-seed S] [--bos auto|none|bos|eos]
                              [--sparsity S (+ scorer / policy options) | --mask-file mask.json|DIR | --kv-plan F
                               | --export DIR]
                              [--map [--map-method fast|naive] [--top K] [--roles]] [--format json|csv] [--out F]
    python -m analysis probes --list [--format json|csv] [--out F]
    python -m analysis domains [--model M] [--a wikipedia|python|FILE] [--b ...] [--sparsity S] [--tokens N] ...

probes JSON: {"model", "probes": {name: dense numbers}, "cut": dense vs cut (analysis.measure.probes.breaks)
with "lost" and "warnings", "skipped": {probe: reason}, "maps": {name: per-head drop [L][H], CIs, top heads,
"versus_mpg": ROC AUC and permutation p of MP-G (z = 2) for the probe's top-10 heads, "roles" with --roles}}.
CSV: one row per probe (dense, or dense vs cut), or with --map one row per probe and head. A cut is a mask
(scored here with --sparsity, or a mask.json / an export folder's mask.json with --mask-file) applied to
--model, a KV plan (--kv-plan) run on --model, or an export folder's own weights (--export: a pruned / zeroed /
stock export, e.g. a recovered pipeline model, under its kv_plan.json when it has one) measured on the same
items: the cut options every report shares (analysis.cli.common.add_cut_arguments). A lost capability is also a warning on stderr.
probes --list: the registered probes (analysis.measure.probes.PROBES: name, label, the model kinds each
applies to, its help line and source), read from their declarations: no model is loaded and nothing heavy is
imported. JSON {"probes": [...]}; CSV one row per probe (kinds separated by spaces).
domains JSON: importance per head on both sets with CIs, their difference, the domain-specific heads, and
the cuts scored on each set evaluated on both (analysis.score.domains); CSV: one row per head.
"""
from __future__ import annotations

from pathlib import Path

from analysis.cli.common import (add_cut_arguments, add_output_arguments, add_source_arguments, check_one_cut,
                                 cut_from, load_source, progress_bar, register, team_of, warn)
from analysis.core.errors import InputError


def _probe_arguments(parser):
    from analysis.measure.probes.registry import BOS_CHOICES, DEFAULT_ITEMS, PROBES
    parser.add_argument("--list", dest="list_probes", action="store_true",
                        help="list the registered probes (name, label, the model kinds they apply to, what each "
                             "tests) and exit: no model is loaded; with --format csv one row per probe")
    add_source_arguments(parser, streaming=False)
    parser.add_argument("--probe", action="append", choices=tuple(PROBES) + ("all",), default=None,
                        help="probe to run (repeat for several; default: every probe that applies): "
                             + "; ".join(f"{n}: {s.help}" for n, s in PROBES.items()))
    parser.add_argument("--items", type=int, default=None, help=f"items per probe (default {DEFAULT_ITEMS})")
    parser.add_argument("--probe-seed", dest="probe_seed", type=int, default=0,
                        help="which items (and the bootstrap's resamples); --seed is the random scorer's")
    parser.add_argument("--bos", choices=BOS_CHOICES, default="auto",
                        help="what a causal prompt starts with: auto = what the tokenizer adds itself")
    add_cut_arguments(parser)
    parser.add_argument("--map", action="store_true", help="per-head maps: the drop of each probe when each head "
                                                            "alone (and each KV group) is removed")
    parser.add_argument("--map-method", dest="map_method", choices=("fast", "naive"), default="fast",
                        help="fast sweep (default) or the naive loop (the reference; same numbers)")
    parser.add_argument("--top", type=int, default=5, help="top heads per probe to list (with --map)")
    parser.add_argument("--roles", action="store_true",
                        help="with --map: which detector roles (induction, duplicate-token, previous-token) the "
                             "probes' top heads have")
    add_output_arguments(parser)


def list_probes() -> tuple[dict, list[dict]]:
    """`probes --list`: the registered probes, from their records (nothing imported, no model)."""
    from analysis.measure.probes.registry import PROBES
    probes = [dict(name=name, label=spec.label, kinds=list(spec.kinds), long=spec.long, help=spec.help,
                   source=spec.source) for name, spec in PROBES.items()]
    return dict(probes=probes), [dict(p, kinds=" ".join(p["kinds"])) for p in probes]


def run_probes(ns):
    if ns.list_probes:
        return list_probes()
    if ns.items is not None and ns.items < 1:
        raise InputError(f"--items must be at least 1; got {ns.items}.")
    if ns.top < 1:
        raise InputError(f"--top must be at least 1; got {ns.top}.")
    from analysis.measure.probes.breaks import build_applicable, cut_report, dense_scores
    check_one_cut(ns)
    cut, loaded, info = cut_from(ns)
    options = dict(seed=ns.probe_seed, bos=ns.bos, n_items=ns.items)
    built, skipped = build_applicable(loaded, ns.probe, options=options)   # bad probes fail before any pass
    payload = dict(model=info, seed=ns.probe_seed, skipped=skipped,
                   items={n: dict(n_items=it.n_items, n_units=it.n_units, n_tokens=it.n_tokens,
                                  rejected=it.rejected_counts(), notes=list(it.notes))
                          for n, (_, _, it) in built.items()})
    with progress_bar("probes", not ns.quiet) as report:
        dense = dense_scores(loaded, built, seed=ns.probe_seed, progress=report, team=team_of(ns))
    payload["probes"] = {n: s.as_dict() for n, s in dense.items()}
    rows = [s.row() for s in dense.values()]
    if cut is not None:
        with progress_bar("probes (cut)", not ns.quiet) as report:
            rep = cut_report(loaded, cut, built=built, skipped=skipped, dense=dense, seed=ns.probe_seed,
                             progress=report, team=team_of(ns))
        payload["cut"] = dict(**cut.as_dict(), **rep.as_dict())
        rows = rep.rows()
        warn(rep.warnings())
    if ns.map:
        payload["maps"], rows = _maps(ns, loaded, built)
    return payload, rows


def _maps(ns, loaded, built):
    from analysis.measure.probes.circuit import probe_map, role_overlap
    maps, rows = {}, []
    with progress_bar("per-head maps", not ns.quiet) as report:
        for i, (name, (spec, _, items)) in enumerate(built.items()):
            sub = (lambda f, m, i=i: report((i + f) / len(built), m))
            m = probe_map(loaded.model, spec, items, method=ns.map_method, seed=ns.probe_seed, progress=sub, team=team_of(ns))
            maps[name] = dict(m.as_dict(), top=[dict(layer=l, head=h, drop=d) for l, h, d in m.top(ns.top)])
            G = loaded.geometry.group_size
            rows += [dict(probe=name, layer=l, head=h, drop=float(m.drop[l, h]),
                          low=None if m.drop_ci is None else float(m.drop_ci[l, h, 0]),
                          high=None if m.drop_ci is None else float(m.drop_ci[l, h, 1]), kv_group=h // G,
                          group_drop=None if m.group_drop is None else float(m.group_drop[l, h // G]))
                     for l in range(m.drop.shape[0]) for h in range(m.drop.shape[1])]
            built[name] = (spec, m, items)
    from analysis.score.specialization import mpg_scores, probe_strengths, role_tests
    mpg = mpg_scores(loaded, 2.0).scores                                   # does MP-G keep each probe's top heads?
    for test, name in zip(role_tests(mpg, probe_strengths({n: m for n, (_, m, _) in built.items()}, 10), seed=0),
                          built):
        maps[name]["versus_mpg"] = test.as_dict()
    if ns.roles:
        from analysis.measure.detectors import detect_heads
        with progress_bar("head detectors", not ns.quiet) as report:
            det = detect_heads(loaded, ["induction", "duplicate-token", "previous-token"], progress=report)
        for name, (_, m, _) in built.items():
            maps[name]["roles"] = role_overlap(m, det, k=ns.top)
    return maps, rows


def _domain_arguments(parser):
    from analysis.score.domains import (BUILTIN_SETS, DEFAULT_EVAL_TOKENS, DEFAULT_SCORE_TOKENS, DEFAULT_SEQ_LEN)
    add_source_arguments(parser, streaming=False)
    for flag, default in (("--a", "wikipedia"), ("--b", "python")):
        parser.add_argument(flag, default=default, help=f"text set {flag[2:].upper()}: {' or '.join(BUILTIN_SETS)} "
                                                       f"(built in) or a UTF-8 text file (default {default})")
    parser.add_argument("--sparsity", type=float, default=0.25, help="sparsity of the cuts scored on each set")
    parser.add_argument("--policy", default=None, help="mask policy of the cuts (default: the model's)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_SCORE_TOKENS, help="tokens of each set the head "
                                                                                "importance is measured on")
    parser.add_argument("--seq-len", dest="seq_len", type=int, default=DEFAULT_SEQ_LEN,
                        help="tokens per sequence (the bootstrap resamples sequences)")
    parser.add_argument("--eval-tokens", dest="eval_tokens", type=int, default=DEFAULT_EVAL_TOKENS,
                        help="held-out tokens of each set the cuts are evaluated on")
    parser.add_argument("--seed", type=int, default=0)
    add_output_arguments(parser)


def _text_set(value: str, flag: str):
    from analysis.core.text import read_text_file
    from analysis.score.domains import BUILTIN_SETS, USER_TEXT_MAX_BYTES, builtin_text_set, user_text_set
    if value in BUILTIN_SETS:
        return builtin_text_set(value)
    raw = read_text_file(value, USER_TEXT_MAX_BYTES + 1, what=flag)   # one byte more: "too large" is seen, not cut
    return user_text_set(f"{flag} {Path(value).name}", raw)


def run_domains(ns):
    from analysis.core.errors import check_whole_number
    from analysis.score.domains import compare_domains
    for option, low in (("tokens", 4), ("seq_len", 2), ("eval_tokens", 4)):
        check_whole_number(getattr(ns, option), f"--{option.replace('_', '-')}", low=low, high=2**20)
    a, b = _text_set(ns.a, "--a"), _text_set(ns.b, "--b")             # bad text fails before the model loads
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    with progress_bar("domains", not ns.quiet) as report:
        rep = compare_domains(loaded, a, b, sparsity=ns.sparsity, policy=ns.policy, max_tokens=ns.tokens,
                              seq_len=ns.seq_len, eval_tokens=ns.eval_tokens, seed=ns.seed, progress=report,
                              team=team_of(ns))
    L, H = rep.difference.shape
    ci = rep.difference_ci
    rows = [dict(layer=l, head=h, importance_a=float(rep.a.mean[l, h]), importance_b=float(rep.b.mean[l, h]),
                 difference=float(rep.difference[l, h]),
                 low=None if ci is None else float(ci[l, h, 0]), high=None if ci is None else float(ci[l, h, 1]))
            for l in range(L) for h in range(H)]
    return dict(model=info, answer=rep.answer(), **rep.as_dict()), rows


register("probes", "capability probes (IOI, agreement, anaphor, copying, code, successor): dense vs a cut with CIs, "
         "and per-head maps (--map)", _probe_arguments, run_probes, distributed=True)
register("domains", "per-head importance on two text sets (Wikipedia vs Python source, or your own) and cuts "
         "scored on one evaluated on both", _domain_arguments, run_domains, distributed=True)
