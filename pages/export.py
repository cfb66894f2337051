"""Export page: download the current mask as JSON; export the pruned model (zeroed, physically
pruned, stock-loadable, ONNX, GGUF) into a folder under the output root. Exports work on a copy. A GGUF
export can be measured in llama.cpp next to the dense model (the deployment report); the mask can be
measured with EleutherAI's lm-evaluation-harness (components/harness.py)."""
from pathlib import Path

import numpy as np

import streamlit as st

from analysis.compress import export as export_mod
from analysis.compress import timing
from analysis.compress.export.gguf import deploy
from components import cache, charts, controls, explain, exports, figures, numbers, shell, state, tools, views, weights
from components import harness as harness_ui
from components import longctx
from components import probes as probes_ui
from components.errors import shown_errors

shell.ensure_app()

MIN_REPEATS = 5      # fewer timings per setting: on a shared CPU their median is mostly noise
STOCK_FORMATS = ("stock",)   # the formats loaded by a stock config (the "stock config" note is about them)
DEPLOY_TOKENS = 512          # the deployment report's perplexity tokens (its work unit for the estimate)

st.title("Export")
lm = cache.model_or_stop()
g = lm.geometry
explain.export()

built = views.view_mask(lm)
if built is None:
    shell.end_run()
head_scores, plan, params, policy = built
scorer, sparsity = state.get("scorer"), float(state.get("sparsity"))
described = ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in params.items())
st.caption(f"Current mask: {controls.label(scorer)} ({described or 'no parameters'}), sparsity {sparsity:g}, "
           f"policy {policy}: **{plan.n_pruned} of {g.n_total_heads} heads pruned** (red = pruned). "
           "Change it on the Prune page.")
figures.chart(charts.mask_heatmap(plan.pruned, head_scores.scores, score_name=controls.label(scorer),
                                    group_size=g.group_size), "export.mask")

st.subheader("Mask JSON")
with shown_errors("Writing the mask JSON"):
    record = export_mod.mask_record(plan.pruned, geometry=g, model=lm.name, model_type=lm.adapter.model_type,
                                    scores=head_scores, sparsity=sparsity, policy=policy)
    st.download_button("Download mask.json", record.to_json(), file_name="mask.json", mime="application/json",
                       key="export.mask_json")

