"""Export page: download the current mask as JSON; export the pruned model (zeroed, physically
pruned, stock-loadable, ONNX) into a folder under the output root. Exports work on a copy."""
from pathlib import Path

import streamlit as st

from analysis.compress import export as export_mod
from analysis.compress import speed
from components import cache, charts, controls, explain, numbers, shell, state, views
from components.errors import shown_errors

shell.ensure_app()

st.title("Export")
lm = cache.model_or_stop()
g = lm.geometry
explain.export()

built = views.view_mask(lm)
if built is None:
    st.stop()
head_scores, plan, params, policy = built
scorer, sparsity = state.get("scorer"), float(state.get("sparsity"))
st.caption(f"Current mask: {controls.label(scorer)} with {params or 'no parameters'}, sparsity {sparsity:g}, "
           f"policy {policy['policy']}: **{plan.n_pruned} of {g.n_total_heads} heads pruned**. Change it on the "
           "Prune page.")
st.plotly_chart(charts.mask_heatmap(plan.pruned, head_scores.scores, score_name=controls.label(scorer),
                                    group_size=g.group_size), width="stretch", key="export.mask")

st.subheader("Mask JSON")
with shown_errors("Writing the mask JSON"):
    record = export_mod.mask_record(plan.pruned, geometry=g, model=lm.name, model_type=lm.adapter.model_type,
                                    scores=head_scores, sparsity=sparsity, policy=policy["policy"])
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
names = list(export_mod.FORMATS)                                    # the format registry
fmt = c1.selectbox("Format", names, format_func=lambda f: export_mod.FORMATS[f].label or f,
                   key=state.widget_key("export.format", value=names[0]))
form = export_mod.FORMATS[fmt]
c1.caption(form.help)
# a physical format is cut by surgery (kv_policy applies); a full-shape one keeps the original shapes
surgery = {"kv_policy": numbers.kv_policy_choice(c1)} if form.physical else {}
kv_policy = surgery.get("kv_policy", "auto")
options = controls.format_options(c1, fmt, form.options)
auto_name = f"{Path(lm.name).name}-{scorer}-s{sparsity:g}-{policy['policy']}-{fmt}"
folder = c2.text_input("Folder name (follows the settings until you edit it)",
                       key=state.following_widget_key("export.folder", auto_name))
st.caption(f"Writes **{output_root / folder.strip()}**.")
if surgery:
    with shown_errors("Counting what surgery removes"):
        numbers.show_summary(numbers.summary_of(lm, plan, head_scores, kv_policy), flops_len=512)
        numbers.show_stock(numbers.stock_of(lm, plan.pruned, kv_policy, sparsity))
overwrite = st.checkbox("Replace the folder if it exists", key=state.widget_key("export.overwrite", value=False))
if st.button("Export", type="primary", key="export.run"):
    state.forget("export.last")
    with shown_errors("Exporting"):
        with cache.progress_bar(f"Exporting ({fmt})") as report, cache.exclusive(lm.name, state.load_options(), report):
            result = export_mod.export(fmt, lm.model, plan.pruned, output_root, folder.strip(), record=record,
                                       tokenizer=lm.tokenizer, overwrite=overwrite, progress=report, **surgery,
                                       **options)
        state.remember("export.last", result)
last = state.recall("export.last")
if last is not None:
    st.success(f"Wrote the {last.format} export to {last.path} ({last.total_bytes / 2**20:.1f} MiB).")
    for note in last.notes:
        st.info(note)
    st.dataframe([{"file": name, "bytes": size} for name, size in last.files.items()], hide_index=True)

st.subheader("Measured report")
with shown_errors("Measuring"):
    c1, c2 = st.columns([2, 1])
    lengths = c1.multiselect("Prefill lengths (tokens)", list(speed.PREFILL_LENGTHS),
                             key=state.widget_key("export.speed.lengths", value=[128]))
    repeats = int(c2.number_input("Repeats", 1, 50, step=1, key=state.widget_key("export.speed.repeats", value=3)))
    speed_key = (lm.name, plan.pruned.tobytes(), tuple(lengths), repeats, kv_policy)
    st.caption("Times the dense model, the masked model (hooks zero the heads: same FLOPs) and the physically "
               "pruned copy in alternating order, on this machine.")
    report = cache.run_button("Measure dense vs masked vs pruned", button_key="export.measure",
                              slot="export.speed", run_key=speed_key, fn=cache.speed_report,
                              args=(lm.name, state.load_options(), plan.pruned, tuple(sorted(lengths)), repeats, kv_policy),
                              label="Measuring",
                              stale_note="The mask or the settings changed since the last measurement; press the button again.")
    if report is not None:
        predicted = report.predicted
        st.caption(f"kv_policy '{predicted['kv_policy']}'. Predicted from the mask (Prune page): parameters "
                   f"{-predicted['params_removed']:+,}, KV cache {predicted['kv_cache_ratio']:.3g}x; measured on the "
                   f"pruned copy below.")
        m = st.columns(3)
        m[0].metric("Parameters", f"{report.parameters['pruned']:,}",
                    f"{report.parameters['pruned'] - report.parameters['dense']:+,}", delta_color="inverse")
        if report.file_bytes:
            m[1].metric("File size", f"{report.file_bytes['pruned'] / 2**20:.1f} MiB",
                        f"{(report.file_bytes['pruned'] - report.file_bytes['dense']) / 2**20:+.1f} MiB",
                        delta_color="inverse")
        m[2].metric("Heads pruned", f"{report.heads_pruned} / {report.heads_total}")
        st.dataframe(report.rows(), hide_index=True, width="stretch")
        st.caption(speed.RATIO_NOTE)
        if report.skipped:
            st.caption("Skipped: " + "; ".join(report.skipped))
