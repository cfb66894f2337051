"""Write the "What a cut breaks" section of docs/results.md: capability probes on SmolLM2.

Parts (each saved into --state as it finishes, so a long run can be split; --render writes the section
from the saved numbers):
  dense     every probe on the dense model, with each BOS choice (auto = nothing for SmolLM2, eos, bos)
  maps      each probe's per-head map (fast sweep, --map-items items), its top heads with CIs
  roles     the detectors' induction / duplicate-token / previous-token heads among each probe's top 10,
            and MP-G (z = 2) as a classifier of each probe's top-10 heads (ROC AUC, permutation p)
  cuts      the 25 % masks of MP-G, the head gate, the gradient scorer and random (seed 0), the model's
            default policy, one-shot: every probe dense vs cut
  recovery  each of those cuts distilled from the dense model for --steps steps, then the probes again
  domains   head importance on Wikipedia vs Python source, and the cuts scored on each

    nice -n 5 .venv/bin/python scripts/probes_results.py --parts dense,maps,roles,cuts,domains \
        --state docs/data/probes.json [--cache-dir DIR] [--steps 60] [--render --out docs/results.md]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]

SCORERS = {"mp-g": "MP-G (z = 2)", "gate": "Head gate (Michel)", "gradient": "Gradient-Head", "random": "Random (seed 0)"}
ROLES = ("induction", "duplicate-token", "previous-token")


def _save(state: dict, path: Path) -> None:
    from analysis.cli.common import to_jsonable
    from analysis.core.atomic import atomic_write
    atomic_write(path, json.dumps(to_jsonable(state), indent=1), what="the state file")


def part_dense(lm, state, args):
    from analysis.measure.probes.breaks import build_applicable, dense_scores
    out = {}
    for bos in ("auto", "eos", "bos"):
        built, skipped = build_applicable(lm, None, options=dict(bos=bos, n_items=args.items))
        t0 = time.perf_counter()
        scores = dense_scores(lm, built)
        out[bos] = dict(seconds=time.perf_counter() - t0, skipped=skipped, probes={
            n: dict(s.row(), n_tokens=s.n_tokens, rejected=s.rejected, conditions={k: float(v[0]) for k, v in
                                                                                 s.conditions.items()})
            for n, s in scores.items()})
    state["dense"] = out


def part_anaphor(lm, state, args):
    """The anaphor probe with the subject as the prompt's first word vs after a lead-in, with each BOS."""
    from analysis.measure.probes.measure import run_probes
    out = {}
    for lead in (False, True):
        for bos in ("auto", "eos"):
            s = run_probes(lm, ["anaphor"], options=dict(n_items=args.items, bos=bos, lead_ins=lead))["anaphor"]
            out[f"{'lead-in' if lead else 'subject first'}, bos {bos}"] = dict(
                accuracy=float(s.accuracy[0]), low=float(s.accuracy_ci[0, 0]), high=float(s.accuracy_ci[0, 1]),
                conditions={k: float(v[0]) for k, v in s.conditions.items()})
    state["anaphor"] = out


def part_maps(lm, state, args):
    from analysis.measure.probes.measure import build_items
    from analysis.measure.probes.circuit import probe_map
    out = {}
    for name, (spec, _, items) in build_items(None, lm.tokenizer, lm.kind, options=dict(n_items=args.map_items)).items():
        m = probe_map(lm.model, spec, items)
        out[name] = dict(base=m.base, n_items=m.n_items, seconds=m.seconds, drop=m.drop, group_drop=m.group_drop,
                         top=[dict(head=f"L{l}H{h}", drop=d, low=float(m.drop_ci[l, h, 0]), high=float(m.drop_ci[l, h, 1]))
                              for l, h, d in m.top(10)])
        print(f"  map {name}: {m.seconds:.0f} s, top {m.top(3)}", flush=True)
    state["maps"] = out