st.subheader("Pruned model")
def export_section() -> None:
    """Root, format, its options, the folder, what surgery makes of the mask, and the Export button
    (disabled, with the reason above it, while the root cannot take an export)."""
    output_root = exports.root_widget()           # None: exports off, or a root that cannot take them (shown why)
    c1, c2 = st.columns([1, 2])
    names = weights.export_formats(export_mod.FORMATS)                 # the format registry (weights only: streamed)
    fmt = c1.selectbox("Format", names, format_func=lambda f: export_mod.FORMATS[f].label or f,
                       key=state.widget_key("export.format" + (".streamed" if state.weights_only() else ""),
                                            value=names[0]))
    form = export_mod.FORMATS[fmt]
    c1.caption(form.help + (f" Weights only: {weights.STREAMED_HELP}." if state.weights_only() else ""))
    # a physical format is cut by surgery (kv_policy applies); a full-shape one keeps the original shapes
    surgery = {"kv_policy": numbers.kv_policy_choice(c1)} if form.physical else {}
    kv_policy = surgery.get("kv_policy", "auto")
    options = controls.format_options(c1, fmt, form.options)
    auto_name = f"{Path(lm.name).name}-{scorer}-s{sparsity:g}-{policy}-{fmt}"
    folder = c2.text_input("Folder name (follows the settings until you edit it)",
                           key=state.following_widget_key("export.folder", auto_name))
    if output_root is not None:
        st.caption(f"Writes **{output_root / folder.strip()}**.")
    if surgery:
        with shown_errors("Counting what surgery removes"):
            summary = numbers.summary_of(lm, plan, head_scores, kv_policy)
            numbers.show_summary(summary, flops_len=512, kind=lm.kind)
            if fmt in STOCK_FORMATS:                 # only a stock export needs a stock config to describe the cut
                numbers.show_stock(numbers.stock_of(lm, plan.pruned, kv_policy, sparsity))
            numbers.show_notes(summary)
    if not state.weights_only():
        whole_model(plan, kv_policy, fmt, options)
    waiting = tools.llama_missing() if tools.gguf_needs_llama(fmt, options) else ""
    if waiting:
        st.info(waiting, icon=":material/hourglass_top:")
    overwrite = st.checkbox("Replace the folder if it exists", key=state.widget_key("export.overwrite", value=False))
    view_words = (f"{controls.label(scorer)} ({described or 'no parameters'}), sparsity {sparsity:g}, policy {policy}: "
                  f"{plan.n_pruned} heads pruned")
    if st.button("Export", type="primary", key="export.run", disabled=output_root is None or bool(waiting),
                 help=waiting or (None if output_root is not None else "Nothing can be written: see the export root "
                                                                       "above.")):
        state.forget("export.last")
        with shown_errors("Exporting"):
            if state.weights_only():
                stop = cache.stop_button("export")
                with cache.progress_bar(f"Exporting ({form.label})") as report:
                    result = weights.export_streamed(lm, fmt, plan.pruned, output_root, folder.strip(), record=record,
                                                     kv_policy=kv_policy, overwrite=overwrite, progress=report,
                                                     should_stop=state.should_stop, kv_plan=longctx.export_plan(lm),
                                                     **options)
                stop.empty()
            else:
                with cache.progress_bar(f"Exporting ({form.label})") as report, cache.exclusive(state.model_key(),
                                                                                                 report):
                    result = export_mod.export(fmt, lm.model, plan.pruned, output_root, folder.strip(), record=record,
                                               tokenizer=lm.tokenizer, overwrite=overwrite, progress=report, **surgery,
                                               dtype=lm.source_dtype, kv_plan=longctx.export_plan(lm),
                                               **options)   # the checkpoint's dtype
            state.remember("export.last", dict(result=result, pruned=plan.pruned.copy(), view=view_words,
                                               options=dict(options)))



def whole_model(plan, kv_policy: str, fmt: str, options: dict) -> None:
    """Before the export: what the cut changes in the whole model (parameters, this format's file, the KV
    cache), in percent of the model -- the summary above counts attention only."""
    rows = cache.cached_call(cache.whole_model_change, state.model_key(), plan.pruned, kv_policy, fmt,
                             tuple(sorted(options.items())), label="Counting the whole model")
    if rows is None:
        return
    st.markdown("**The whole model, dense and cut** (in this format)")
    numbers.wide_table([{"whole model": r["whole model"],
                         "dense": "—" if r["dense"] is None else f"{r['dense']:,}",
                         "cut": "—" if r["cut"] is None else f"{r['cut']:,}",
                         "change": "—" if r["change"] is None else f"{r['change']:+,}",
                         "change, % of the model": "—" if r["change, % of the model"] is None
                         else f"{r['change, % of the model']:+.2f}%"} for r in rows])


def side_by_side(plan) -> None:
    """A few prompts continued by the dense model and by the cut (greedy), next to each other."""
    st.subheader("Dense vs cut, side by side")
    prompts = st.text_area("Prompts (one per line)", key=state.widget_key(
        "export.prompts", value="\n".join(cache.GENERATE_PROMPTS)), height=100)
    lines = tuple(line.strip() for line in prompts.splitlines() if line.strip())[:8]
    new_tokens = int(st.number_input("New tokens", 1, 64, key=state.widget_key("export.gen_tokens", value=12)))
    rows = cache.run_button("Generate with both", button_key="export.generate", slot="export.generate",
                            run_key=(lm.name, plan.pruned.tobytes(), lines, new_tokens), fn=cache.generate_side_by_side,
                            args=(state.model_key(), plan.pruned, lines, new_tokens), label="Generating",
                            kind="evaluate", work=2 * len(lines) * new_tokens * 4,
                            stale_note="The mask or the prompts changed since ({view}); press the button again.",
                            view=f"{plan.n_pruned} heads pruned", disabled=not lines)
    if rows is not None:
        numbers.wide_table(rows)
        st.caption("Greedy decoding (the most likely next token each time). The cut is the dense model with its "
                   "pruned heads switched off, which computes what the exported cut computes.")


