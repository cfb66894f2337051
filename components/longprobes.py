"""The long-context probes of the Long context page's plan: passkey (stated twice or once), needle and long-range
copying (analysis.measure.probes.longcontext) on the dense model and under the view's KV plan, side by side with
paired bootstrap CIs (analysis.score.longcontext.long_context_report): teacher-forced accuracy and, for the
digit answers, the generated answer's exact match with the rows the plan loses / gains; each cell LOST (or LOST
generated) when the plan's CI lies below dense; the expected time before the run, progress and Stop during it,
CSV / JSON downloads after.

The dense side depends on the probes' settings only: it is measured once per model and settings by the
page's shared scan (components/longstate.py, which gives the heads' scores of the same rows) and kept on disk, so
every later plan, visit, restart or CLI run reads it back and editing the grid and running again costs the plan's
passes alone (the estimate says which). The precision radio (float32, or bfloat16 where the CPU has it) sets
both sides' passes.
"""
from __future__ import annotations

import json

import streamlit as st

from analysis.arch.kvplan import KVPlan
from analysis.measure.long_options import DEFAULT_DEPTHS, MIN_PROBE_SEQUENCES, PAGE_LENGTH, PAGE_PROBES, PAGE_SEQUENCES

from . import cache, explain, longstate, numbers, state
from .errors import shown_errors
from .state import ModelKey

APP_LENGTH = PAGE_LENGTH          # tokens per row the page suggests (clipped to the model's context)
APP_SEQUENCES = PAGE_SEQUENCES    # sequences per depth the page suggests: the least that gives a CI (10 items)
DEPTH_CHOICES = (0.1, 0.25, 0.5, 0.75, 0.9)
MAX_SEQUENCES_APP = 64



# -- cached calls ---------------------------------------------------------------------------------

@longstate.forgotten_with_store
@st.cache_data(show_spinner=False, max_entries=16, hash_funcs=cache.KEY_HASH)
def plan_report(key: ModelKey, probes: tuple, length: int, depths: tuple, n_items: int, plan: KVPlan,
                precision: str = "float32", _progress=None, _should_stop=None):
    """LongContextReport of the plan (cached by its contents) against the dense side (components/longstate.dense:
    stored, else one scan of these rows, which stores the heads' scores too, with its own share of the progress);
    a plan with every KV head full is the dense side. Both sides run in `precision`."""
    from analysis.arch.cut import Cut
    from analysis.core.progress import scaled
    from analysis.measure.longpass import precision_block
    from analysis.score.longcontext import long_context_report
    from analysis.score.longscan import stored_report
    settings = (probes, length, depths, n_items)
    built = longstate.long_items(key, probes, length, depths, n_items)
    known = longstate.stored_dense(key, settings, precision)[0] is not None
    dense = longstate.dense(key, settings, precision, _should_stop=_should_stop,     # before the lock
                           _progress=None if known else scaled(_progress, 0.0, 0.5))
    cut = None if plan.is_full else Cut.of_plan(plan, info=dict(source="the Long context page"))
    lm = cache.load(key)
    fingerprint = longstate.fingerprint(key)
    rep, _ = stored_report(lm, built, cut, dense=dense, precision=precision, compute=False, fingerprint=fingerprint)
    if rep is not None or cut is None:                                   # stored, or dense alone: no pass left
        return rep if rep is not None else long_context_report(lm, built=built, dense=dense)
    with cache.exclusive(key, _progress, _should_stop) as lm, precision_block(lm.model, precision):
        return stored_report(lm, built, cut, dense=dense, precision=precision, should_stop=_should_stop,
                             progress=_progress if known else scaled(_progress, 0.5, 1.0),
                             fingerprint=fingerprint)[0]


def stored_plan(lm, settings: tuple, built: dict, plan: KVPlan, precision: str):
    """The plan's LongContextReport when this machine holds both sides (no model time), else None; settings: the
    section's (probes, length, depths, sequences), `built` their rows."""
    from analysis.arch.cut import Cut
    from analysis.score.longcontext import long_context_report
    from analysis.score.longscan import stored_report
    key = state.model_key()
    dense, _ = longstate.stored_dense(key, settings, precision)
    if dense is None:
        return None
    if plan.is_full:
        return long_context_report(lm, built=built, dense=dense)
    cut = Cut.of_plan(plan, info=dict(source="the Long context page"))
    rep, _ = stored_report(lm, built, cut, dense=dense, precision=precision, compute=False,
                           fingerprint=longstate.fingerprint(key))
    return rep


