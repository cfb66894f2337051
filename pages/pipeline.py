"""Pipeline page: iterative prune -> distill -> INT8 on a copy of the current model, starting from
the Prune page's view (scorer, its parameters, z, policy, kv_policy), with a live loss curve, a
time estimate, progress and Stop; then the compression report (table, chart, downloads) and the
final model's exports in every format, under the Export page's root. The cached dense model is
never changed."""
import io
import time
from pathlib import Path

import streamlit as st

from analysis.compress import export as export_mod
from analysis.compress.recover.distill import DistillConfig
from analysis.compress.recover.pipeline import PipelineConfig, export_round, round_counts
from analysis.compress.recover.frontier import FRONTIER_CHOICES
from analysis.compress.recover.report import compression_report
from analysis.compress.verdict import speed_words
from components import cache, charts, controls, explain, exports, figures, jobs, numbers, shell, state, tools, weights
from components import probes as probes_ui
from components.errors import shown_errors

shell.ensure_app()

DEFAULT_RECOVERY = 20          # a default run distills (0 would only cut)
LIVE_REDRAW_S = 1.0            # the live loss chart is redrawn at most this often

def loss_chart(points: list[dict]):
    """The distillation loss per recovery step (live during a run, once after it)."""
    return charts.curves({"distillation loss": ([p["step"] for p in points], [p["loss"] for p in points])},
                         title="Distillation loss per recovery step", x_title="recovery step (all rounds)",
                         y_title="loss (T² · KL to the dense model)")


def describe_config(c: PipelineConfig) -> str:
    """A run's settings in a few words (to say which run a report is of)."""
    rounds = "one-shot" if c.recovery_steps == 0 and c.step >= c.target_sparsity else f"step {c.step:g}"
    return (f"{controls.label(c.scorer)}, target {c.target_sparsity:g}, {rounds}, {c.recovery_steps} recovery steps, "
            f"policy {c.policy}")


def stage_rows(rep) -> list[dict]:
    """The report's stages as table rows: each number with its ratio to dense, latencies in words, the flags."""
    dense = rep.stages[0]

    def cell(s, key: str, text: str) -> str:
        """A number with its ratio to the dense model, e.g. "21.83 M (0.961x)"."""
        ratio = s.ratios.get(key)
        return text if ratio is None or s is dense else f"{text} ({ratio:.3g}x)"

    def timed(s, key: str, text: str) -> str:
        ratio = s.ratios.get(key)
        same = f" (= {s.timed_as})" if getattr(s, "timed_as", None) else ""
        return text + same if ratio is None or s is dense else f"{text} ({speed_words(1 / ratio)}){same}"

    return [{"stage": s.name, "sparsity": f"{s.sparsity:.2f}",
             "parameters": cell(s, "parameters", f"{s.parameters / 1e6:,.2f} M"),
             "size": cell(s, "size_mb", f"{s.size_mb:,.1f} MiB"),
             "attention FLOPs": cell(s, "attention_flops", f"{s.attention_flops / 1e9:,.2f} G"),
             "prefill": timed(s, "prefill_ms", f"{s.prefill_ms:,.1f} ms"),
             "decode": "—" if s.decode_ms is None else timed(s, "decode_ms", f"{s.decode_ms:,.2f} ms"),
             rep.metric: "—" if s.metric is None else cell(s, "metric", f"{s.metric:.3f}"),
             "worse than its input": "; ".join(getattr(s, "flags", None) or [])}
            for s in rep.stages]


st.title("Pipeline")
lm = cache.model_or_stop()
weights.needs_model(lm, "The Pipeline page")
g = lm.geometry
st.caption("Recover and compress. Score the heads, prune a step, recover by distillation from the dense model, rescore, "
           "repeat until the target sparsity or the perplexity budget; then INT8. Works on a copy: the loaded model "
           "is not changed.")
explain.pipeline()