def part_roles(lm, state, args):
    import numpy as np
    from types import SimpleNamespace
    from analysis.measure.detectors import detect_heads
    from analysis.measure.probes.circuit import role_overlap
    from analysis.score.specialization import mpg_scores, probe_strengths, role_tests
    det = detect_heads(lm, list(ROLES))
    maps = {n: SimpleNamespace(drop=np.asarray(m["drop"], dtype=np.float64), top=None) for n, m in state["maps"].items()}
    overlap = {}
    for name, m in maps.items():
        from analysis.measure.probes.circuit import ProbeMap
        pm = ProbeMap(name, name, 0.0, m.drop, None, None, 0, "fast", 0.0)
        overlap[name] = role_overlap(pm, det, k=10)
    tests = role_tests(mpg_scores(lm, 2.0).scores, probe_strengths(maps, 10), n_permutations=10_000, seed=0)
    state["roles"] = dict(overlap=overlap, mpg=[t.as_dict() for t in tests],
                          n_with_role={r: int(d.has_role.sum()) for r, d in det.items()})


def _masks(lm):
    import numpy as np
    from analysis.score.masks import default_policy, plan_mask
    from analysis.score.scoring import get_scorer
    g = lm.geometry
    policy = default_policy(g.group_size)
    out = {}
    for name in SCORERS:
        params = {"seed": 0} if name == "random" else {}
        plan = plan_mask(get_scorer(name, **params).score(lm), 0.25, group_size=g.group_size, policy=policy)
        out[name] = np.asarray(plan.pruned)
    return out, policy


def part_cuts(lm, state, args):
    import numpy as np
    from analysis.measure.probes.breaks import build_applicable, compare, dense_scores
    from analysis.measure.probes.measure import measure_probes
    masks, policy = _masks(lm)
    built, _ = build_applicable(lm, None, options=dict(n_items=args.items))
    dense = dense_scores(lm, built)
    both = measure_probes(lm.model, built, pruned=np.stack(list(masks.values())))      # [4, L, H] one pass
    state["cuts"] = dict(policy=policy, sparsity=0.25, masks={k: v for k, v in masks.items()},
                         rows={scorer: [compare(dense[n], both[n], b).row() for n in both]
                               for b, scorer in enumerate(masks)})