# -- the section -----------------------------------------------------------------------------------

def _work(key: ModelKey, built: dict, dense_known: bool, cut: bool, precision: str = "float32") -> float:
    """The run's predicted seconds (components/jobs.py's "long-plan"): its rows (the dense side's unless stored,
    the plan's) x this machine's seconds per row at the length, and the generated answers' decode calls x the
    seconds of one (components/longstate.per_row, per_step)."""
    from analysis.measure.probes.longcontext import long_work
    work = long_work(built, passes=(0 if dense_known else 1) + cut)
    return longstate.work_seconds(key, work, precision) if work.passes else 0.0


def _ci(row: dict, side: str) -> str:
    return f"{row[f'{side}_accuracy']:.2f} [{row[f'{side}_low']:.2f}, {row[f'{side}_high']:.2f}]"


def _exact(row: dict, side: str) -> str:
    key = f"{side}_exact"
    return "—" if key not in row else f"{row[key]:.2f} [{row[key + '_low']:.2f}, {row[key + '_high']:.2f}]"


def _generated(row: dict, side: str) -> str:
    key = f"{side}_generated"
    return "—" if key not in row else f"{row[key]:.2f} [{row[key + '_low']:.2f}, {row[key + '_high']:.2f}]"


def table_rows(rows: list[dict]) -> list[dict]:
    """The report's cells as the page's table (one row per probe x depth, 'all' first; the plan's columns
    only when a plan was measured; the flag column says LOST, LOST generated or both)."""
    out = []
    for r in rows:
        row = {"probe": r["label"], "depth": r["depth"], "sequences": r["n_units"], "items": r["n_items"],
               "dense accuracy": _ci(r, "dense"), "dense exact": _exact(r, "dense"),
               "dense generated": _generated(r, "dense")}
        if "cut_accuracy" in r:
            lost = ["LOST" + (" (at chance)" if r["at_chance"] else "")] if r["lost"] else []
            lost += ["LOST generated"] if r.get("generated_lost") else []
            row.update({"plan accuracy": _ci(r, "cut"), "plan exact": _exact(r, "cut"),
                        "plan generated": _generated(r, "cut"),
                        "rows lost / gained": "—" if "rows_lost" not in r else
                        f"{r['rows_lost']} / {r['rows_gained']} (p {r['mcnemar_p']:.2g})",
                        "": "; ".join(lost)})
        out.append(row)
    return out