z = float(state.get("z"))
c = st.columns([1.25, 1.2, 1.05])   # the longest scorer and policy labels fit at 1280x800
scorer = controls.scorer_choice(c[0], group_size=g.group_size)
policy = controls.policy_controls(c[1])
one_shot = c[2].toggle("One-shot", key=state.widget_key("pipe.one_shot", value=False),   # short: fits at 1280x800
                       help="One round, no recovery: prune to the target in one round and measure it, without "
                            "distillation: the baseline the "
                            "iterative schedule should beat.")
params = controls.current_params(scorer, z)
described = ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in params.items())
st.caption(f"Starts from the Prune page's view: **{controls.label(scorer)}** ({described or 'no parameters'}), "
           f"policy **{policy}**, KV policy **{state.get('kv_policy')}**. Scorer and policy are the same "
           "controls as on Prune; z and the scorer's parameters are set there.")

c = st.columns(4)
target = c[0].slider("Target sparsity", 0.01, 0.9, step=0.01,
                     key=state.following_widget_key("pipe.target", min(max(float(state.get("sparsity")), 0.01), 0.9)),
                     help="Fraction of all query heads pruned at the end: the Prune view's sparsity until you move it.")
step = c[1].slider("Heads per round (fraction)", 0.05, 0.9, step=0.05, key=state.widget_key("pipe.step", value=0.1),
                   disabled=one_shot, help="Fraction of all heads pruned in each round (the last round stops at the "
                                          "target). Smaller steps: more rounds, more recovery, more time.")
recovery = int(c[2].number_input("Recovery steps per round", 0, 10_000, step=10, disabled=one_shot,
                                 key=state.widget_key("pipe.recovery", value=DEFAULT_RECOVERY),
                                 help="Distillation steps after each round's cut (0: cut only, no recovery)."))
budget = float(c[3].number_input("Perplexity budget (0 = none)", 0.0, 1e6, step=1.0,
                                 key=state.widget_key("pipe.budget", value=0.0),
                                 help="Stop when a round ends above this perplexity (that round is discarded). "
                                      "Must be above the dense model's."))
c = st.columns(4)
lr = float(c[0].number_input("Learning rate", 1e-6, 1.0, format="%.6f", key=state.widget_key("pipe.lr", value=1e-4),
                             help="AdamW learning rate of the distillation."))
lora = c[1].toggle("LoRA", key=state.widget_key("pipe.lora", value=False),      # short: fits at 1280x800
                   help="Train low-rank adapters instead of every weight (less memory); they are merged into the "
                        "weights at export.")
int8 = c[2].toggle("INT8 stage (ONNX)", key=state.widget_key("pipe.int8", value=lm.kind == "causal-lm"),
                   help="After the last round: ONNX export and ONNX Runtime INT8 quantization, measured like the "
                        "other stages (causal LMs).")
eval_tokens = int(c[3].number_input("Evaluation tokens", 16, 8192, key=state.widget_key("pipe.eval", value=512),
                                    help="Tokens of the held-out text each stage is evaluated on."))
c = st.columns(4)
batch = int(c[0].number_input("Batch (sequences)", 1, 64, key=state.widget_key("pipe.batch", value=4),
                              help="Sequences per distillation step."))
seq_len = int(c[1].number_input("Sequence length", 8, 2048, key=state.widget_key("pipe.seq", value=128),
                                help="Tokens per training sequence."))
frontier_waits = tools.llama_missing() if lm.kind == "causal-lm" else "The frontier is for causal LMs."
frontier = tuple(c[3].multiselect(
    "Frontier (GGUF)", list(FRONTIER_CHOICES), key=state.widget_key("pipe.frontier", value=[]),
    disabled=bool(frontier_waits), placeholder="none",
    help=frontier_waits or "After the last round: the dense and the final model written as GGUF at these types and "
                           "run in llama.cpp on the evaluation tokens: file size vs perplexity, the Pareto frontier and "
                           "whether the cut is on it (does pruning beat quantizing the dense model harder?)."))
frontier = () if frontier_waits else frontier