def last_export(plan) -> None:
    """The last export written in this session, marked when the view has changed since (it is the
    export's own mask that the deployment report measures, never the view's)."""
    last = state.recall("export.last")
    if not isinstance(last, dict):
        return
    result = last["result"]
    label = export_mod.FORMATS[result.format].label if result.format in export_mod.FORMATS else result.format
    st.success(f"Wrote the {label} export to {result.path} ({result.total_bytes / 2**20:.1f} MiB).")
    if not np.array_equal(last["pruned"], plan.pruned):
        st.warning(f"This export is of another view ({last['view']}); the mask above has changed since. "
                   "Press Export to write the current one.", icon=":material/history:")
    for note in result.notes:        # leftovers cleaned; a lossy file's self-check (a failed one was replaced)
        (st.warning if note.startswith("self-check FAILED") else st.info)(note)
    st.dataframe([{"file": name, "bytes": size} for name, size in result.files.items()], hide_index=True)
    if result.format == "gguf" and state.weights_only():
        st.caption("The deployment report also writes and runs the dense model's GGUF: load the model (Model page) "
                   "to measure this file next to it.")
    elif result.format == "gguf":
        deployment_report(last)


def deployment_report(last: dict) -> None:
    """The llama.cpp deployment report of the last GGUF export (dense next to it), with progress and Stop;
    what the pruned file does worse than dense in red, and the rows as a download."""
    result = last["result"]
    weight_type = last["options"].get("gguf_type", "f16")
    st.markdown("**Deployment report (llama.cpp)**: this file next to the dense model at the same weight type "
                f"({weight_type}), measured by llama.cpp itself, with headscope's own perplexity of the cut.")
    run_key = (lm.name, str(result.path), weight_type, last["pruned"].tobytes())
    waiting = tools.llama_missing()
    if waiting:
        st.info(waiting, icon=":material/hourglass_top:")
    pressed = st.button("Measure in llama.cpp", key="export.deploy", disabled=bool(waiting))
    st.caption(cache.estimate_words(state.model_key(), "deploy", DEPLOY_TOKENS))
    if pressed:
        with shown_errors("Measuring in llama.cpp"):
            with cache.tracked("Deployment report", key=state.model_key(), kind="deploy", work=DEPLOY_TOKENS,
                               stoppable=True) as (bar, should_stop):
                with cache.exclusive(state.model_key(), bar, should_stop=should_stop) as loaded:
                    measured = deploy.deployment_report(loaded, last["pruned"], result, weight_type, progress=bar,
                                                        should_stop=should_stop, max_tokens=DEPLOY_TOKENS)
            state.remember_run("export.deploy", run_key, measured, view=last["view"])
    measured = state.run_result("export.deploy", run_key)
    if measured is None:
        return
    rows = measured["rows"]
    dense, pruned = rows
    worse = pruned.get("worse_than_dense")
    if worse:
        st.error(f"The pruned file is worse than the dense one in llama.cpp: {worse}.", icon=":material/warning:")
    numbers.flagged_table(numbers.deployment_table(dense, pruned), flag="worse")
    for line in measured["verdict"]:
        st.markdown(f"- {line}")
    st.caption("Perplexity on the built-in evaluation split (512 tokens, headscope's token ids); tokens/s "
               "in steady state on this machine (interleaved rounds after untimed warm-up rounds, the per-round "
               "spread in the lines above); KV cache as llama.cpp allocates it (f16), with flash attention on and "
               "off. Red: worse than dense.")
    import json
    st.download_button("Deployment report (JSON)", json.dumps(measured, indent=1, default=str),
                       file_name="deployment_report.json", mime="application/json", key="export.deploy.json")


longctx.export_section(lm)                  # the Long context page's KV plan (kv_plan.json), when one is set
if exports.mode() == "off":
    st.info(exports.OFF_NOTE, icon=":material/block:")
else:
    export_section()
