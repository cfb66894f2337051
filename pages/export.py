"""Export page: download the current mask as JSON; export the pruned model (zeroed, physically
pruned, stock-loadable, ONNX, GGUF) into a folder under the output root. Exports work on a copy. A GGUF
export can be measured in llama.cpp next to the dense model (the deployment report)."""
from pathlib import Path

import streamlit as st

from analysis.compress import export as export_mod
from analysis.compress import speed
from analysis.compress.export.gguf import deploy
from components import cache, charts, controls, explain, numbers, shell, state, views, weights
from components import probes as probes_ui
from components.errors import shown_errors

shell.ensure_app()

MIN_REPEATS = 5      # fewer timings per setting: on a shared CPU their median is mostly noise

st.title("Export")
lm = cache.model_or_stop()
g = lm.geometry
explain.export()

built = views.view_mask(lm)
if built is None:
    st.stop()
head_scores, plan, params, policy = built
scorer, sparsity = state.get("scorer"), float(state.get("sparsity"))
described = ", ".join(f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in params.items())
st.caption(f"Current mask: {controls.label(scorer)} ({described or 'no parameters'}), sparsity {sparsity:g}, "
           f"policy {policy}: **{plan.n_pruned} of {g.n_total_heads} heads pruned** (red = pruned). "
           "Change it on the Prune page.")
st.plotly_chart(charts.mask_heatmap(plan.pruned, head_scores.scores, score_name=controls.label(scorer),
                                    group_size=g.group_size), width="stretch", key="export.mask")

st.subheader("Mask JSON")
with shown_errors("Writing the mask JSON"):
    record = export_mod.mask_record(plan.pruned, geometry=g, model=lm.name, model_type=lm.adapter.model_type,
                                    scores=head_scores, sparsity=sparsity, policy=policy)
    st.download_button("Download mask.json", record.to_json(), file_name="mask.json", mime="application/json",
                       key="export.mask_json")

st.subheader("Pruned model")
default_root = str(export_mod.default_export_root())
root_text = st.text_input("Export root: every export becomes a folder in here",
                          key=state.widget_key("export.root", value=default_root),
                          help=f"Default {export_mod.DEFAULT_EXPORT_ROOT}, or the folder in the environment variable "
                               f"{export_mod.EXPORT_ROOT_ENV}.")
output_root = Path(root_text.strip() or default_root).expanduser()
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
st.caption(f"Writes **{output_root / folder.strip()}**.")
if surgery:
    with shown_errors("Counting what surgery removes"):
        summary = numbers.summary_of(lm, plan, head_scores, kv_policy)
        numbers.show_summary(summary, flops_len=512, kind=lm.kind)
        numbers.show_stock(numbers.stock_of(lm, plan.pruned, kv_policy, sparsity))
        numbers.show_notes(summary)
overwrite = st.checkbox("Replace the folder if it exists", key=state.widget_key("export.overwrite", value=False))
if st.button("Export", type="primary", key="export.run"):
    state.forget("export.last")
    with shown_errors("Exporting"):
        if state.weights_only():
            stop = cache.stop_button("export")
            with cache.progress_bar(f"Exporting ({fmt}, streamed)") as report:
                result = weights.export_streamed(lm, fmt, plan.pruned, output_root, folder.strip(), record=record,
                                                 kv_policy=kv_policy, overwrite=overwrite, progress=report,
                                                 should_stop=state.should_stop, **options)
            stop.empty()
        else:
            with cache.progress_bar(f"Exporting ({fmt})") as report, cache.exclusive(state.model_key(),
                                                                                      report):
                result = export_mod.export(fmt, lm.model, plan.pruned, output_root, folder.strip(), record=record,
                                           tokenizer=lm.tokenizer, overwrite=overwrite, progress=report, **surgery,
                                           **options)
        state.remember("export.last", result)
last = state.recall("export.last")
if last is not None:
    st.success(f"Wrote the {last.format} export to {last.path} ({last.total_bytes / 2**20:.1f} MiB).")
    for note in last.notes:        # leftovers cleaned; a lossy file's self-check (a failed one was replaced)
        (st.warning if note.startswith("self-check FAILED") else st.info)(note)
    st.dataframe([{"file": name, "bytes": size} for name, size in last.files.items()], hide_index=True)
    if last.format == "gguf" and state.weights_only():
        st.caption("The deployment report also writes and runs the dense model's GGUF: load the model (Model page) "
                   "to measure this file next to it.")
    elif last.format == "gguf":
        st.markdown("**Deployment report (llama.cpp)**: this file next to the dense model at the same weight type, "
                    "measured by llama.cpp itself, with headscope's own perplexity of the cut.")
        if st.button("Measure in llama.cpp", key="export.deploy"):
            state.forget("export.deploy_rows")
            with shown_errors("Measuring in llama.cpp"):
                with st.spinner("Writing the dense GGUF and measuring both files (about a minute)"):
                    rows = deploy.deployment_rows(lm, plan.pruned, last, options.get("gguf_type", "f16"))
                state.remember("export.deploy_rows", rows)
        rows = state.recall("export.deploy_rows")
        if rows is not None:
            st.dataframe(rows, hide_index=True, width="stretch")
            st.caption("Perplexity on the built-in evaluation split (512 tokens, headscope's token ids); tokens/s "
                       "at 512 tokens of context on this machine; KV cache as llama.cpp allocates it (f16, flash "
                       "attention).")

weights.needs_model(lm, "The measured report (latency of dense vs pruned)")
st.subheader("Measured report")
with shown_errors("Measuring"):
    c1, c2 = st.columns([2, 1])
    lengths = c1.multiselect("Prefill lengths (tokens)", list(speed.PREFILL_LENGTHS),
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
                              label="Measuring",
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
        st.dataframe(report.rows(), hide_index=True, width="stretch")
        st.caption(speed.RATIO_NOTE)
        if report.skipped:
            st.caption("Skipped: " + "; ".join(report.skipped))

probes_ui.cut_panel(lm, plan.pruned, where="export")     # the report's capability check of this mask