config = PipelineConfig(target_sparsity=float(target), step=float(step), recovery_steps=0 if one_shot else recovery,
                        ppl_budget=budget or None, scorer=scorer,
                        scorer_params=dict(params),
                        policy=policy, kv_policy=state.get("kv_policy"), eval_tokens=eval_tokens,
                        distill=DistillConfig(lr=lr, batch_size=batch, seq_len=seq_len, lora=lora))
config = config.one_shot() if one_shot else config

rounds = len(round_counts(config.target_sparsity, config.step, g.n_total_heads))
units = jobs.pipeline_units(rounds=rounds, recovery_steps=config.recovery_steps, batch=batch, seq_len=seq_len,
                            eval_tokens=eval_tokens, int8=int8 and lm.kind == "causal-lm",
                            recovering=config.recovery_steps > 0, frontier_types=len(frontier),
                            probe_tokens=probes_ui.probe_tokens(state.model_key()))
with shown_errors("Estimating the time"):
    board, model = jobs.board(), repr(state.model_key())
    if not board.knows("forward", model):
        cache.forward_rate(state.model_key())     # one short measurement per model and server (not 4 full passes)
    clock = jobs.PhaseClock(board, model, units)
    total = clock.total_s()
    measured = all(board.knows(f"pipeline.{p}", model) for p in units)
    basis = ("this machine's pace on the last runs, phase by phase" if measured else
             "this machine's measured forward speed; the first run measures each phase's own pace")
    c[2].metric("Estimated time", "—" if total is None else jobs.seconds_words(total),
                help=f"{rounds} round(s) x {config.recovery_steps} recovery steps"
                     f"{', then the INT8 stages' if 'int8' in units else ''}; from {basis}. While it runs, the bar "
                     "says the time left, phase by phase, from the same pace and from the run's own progress.")

requested, done = state.recall("pipe.request", 0), state.recall("pipe.done", 0)
st.button("Run the pipeline", type="primary", key="pipe.run", disabled=requested > done,
          on_click=lambda: state.remember("pipe.request", state.recall("pipe.request", 0) + 1))
if requested > done:
    state.remember("pipe.done", requested)            # a rerun never starts the same press twice
    state.forget("pipe.last")
    losses: list[dict] = []
    curve = st.empty()
    drawn = [0.0]

    def on_step(record: dict) -> None:
        losses.append({"step": len(losses) + 1, "loss": record["loss"]})
        if time.monotonic() - drawn[0] >= LIVE_REDRAW_S:
            drawn[0] = time.monotonic()
            curve.plotly_chart(loss_chart(losses), width="stretch")

    try:
        with shown_errors("The pipeline"):
            with cache.tracked("Pipeline", key=state.model_key(), stoppable=True) as (bar, stop_check):
                jobs.CURRENT.get().clock = clock            # the bar's time left comes from the phases
                with cache.exclusive(state.model_key(), bar, should_stop=stop_check):
                    def report(fraction: float, message: str) -> None:
                        clock.update(fraction)
                        bar(fraction, message)

                    rep, result = compression_report(lm, config, int8=int8, progress=report,
                                                     should_stop=stop_check, on_step=on_step, frontier_types=frontier)
                    clock.finish()
            state.remember("pipe.last", (rep, result, losses, config))
    finally:
        curve.empty()                                  # the final chart is drawn once, below

note = state.stopped_note()
if note:
    st.info(note)
