"""Pipeline page: iterative prune -> distill -> INT8 on a copy of the current model, with a live loss
curve, progress and Stop; then the compression report (table, plot, downloads) and the final
model's exports in every format. The cached dense model is never changed."""
import io
import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from analysis.compress import export as export_mod
from analysis.compress.distill import DistillConfig
from analysis.compress.pipeline import PipelineConfig, export_round
from analysis.compress.report import compression_report
from components import cache, shell, state
from components.errors import shown_errors

shell.ensure_app()

st.title("Pipeline")
lm = cache.model_or_stop()
g = lm.geometry
st.caption("Recover and compress. Score the heads, prune a step, recover by distillation from the dense model, rescore, repeat until "
           "the target sparsity or the perplexity budget; then INT8. Works on a copy: the loaded model is not "
           "changed.")

c = st.columns(4)
target = c[0].slider("Target sparsity", 0.05, 0.9, step=0.05, key=state.widget_key("pipe.target", value=0.25))
step = c[1].slider("Heads per round (fraction)", 0.05, 0.9, step=0.05, key=state.widget_key("pipe.step", value=0.1))
recovery = int(c[2].number_input("Recovery steps per round", 0, 10_000, step=10,
                                 key=state.widget_key("pipe.recovery", value=0)))
budget = float(c[3].number_input("Perplexity budget (0 = none)", 0.0, 1e6, step=1.0,
                                 key=state.widget_key("pipe.budget", value=0.0)))
c = st.columns(4)
scorer = c[0].selectbox("Scorer", ["mp-g", "mp", "magnitude", "wanda", "random"],
                        key=state.widget_key("pipe.scorer", value="mp-g"))
lr = float(c[1].number_input("Learning rate", 1e-6, 1.0, format="%.6f", key=state.widget_key("pipe.lr", value=1e-4)))
lora = c[2].toggle("LoRA (merged at export)", key=state.widget_key("pipe.lora", value=False))
int8 = c[3].toggle("INT8 stage (ONNX)", key=state.widget_key("pipe.int8", value=lm.kind == "causal-lm"))
c = st.columns(3)
batch = int(c[0].number_input("Batch (sequences)", 1, 64, key=state.widget_key("pipe.batch", value=4)))
seq_len = int(c[1].number_input("Sequence length", 8, 2048, key=state.widget_key("pipe.seq", value=128)))
eval_tokens = int(c[2].number_input("Evaluation tokens", 16, 8192, key=state.widget_key("pipe.eval", value=512)))
one_shot = st.checkbox("One-shot (one round, no recovery)", key=state.widget_key("pipe.one_shot", value=False))

config = PipelineConfig(target_sparsity=float(target), step=float(step), recovery_steps=recovery,
                        ppl_budget=budget or None, scorer=scorer, eval_tokens=eval_tokens,
                        distill=DistillConfig(lr=lr, batch_size=batch, seq_len=seq_len, lora=lora))
config = config.one_shot() if one_shot else config

if st.button("Run the pipeline", type="primary", key="pipe.run"):
    state.forget("pipe.last")
    losses: list[dict] = []
    curve = st.empty()

    def on_step(record: dict) -> None:
        losses.append({"step": len(losses) + 1, "loss": record["loss"]})
        curve.line_chart(pd.DataFrame(losses).set_index("step"), height=220)

    stop = cache.stop_button("pipeline")
    stop_check = state.stop_check()
    try:
        with shown_errors("The pipeline"):
            with cache.progress_bar("Pipeline") as report, cache.exclusive(lm.name, state.load_options(), report,
                                                                          should_stop=stop_check):
                rep, result = compression_report(lm, config, int8=int8, progress=report,
                                                 should_stop=stop_check, on_step=on_step)
            state.remember("pipe.last", (rep, result, losses))
    finally:
        stop.empty()
        state.clear_stop()

note = state.stopped_note()
if note:
    st.info(note)
last = state.recall("pipe.last")
if last is not None:
    rep, result, losses = last
    st.success(f"{int(result.pruned.sum())} of {g.n_total_heads} heads pruned in {len(result.accepted)} round(s); "
               f"{rep.metric} {result.dense_metric:.3f} -> {result.final_metric:.3f}"
               + (" (stopped by the budget)" if result.stopped_by_budget else ""))
    if losses:
        st.line_chart(pd.DataFrame(losses).set_index("step"), height=220)
    st.subheader("Compression report")
    st.dataframe([{"stage": s.name, "sparsity": s.sparsity, "parameters": s.parameters, "size MB": round(s.size_mb, 2),
                   "attention FLOPs": s.attention_flops, "prefill ms": round(s.prefill_ms, 2),
                   "decode ms": None if s.decode_ms is None else round(s.decode_ms, 2), rep.metric: s.metric,
                   **{f"{k} ratio": round(v, 3) for k, v in s.ratios.items()}} for s in rep.stages],
                 hide_index=True)
    png = io.BytesIO()
    rep.plot_png(png)
    st.image(png.getvalue(), caption=f"{rep.metric} vs head sparsity")
    d = st.columns(3)
    d[0].download_button("report.json", rep.to_json(), file_name="report.json", mime="application/json",
                         key="pipe.dl.json")
    d[1].download_button("report.md", rep.to_markdown(), file_name="report.md", mime="text/markdown",
                         key="pipe.dl.md")
    d[2].download_button("ppl_vs_sparsity.png", png.getvalue(), file_name="ppl_vs_sparsity.png", mime="image/png",
                         key="pipe.dl.png")

    st.subheader("Export the final model")
    output_root = export_mod.default_export_root()
    c1, c2 = st.columns([1, 2])
    fmt = c1.selectbox("Format", [*export_mod.FORMATS, "onnx-int8"], key=state.widget_key("pipe.fmt", value="pruned"))
    folder = c2.text_input(f"Folder inside {output_root}",
                           key=state.widget_key("pipe.folder", value=f"{Path(lm.name).name}-pipeline"))
    if st.button("Export", key="pipe.export"):
        with shown_errors("Exporting"):
            with cache.progress_bar(f"Exporting ({fmt})"):
                if fmt == "onnx-int8":
                    from analysis.compress.quantize import quantize_onnx
                    target_dir = export_mod.resolve_under(output_root, folder)
                    with tempfile.TemporaryDirectory(prefix="headscope-onnx-") as tmp:
                        fp32 = export_round("onnx", result.model, result.pruned, result.head_rounds, tmp, "fp32",
                                            tokenizer=lm.tokenizer, kv_policy=config.kv_policy)
                        path = quantize_onnx(fp32.path, target_dir).parent
                else:
                    path = export_round(fmt, result.model, result.pruned, result.head_rounds, output_root, folder,
                                        tokenizer=lm.tokenizer, kv_policy=config.kv_policy).path
            st.success(f"Wrote the {fmt} export to {path}.")