def probe_section(lm, plan, context: int) -> None:
    """The long-context probes of `plan` (a KVPlan of this model) at a length the user picks (the page's
    context by default, clipped to what a CPU reads in minutes)."""
    from analysis.measure.probes.registry import PROBES, applicable
    st.subheader("What the plan keeps at long context")
    names = applicable(lm.kind, long=True)
    if not names:
        st.caption("No long-context probe applies to this model (they read a causal language model's next tokens).")
        return
    st.caption("Find a pass key, the right one of two numbers, or a random sequence far back in built-in text: "
               "the dense model and this plan read the same rows; a cell is LOST when the plan's 95 % interval lies "
               "below the dense accuracy, LOST generated when the answers the plan writes itself fall below dense's.")
    limit = longstate.context_limit(lm)
    c1, c2, c3, c4 = st.columns([3, 2, 3, 2])
    probes = c1.multiselect("Probes", names, format_func=lambda n: PROBES[n].label,
                            key=state.widget_key(state.PROBE_NAMES, value=list(PAGE_PROBES)))
    length = int(c2.number_input(f"Tokens per row (at most {limit:,})", 64, max(64, limit), step=256,
                                 key=state.widget_key(state.PROBE_LENGTH, value=min(context, APP_LENGTH, limit)),
                                 help="Every row is exactly this long: instruction, text, the needle at its depth, "
                                      "the question. The page's context is the default up to "
                                      f"{APP_LENGTH:,} tokens (a row's cost grows with its square)."))
    length = min(length, limit)
    depths = c3.multiselect("Depths (where the needle sits)", list(DEPTH_CHOICES),
                            key=state.widget_key(state.PROBE_DEPTHS, value=list(DEFAULT_DEPTHS)),
                            format_func=lambda d: f"{d:g}")
    n_items = int(c4.number_input("Sequences per depth", MIN_PROBE_SEQUENCES, MAX_SEQUENCES_APP, step=1,
                                  key=state.widget_key(state.PROBE_SEQUENCES, value=APP_SEQUENCES),
                                  help="One sequence = one key and its text, read at every depth (a bootstrap "
                                       "unit). More sequences: narrower intervals, proportionally longer."))
    if not probes or not depths:
        st.caption("Pick at least one probe and one depth.")
        return
    precision = longstate.precision_choice(lm)
    args = (tuple(probes), length, tuple(sorted(float(d) for d in depths)), n_items)
    built = None
    with shown_errors("Building the long-context rows"):
        built = longstate.long_items(state.model_key(), *args)
    if built is None:
        return
    known = longstate.stored_dense(state.model_key(), args, precision)[0] is not None
    rows = sum(items.ids.shape[0] for (_, _, items) in built.values())
    counts = plan.counts()
    cut = not plan.is_full
    if not cut:
        st.caption("Every KV head is full: the plan is the dense model, so the run measures dense alone (the "
                   "reference every plan is compared with).")
    sides = "dense is measured" if known else "dense and plan" if cut else "dense"
    run_key = (state.model_key(), *args, plan.to_json(), precision)
    stored = stored_plan(lm, args, built, plan, precision) if known else None
    if stored is not None:                            # every side on this machine's disk: shown at once
        state.remember_run("long.probes", run_key, stored, view=f"{counts['full']} full / {counts['window']} window "
                                                                f"/ {counts['prune']} prune, {length:,} tokens")
        st.caption("Read from this machine's stored results (the dense side and this plan's); "
                   "`headscope cache clear` removes them.")
    with shown_errors("The long-context probes"):
        rep = cache.run_button(
            f"Run the long-context probes on this plan ({rows} rows of {length:,} tokens, {sides})",
            button_key="long.probes.run", slot="long.probes", run_key=run_key,
            fn=plan_report, args=(state.model_key(), *args, plan, precision),
            label="Running the long-context probes", kind="long-plan",
            work=0.0 if stored is not None else _work(state.model_key(), built, known, cut, precision),
            view=f"{counts['full']} full / {counts['window']} window / {counts['prune']} prune, {length:,} tokens",
            stale_note="The plan or the probes' settings changed since the last run ({view}); press the button again.")
        if rep is not None:
            _show(rep)
    longstate.forget_button(lm)
    explain.fold("how to read the long-context probes", HOW_TO_READ)


def _show(rep) -> None:
    numbers.cut_verdict(table_rows(rep.rows()), cut=rep.cut is not None, warnings=rep.warnings(),
                        lost="long-context retrieval",
                        kept="No cell lost: the plan's accuracy interval reaches the dense accuracy everywhere.",
                        notes=" ".join(dict.fromkeys(rep.notes)), title="Long-context probes", file="long_context",
                        key="long.probes", csv=numbers.csv_text(rep.rows()),
                        as_json=json.dumps(rep.as_dict(), indent=1, default=str))


HOW_TO_READ = """
Each row is built offline from the built-in text and is exactly as long as asked. **Passkey**: a
five-digit key is hidden at the depth (0 = the start, 1 = just before the question) and asked for at
the end (its needle states the key twice; **passkey once** states it once, on the same keys and text);
**needle**: two cities' numbers half a context apart, the question names one; **long-range
copying**: a random token sequence at the depth, repeated at the end. Each digit (or copied token) is an
item: **accuracy** is the share whose correct token out-scores a contrast (another digit, the other
city's digit; chance 0.5) with the earlier digits given, **exact** the share of keys with every digit right.
**Generated** is how the field judges it: the model writes the answer itself (greedy, from the question
on, with the plan's own KV cache), and a row counts when the first number it writes is the key. It is
stricter than teacher-forced accuracy: a plan can keep the digits' accuracy high and still lose keys it must
write itself.
**Rows lost / gained**: rows the dense model answers and the plan does not, and the reverse (p: the exact
McNemar test of those two counts). Brackets: 95 % bootstrap intervals over sequences (a key and its text,
read at every depth); dense and plan read the same rows with the same resamples. A windowed KV head sees
only the sink tokens and the recent window: a needle further back than the window is invisible to it, so
the plan keeps retrieval only through its full heads.
"""