last = state.recall("pipe.last")
if last is not None:
    rep, result, losses, run_config = (*last, None) if len(last) == 3 else last
    dense, final = rep.stages[0], rep.stages[-1]
    if run_config is not None and run_config != config:
        st.warning("The report below is of the last run, started with other settings than the ones above "
                   f"({describe_config(run_config)}); press Run to run these.", icon=":material/history:")
    summary = (f"{int(result.pruned.sum())} of {g.n_total_heads} heads pruned in {len(result.accepted)} round(s); "
               f"{rep.metric} {result.dense_metric:.3f} -> {result.final_metric:.3f}"
               + (" (stopped by the budget)" if result.stopped_by_budget else ""))
    grown = [f"{what} {after / before:.3g}x dense" for what, after, before in (
        ("parameters", final.parameters, dense.parameters), ("file size", final.size_mb, dense.size_mb),
        ("attention FLOPs", final.attention_flops, dense.attention_flops)) if before and after > before]
    (st.warning if grown else st.success)(summary)
    numbers.show_growth(grown)
    if losses:
        figures.chart(loss_chart(losses), "pipe.loss_chart")
    st.subheader("Compression report")
    worse = [s for s in rep.stages if getattr(s, "flags", None)]
    if worse:
        st.error("Worse than the stage it was made from: " + "; ".join(
            f"**{s.name}** ({', '.join(s.flags)})" for s in worse), icon=":material/warning:")
    numbers.flagged_table(stage_rows(rep), flag="worse than its input")
    st.caption("In brackets: the ratio to the dense model (latencies in words: faster or slower than dense); "
               "above 1 on parameters, size or FLOPs means that stage is bigger. Red rows are worse than the stage "
               "they were made from. '= X': timed once on X, a model of the same shapes.")
    for line in rep.warnings:
        st.warning(line)
    probes_ui.pipeline_capabilities(rep)           # each stage's capability probes against dense
    if rep.frontier:
        from analysis.compress.recover.frontier import verdict
        st.markdown("#### The frontier in llama.cpp")
        figures.chart(charts.frontier(rep.frontier, title=f"{lm.name}: GGUF size vs llama.cpp perplexity"),
                      "pipe.frontier_chart")
        for line in verdict(rep.frontier):
            st.caption(line)
    curves = {name: (c["sparsity"], c["metric"]) for name, c in rep.curves.items()} or {
        "stages": ([s.sparsity for s in rep.stages], [s.metric for s in rep.stages])}
    figures.chart(charts.curves(curves, title=f"{rep.metric} vs head sparsity", x_title="head sparsity",
                                  y_title=rep.metric, log_y=charts.log_axis(rep.metric)), "pipe.metric_chart")
    png = io.BytesIO()
    rep.plot_png(png)
    d = st.columns(3)
    d[0].download_button("report.json", rep.to_json(), file_name="report.json", mime="application/json",
                         key="pipe.dl.json")
    d[1].download_button("report.md", rep.to_markdown(), file_name="report.md", mime="text/markdown",
                         key="pipe.dl.md")
    d[2].download_button("ppl_vs_sparsity.png", png.getvalue(), file_name="ppl_vs_sparsity.png", mime="image/png",
                         key="pipe.dl.png")

    st.subheader("Export the final model")
    output_root = exports.kept_root()
    if output_root is not None:
        st.caption(f"Into the export root set on the Export page: **{output_root}**.")
        c1, c2 = st.columns([1, 2])
        fmt = c1.selectbox("Format", list(export_mod.FORMATS), key=state.widget_key("pipe.fmt", value="pruned"),
                           format_func=lambda name: export_mod.FORMATS[name].label,
                           help="The formats of the Export page; a lossy one (INT8, quantized GGUF) is measured "
                                "against its float model on this CPU before it is written.")
        folder = c2.text_input(f"Folder inside {output_root}",
                               key=state.widget_key("pipe.folder", value=f"{Path(lm.name).name}-pipeline"))
        waiting = tools.llama_missing() if tools.gguf_needs_llama(fmt, {}) else ""
        if waiting:
            st.info(waiting, icon=":material/hourglass_top:")
        if st.button("Export", key="pipe.export", disabled=bool(waiting)):
            with shown_errors("Exporting"):
                with cache.progress_bar(f"Exporting ({export_mod.FORMATS[fmt].label})"):
                    written = export_round(fmt, result.model, result.pruned, result.head_rounds, output_root, folder,
                                           tokenizer=lm.tokenizer, kv_policy=config.kv_policy,
                                           dtype=lm.source_dtype)     # the checkpoint's dtype, not the load's
                st.success(f"Wrote the {export_mod.FORMATS[fmt].label} export to {written.path}.")
                for line in written.notes:
                    st.caption(line)