last_export(plan)
if lm.kind == "causal-lm" and not state.weights_only():
    side_by_side(plan)
weights.needs_model(lm, "The measured report (latency of dense vs pruned)")
st.subheader("Measured report")
kv_policy = state.get("kv_policy")           # the view's (Export's box for a physical format sets it too)
with shown_errors("Measuring"):
    c1, c2 = st.columns([2, 1])
    lengths = c1.multiselect("Prefill lengths (tokens)", list(timing.PREFILL_LENGTHS),
                             key=state.widget_key("export.speed.lengths", value=[128]))
    repeats = int(c2.number_input("Repeats", 1, 50, step=1, key=state.widget_key("export.speed.repeats",
                                                                                  value=MIN_REPEATS),
                                  help=f"Timings per setting (their median is shown). Below {MIN_REPEATS} the "
                                       "noise of a shared CPU is larger than most differences measured."))
    if repeats < MIN_REPEATS:
        st.warning(f"{repeats} repeat(s) is too few: on a shared CPU one timing varies by more than the "
                   f"differences it measures (e.g. a masked model 'faster' than the dense one). Use at least "
                   f"{MIN_REPEATS}.")
    speed_key = (lm.name, plan.pruned.tobytes(), tuple(lengths), repeats, kv_policy)
    st.caption("Times the dense model, the masked model (hooks zero the heads: same FLOPs) and the physically "
               "pruned copy in alternating order, on this machine.")
    report = cache.run_button("Measure dense vs masked vs pruned", button_key="export.measure",
                              slot="export.speed", run_key=speed_key, fn=cache.speed_report,
                              args=(state.model_key(), plan.pruned, tuple(sorted(lengths)), repeats, kv_policy),
                              label="Measuring", kind="speed", work=3 * repeats * (sum(lengths) or 1),
                              stale_note="The mask or the settings changed since the last measurement; press the button again.")
    if report is not None:
        predicted = report.predicted
        st.caption(f"kv_policy '{predicted['kv_policy']}'. Predicted from the mask (Prune page): parameters "
                   f"{-predicted['params_removed']:+,}, KV cache {predicted['kv_cache_ratio']:.3g}x; measured on the "
                   f"pruned copy below.")
        m = st.columns(3)
        if report.repeats < MIN_REPEATS:
            st.error(f"Measured with only {report.repeats} repeat(s): the times and ratios below are within the "
                     f"noise. Measure again with at least {MIN_REPEATS} repeats before reading them.")
        m[0].metric("Parameters", f"{report.parameters['pruned']:,}",
                    f"{report.parameters['pruned'] - report.parameters['dense']:+,}", delta_color="inverse")
        if report.file_bytes:
            m[1].metric("File size", f"{report.file_bytes['pruned'] / 2**20:.1f} MiB",
                        f"{(report.file_bytes['pruned'] - report.file_bytes['dense']) / 2**20:+.1f} MiB",
                        delta_color="inverse")
        m[2].metric("Heads pruned", f"{report.heads_pruned} / {report.heads_total}")
        numbers.show_growth([what for what, grew in {
            f"parameters {report.parameters['pruned'] - report.parameters['dense']:+,}":
                report.parameters["pruned"] > report.parameters["dense"],
            "file bytes above the dense checkpoint":
                bool(report.file_bytes) and report.file_bytes["pruned"] > report.file_bytes["dense"],
            f"KV cache {predicted['kv_cache_ratio']:.3g}x dense": lm.kind != "encoder" and predicted["kv_cache_ratio"] > 1,
        }.items() if grew])
        numbers.wide_table(report.rows())
        for note in report.notes:              # how to read the ratios; the one FLOP convention
            st.caption(note)
        if report.skipped:
            st.caption("Skipped: " + "; ".join(report.skipped))

kv_plan = longctx.export_plan(lm)                    # the Long context page's plan, when it is written with the model
probes_ui.cut_panel(lm, plan.pruned, where="export", plan=kv_plan)   # what the exported cut breaks
harness_ui.panel(lm, plan.pruned, where="export", kv_plan=kv_plan)   # the field's zero-shot benchmarks, dense vs it