def part_recovery(lm, state, args):
    import numpy as np
    from analysis.compress.recover.distill import DistillConfig, distill
    from analysis.compress.surgery import prune_heads
    from analysis.measure.evaluation import evaluate
    from analysis.measure.probes.breaks import build_applicable, compare, dense_scores
    from analysis.measure.probes.measure import measure_probes
    built, _ = build_applicable(lm, None, options=dict(n_items=args.items))
    dense = dense_scores(lm, built)
    cfg = DistillConfig(steps=args.steps, lr=1e-4, batch_size=4, seq_len=128, temperature=1.0,
                        warmup_steps=max(1, args.steps // 10), precision="auto")
    out = state.setdefault("recovery", {})
    for scorer in SCORERS:
        if scorer in out:
            continue
        pruned = np.asarray(state["cuts"]["masks"][scorer], dtype=bool)
        student, _ = prune_heads(lm.model, pruned, share=True)
        t0 = time.perf_counter()
        res = distill(lm, student, config=cfg)
        seconds = time.perf_counter() - t0
        from dataclasses import replace
        after = measure_probes(res.model, built)
        ppl = evaluate(replace(lm, model=res.model), max_tokens=2048).value
        out[scorer] = dict(seconds=seconds, steps=args.steps, perplexity=ppl,
                           rows=[compare(dense[n], after[n]).row() for n in after])
        print(f"  recovered {scorer}: {seconds:.0f} s, perplexity {ppl:.2f}", flush=True)
        _save(state, args.state)
    state["recovery_config"] = dict(steps=args.steps, lr=1e-4, batch_size=4, seq_len=128, temperature=1.0,
                                    warmup_steps=max(1, args.steps // 10), precision="auto")


def part_domains(lm, state, args):
    from analysis.score.domains import builtin_text_set, compare_domains
    rep = compare_domains(lm, builtin_text_set("wikipedia"), builtin_text_set("python"), sparsity=0.25,
                          max_tokens=args.domain_tokens, seq_len=32, eval_tokens=1024)
    state["domains"] = dict(rep.as_dict(), answer=rep.answer(), tokens=args.domain_tokens)


def part_domain_cuts(lm, state, args):
    """More sparsities for the domain cuts, from the importance maps the domains part measured."""
    import numpy as np
    from analysis.score.domains import builtin_text_set, domain_cuts
    d = state["domains"]
    imps = {d["a"]["name"]: np.asarray(d["a"]["importance"]), d["b"]["name"]: np.asarray(d["b"]["importance"])}
    t0 = time.perf_counter()
    cuts = domain_cuts(lm, builtin_text_set("wikipedia"), builtin_text_set("python"), imps,
                       sparsities=(0.05, 0.1, 0.25), eval_tokens=1024)
    d["cuts"], d["cut_seconds"] = cuts, time.perf_counter() - t0


PARTS = {"dense": part_dense, "anaphor": part_anaphor, "maps": part_maps, "roles": part_roles, "cuts": part_cuts, "recovery": part_recovery,
         "domains": part_domains, "domain_cuts": part_domain_cuts}


def _flag(r) -> str:
    return (" **LOST, at chance**" if r["at_chance"] else " **LOST**") if r["lost"] else ""


def _acc(r, side):
    return f"{r[f'{side}_accuracy']:.3f} [{r[f'{side}_low']:.2f}, {r[f'{side}_high']:.2f}]"


def render(state: dict) -> str:
    from analysis.measure.probes import PROBES
    from analysis.measure.probes.breaks import PROBES_MARKERS
    begin, end = PROBES_MARKERS
    meta = state["meta"]
    lines = [begin, "## What a cut breaks: capability probes on smollm2-135m (scripts/probes_results.py)", "",
             "Regenerated by:", "", "```", *meta["commands"], "```", "",
             f"{meta.get('machine', '')}. Definitions: docs/DEFINITIONS.md, 'What a cut breaks'. Accuracy = share of items "
             "whose correct token out-scores its contrast (chance 0.5); [95 % bootstrap CI over the items' "
             "sequences, 1,000 resamples]; the same items (seed 0) for every model and cut.", ""]
    d = state.get("dense")
    if d:
        lines += ["### Dense accuracy per probe", "",
                  "| probe | items (tokens) | accuracy [95 % CI] | logit difference [95 % CI] | by condition | left out by the tokenizer |",
                  "|---|---:|---:|---:|---|---|"]
        for n, r in d["auto"]["probes"].items():
            conds = ", ".join(f"{k} {v:.2f}" for k, v in r["conditions"].items())
            rej = ", ".join(f"{v} {k}" for k, v in r["rejected"].items()) or "none"
            extra = f"; ICL score {r['icl_score']:.2f} nats" if "icl_score" in r else ""
            lines.append(f"| {PROBES[n].label} | {r['n_items']} ({r['n_tokens']}) | {r['accuracy']:.3f} "
                         f"[{r['accuracy_low']:.3f}, {r['accuracy_high']:.3f}] | {r['logit_diff']:.2f} "
                         f"[{r['logit_diff_low']:.2f}, {r['logit_diff_high']:.2f}]{extra} | {conds} | {rej} |")
        lines += ["", "BOS (what a prompt starts with): SmolLM2's tokenizer adds nothing, so `auto` prompts start with their "
                  "first word. The same items with a BOS of `<|endoftext|>` (eos, the document separator it was trained "
                  "with) or `<|im_start|>` (its bos token, a chat marker):", "",
                  "| probe | auto (nothing) | eos: <\\|endoftext\\|> | bos: <\\|im_start\\|> |", "|---|---:|---:|---:|"]
        for n in d["auto"]["probes"]:
            cells = [d[b]["probes"][n] for b in ("auto", "eos", "bos")]
            lines.append(f"| {PROBES[n].label} | " + " | ".join(
                f"{c['accuracy']:.3f} [{c['accuracy_low']:.2f}, {c['accuracy_high']:.2f}]" for c in cells) + " |")
        an = state.get("anaphor")
        if an:
            lines += ["", "Investigated (the anaphor probe near chance for male subjects in its first version, where the subject "
                      "was the prompt's first word): accuracy [95 % CI] by condition, the same draws with and without a "
                      "lead-in, with and without a BOS:", "",
                      "| anaphor prompts | all | male | female | plural |", "|---|---:|---:|---:|---:|"]
            for k, r in an.items():
                c = r["conditions"]
                lines.append(f"| {k} | {r['accuracy']:.3f} [{r['low']:.2f}, {r['high']:.2f}] | {c.get('male', 0):.2f} | "
                             f"{c.get('female', 0):.2f} | {c.get('plural', 0):.2f} |")
            lines += ["", "The probe keeps the lead-in (docs/DEFINITIONS.md)."]
        lines.append(f"\nDense probes took {d['auto']['seconds']:.1f} s for all six ({sum(r['n_tokens'] for r in d['auto']['probes'].values())} tokens) on this machine.")
        lines.append("")
    m = state.get("maps")
    if m:
        lines += ["### The heads behind each probe", "",
                  f"Drop of the mean logit difference when one head is removed (fast sweep; {next(iter(m.values()))['n_items']} "
                  "items per probe, copying: whole sequences), top 5 with the 95 % CI over units:", "",
                  "| probe | dense logit diff | top heads: drop [CI] | map seconds |", "|---|---:|---|---:|"]
        for n, r in m.items():
            lines.append(f"| {PROBES[n].label} | {r['base']:.2f} | " + "; ".join(
                f"{t['head']} {t['drop']:.2f} [{t['low']:.2f}, {t['high']:.2f}]" for t in r["top"][:5])
                + f" | {r['seconds']:.0f} |")
        lines.append("")
    ro = state.get("roles")
    if ro:
        n_with = ro["n_with_role"]
        lines += ["Roles among each probe's top 10 heads (detectors of analysis.measure.detectors; in brackets what 10 "
                  "random heads would give: 10 x the share of heads with the role, " +
                  ", ".join(f"{r}: {n} of 270 heads" for r, n in n_with.items()) + "):", "",
                  "| probe | " + " | ".join(ROLES) + " |", "|---|" + "---|" * len(ROLES)]
        for n, rows in ro["overlap"].items():
            by = {r["role"]: r for r in rows}
            lines.append(f"| {PROBES[n].label} | " + " | ".join(
                f"{by[r]['with_role']} ({by[r]['expected']:.1f}){': ' + ', '.join(by[r]['heads']) if by[r]['heads'] else ''}"
                for r in ROLES) + " |")
        lines += ["", "Does MP find them? MP-G (z = 2) as a classifier of each probe's top-10 heads (ROC AUC > 0.5: MP keeps "
                  "them; p from 10,000 seeded label permutations):", "", "| probe top-10 heads | ROC AUC | p | mean MP-G with / without |",
                  "|---|---:|---:|---:|"]
        for t in ro["mpg"]:
            lines.append(f"| {t['role']} | {t['auc']:.3f} | {t['p_value']:.4f} | {t['mean_mpg_with']:.3g} / "
                         f"{t['mean_mpg_without']:.3g} |")
        lines.append("")
    c = state.get("cuts")
    if c:
        rec = state.get("recovery", {})
        lines += [f"### Which capabilities the 25 % cuts keep ({c['policy']} policy)", "",
                  "Dense vs each cut, one-shot" + (" and after recovery" if rec else "") + "; LOST = the cut's CI lies below "
                  "the dense accuracy.", "",
                  "| probe | dense | " + " | ".join(f"{SCORERS[s]} one-shot" + (f" | {SCORERS[s]} recovered" if s in rec else "")
                                                   for s in c["rows"]) + " |",
                  "|---|---:|" + "---:|" * sum(2 if s in rec else 1 for s in c["rows"])]
        names = [r["probe"] for r in next(iter(c["rows"].values()))]
        for i, n in enumerate(names):
            first = next(iter(c["rows"].values()))[i]
            cells = []
            for s, rows in c["rows"].items():
                r = rows[i]
                cells.append(_acc(r, "cut") + _flag(r))
                if s in rec:
                    cells.append(_acc(rec[s]["rows"][i], "cut") + _flag(rec[s]["rows"][i]))
            lines.append(f"| {PROBES[n].label} | {_acc(first, 'dense')} | " + " | ".join(cells) + " |")
        lines.append("")
        kept = {s: [PROBES[r["probe"]].label for r in rows if not r["lost"]] for s, rows in c["rows"].items()}
        lines.append("One-shot, kept (not lost): " + "; ".join(f"{SCORERS[s]}: {len(v)} of {len(names)}" for s, v in kept.items()) + ".")
        if rec:
            cfg = state["recovery_config"]
            lines.append(f"After recovery: distillation from the dense model, {cfg['steps']} steps of {cfg['batch_size']} x "
                         f"{cfg['seq_len']} tokens (lr {cfg['lr']:g}, warmup {cfg['warmup_steps']}, T = {cfg['temperature']:g}, "
                         f"precision {cfg['precision']}; a shorter schedule than the recovery section's 500 steps), "
                         "perplexity on the first 2,048 evaluation tokens: " + "; ".join(
                             f"{SCORERS[s]} {r['perplexity']:.2f} ({r['seconds'] / 60:.1f} min)" for s, r in rec.items()) + ".")
        else:
            lines.append("After recovery: not measured here (see the note below).")
        lines.append("")
    dm = state.get("domains")
    if dm:
        import numpy as np
        ci = np.asarray(dm["difference_ci"], dtype=np.float64)
        lines += ["### Domains: Wikipedia vs Python source", "",
                  f"Head importance (loss increase when one head is removed) on the first {dm['tokens']} tokens of each "
                  "set's scoring part in sequences of 32 (the bootstrap resamples them); cuts ranked by each "
                  "set's importance (default policy), evaluated on 1,024 held-out tokens of both (windows of 64; "
                  "short windows, so the dense perplexities are higher than the 512-token windows above).", "",
                  f"- Heads whose difference CI excludes 0: " + "; ".join(f"{k}: {len(v)} ({', '.join(f'L{l}H{h}' for l, h, _ in v[:6])})"
                                                                      for k, v in dm["specific"].items()) + f" (of {ci.shape[0] * ci.shape[1]}).", "",
                  "| model | Wikipedia perplexity [CI] (x dense) | Python source perplexity [CI] (x dense) |", "|---|---:|---:|"]
        for cut in dm["cuts"]:
            label = ("dense" if cut["scored_on"] == "dense" else
                     f"{cut.get('sparsity', 0.25):.0%} cut scored on {cut['scored_on']} ({cut['n_pruned']} heads)")
            lines.append(f"| {label} | {cut['ppl_a']:.2f} [{cut['ppl_a_ci'][0]:.2f}, {cut['ppl_a_ci'][1]:.2f}] ({cut['ratio_a']:.3f}x) | "
                         f"{cut['ppl_b']:.2f} [{cut['ppl_b_ci'][0]:.2f}, {cut['ppl_b_ci'][1]:.2f}] ({cut['ratio_b']:.3f}x) |")
        lines += ["", f"({dm['seconds']:.0f} s.) " + "; ".join(state.get("notes", {}).get("domains", [])), ""]
    for note in state.get("notes", {}).get("general", []):
        lines.append(note)
    lines.append(end)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--parts", default="", help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--state", type=Path, default=ROOT / "docs" / "data" / "probes.json")
    p.add_argument("--items", type=int, default=96, help="items per probe for the accuracies")
    p.add_argument("--map-items", type=int, default=24)
    p.add_argument("--steps", type=int, default=60, help="recovery steps per cut")
    p.add_argument("--domain-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--render", action="store_true")
    p.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    state = json.loads(args.state.read_text()) if args.state.is_file() else {}
    parts = [x for x in args.parts.split(",") if x]
    if parts:
        from analysis.arch.models import load_model
        lm = load_model("smollm2-135m", cache_dir=args.cache_dir)
        meta = state.setdefault("meta", {"commands": []})
        import sys
        meta["commands"].append("nice -n 5 .venv/bin/python scripts/probes_results.py " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:])))
        for part in parts:
            t0, load0 = time.perf_counter(), os.getloadavg()
            print(f"part {part} ...", flush=True)
            PARTS[part](lm, state, args)
            meta.setdefault("parts", {})[part] = dict(seconds=time.perf_counter() - t0, load_before=load0,
                                                      load_after=os.getloadavg())
            print(f"part {part}: {time.perf_counter() - t0:.0f} s", flush=True)
            _save(state, args.state)
        meta["machine"] = (f"{platform.machine()}, {args.threads} torch threads, Python {platform.python_version()}; "
                           "the machine was shared with other work (load averages per part in the state file)")
    if args.render:
        from analysis.core.atomic import write_section
        from analysis.measure.probes.breaks import PROBES_MARKERS
        text = render(state)
        write_section(args.out, text, *PROBES_MARKERS, what="The results file")
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
