"""The compression report of one pipeline run, stage by stage, as JSON, markdown and a PNG plot.

`compression_report(loaded, config)` runs the configured schedule (analysis.compress.pipeline) and, for
the plot, the same schedule without recovery and the one-shot cut (masks planned once from the
dense model's scores) at every round's sparsity. Stages: dense; each accepted round (cut and,
with recovery, recovered); final; INT8 (ONNX Runtime, weight-only, when `int8=True`). Each stage
is measured on its physically pruned model: parameters, checkpoint size (safetensors), attention
FLOPs of a `seq_len` prefill, prefill and decode latency (median of `repeats`), the metric on the
evaluation text; every number also as a ratio to dense.

`write_report(report, folder)` writes report.json, report.md and ppl_vs_sparsity.png atomically
(one folder, renamed into place when complete).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from analysis.measure.evaluation import evaluate
from analysis.compress.export import atomic_folder
from analysis.compress.pipeline import PipelineConfig, PipelineResult, export_round, run_pipeline
from analysis.core.progress import Progress, ShouldStop
from analysis.score.masks import plan_mask
from analysis.score.scoring import get_scorer
from analysis.arch.models import count_parameters
from analysis.compress.speed import _decode_step, alternating_times, forward_flops, saved_bytes, torch_threads
from analysis.compress.surgery import prune_heads

REPORT_FILES = ("report.json", "report.md", "ppl_vs_sparsity.png")
# the section of docs/results.md that bench/bench_recovery.py --write-docs owns (scripts/results.py keeps it)
RECOVERY_MARKERS = ("<!-- recovery:begin -->", "<!-- recovery:end -->")
EDGE_MARKERS = ("<!-- edge:begin -->", "<!-- edge:end -->")          # bench/bench_gguf.py's section


@dataclass
class Stage:
    """One measured model of the run."""
    name: str
    sparsity: float
    parameters: int
    size_mb: float
    attention_flops: int
    prefill_ms: float
    decode_ms: float | None
    metric: float
    ratios: dict = field(default_factory=dict)   # every number / dense's


@dataclass
class CompressionReport:
    model: str
    metric: str
    config: dict
    stages: list[Stage]
    curves: dict                                  # name -> {"sparsity": [...], "metric": [...]}
    rounds: list[dict]
    int8: dict | None = None

    def as_dict(self) -> dict:
        return {"model": self.model, "metric": self.metric, "config": self.config,
                "stages": [asdict(s) for s in self.stages], "curves": self.curves, "rounds": self.rounds,
                "int8": self.int8}

    def to_json(self) -> str:
        return json.dumps(_plain(self.as_dict()), indent=1)

    def to_markdown(self) -> str:
        head = (f"# Compression report: {self.model}\n\n"
                f"Metric: {self.metric} on the evaluation text (lower is better for perplexity). Ratios are to "
                f"the dense model.\n\n"
                "| stage | sparsity | parameters | size MB | attention FLOPs | prefill ms | decode ms | "
                f"{self.metric} |\n|---|---|---|---|---|---|---|---|\n")
        rows = []
        for s in self.stages:
            r = s.ratios
            decode = "n/a" if s.decode_ms is None else f"{s.decode_ms:.2f} ({r.get('decode_ms', 1):.2f}x)"
            rows.append(f"| {s.name} | {s.sparsity:.1%} | {s.parameters:,} ({r['parameters']:.3f}x) | "
                        f"{s.size_mb:.1f} ({r['size_mb']:.3f}x) | {s.attention_flops:.3g} ({r['attention_flops']:.3f}x) "
                        f"| {s.prefill_ms:.2f} ({r['prefill_ms']:.2f}x) | {decode} | {s.metric:.3f} "
                        f"({r['metric']:.3f}x) |")
        curves = "\n".join(f"- {name}: " + ", ".join(f"{x:.1%} -> {y:.3f}" for x, y in zip(c["sparsity"], c["metric"]))
                           for name, c in self.curves.items())
        return head + "\n".join(rows) + f"\n\n## {self.metric} vs sparsity\n\n{curves}\n"

    def plot_png(self, path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        try:
            for name, c in self.curves.items():
                ax.plot(np.asarray(c["sparsity"]) * 100, c["metric"], marker="o", label=name)
            ax.set_xlabel("heads pruned (%)")
            ax.set_ylabel(self.metric)
            ax.set_title(f"{self.model}: {self.metric} vs head sparsity")
            ax.grid(alpha=0.3)
            ax.legend()
            fig.tight_layout()
            fig.savefig(path, format="png")
        finally:
            plt.close(fig)


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


# ---------------------------------------------------------------------------------------------
# Measuring one stage
# ---------------------------------------------------------------------------------------------

def _ids(loaded, n: int) -> torch.Tensor:
    vocab = int(loaded.model.config.get_text_config().vocab_size)
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))   # [1, n]


def measure_stage(name: str, loaded, model, layout, sparsity: float, eval_text, *, eval_tokens: int, seq_len: int,
                  repeats: int, threads: int | None, causal: bool, metric: float | None = None) -> Stage:
    """Stage numbers of a physically pruned `model` (layout None = dense)."""
    x = _ids(loaded, seq_len)                                              # [1, T]
    calls = {"prefill": lambda: model(input_ids=x)}
    with torch_threads(threads):
        ms = alternating_times(calls, repeats=repeats, warmup=1).median_ms("wall")
        decode = None
        if causal:
            step = _decode_step(model, x, 8)
            with torch.inference_mode():
                step()
                decode = 1e3 * float(np.median([step()[0] for _ in range(repeats)]))   # per token
    if metric is None:
        metric = evaluate(replace(loaded, model=model), eval_text, max_tokens=eval_tokens).value
    return Stage(name=name, sparsity=float(sparsity), parameters=count_parameters(model),
                 size_mb=saved_bytes(model) / 2 ** 20,
                 attention_flops=forward_flops(model, seq_len, seq_len, layout=layout).attention,
                 prefill_ms=ms["prefill"], decode_ms=decode, metric=float(metric))


def _with_ratios(stages: list[Stage]) -> list[Stage]:
    dense = stages[0]
    for s in stages:
        s.ratios = {key: (getattr(s, key) / getattr(dense, key)) if getattr(dense, key) else None
                    for key in ("parameters", "size_mb", "attention_flops", "prefill_ms", "decode_ms", "metric")
                    if getattr(s, key) is not None and getattr(dense, key) is not None}
    return stages


def one_shot_curve(loaded, sparsities, config: PipelineConfig, eval_text) -> list[float]:
    """The metric of masks planned once from the dense model's scores, at each sparsity."""
    scores = get_scorer(config.scorer, **config.scorer_params).score(loaded)
    g = loaded.geometry
    masks = np.stack([plan_mask(scores, s, group_size=g.group_size, policy=config.policy).pruned
                      for s in sparsities])                               # [S, L, H]
    return list(evaluate(loaded, eval_text, pruned=masks, max_tokens=config.eval_tokens).values)


def compression_report(loaded, config: PipelineConfig, *, train_data=None, eval_text=None, int8: bool = True,
                       seq_len: int = 128, repeats: int = 3, threads: int | None = None, workdir=None,
                       progress: Progress | None = None, should_stop: ShouldStop | None = None, on_step=None,
                       on_round=None) -> tuple[CompressionReport, PipelineResult]:
    """Run the pipeline and measure every stage (each round as it is accepted, so no round's model
    is kept). on_round(round, model, pruned) is passed through. Returns (report, result)."""
    report = progress or (lambda f, m: None)
    causal = loaded.kind == "causal-lm"
    common = dict(eval_tokens=config.eval_tokens, seq_len=seq_len, repeats=repeats, threads=threads, causal=causal)
    report(0.0, "measuring the dense model")
    stages = [measure_stage("dense", loaded, loaded.model, None, 0.0, eval_text, **common)]

    def measure_round(r, model, mask):
        small, layout = prune_heads(model, mask, kv_policy=config.kv_policy)
        name = f"round {r.index}" + (" recovered" if config.recovery_steps else "")
        stage = measure_stage(name, loaded, small, layout, r.sparsity, eval_text, metric=r.metric, **common)
        if config.recovery_steps:
            stages.append(replace(stage, name=f"round {r.index} cut", metric=r.metric_cut))  # same shapes
        stages.append(stage)
        if on_round is not None:
            on_round(r, model, mask)

    result = run_pipeline(loaded, config, train_data=train_data, eval_text=eval_text, should_stop=should_stop,
                          on_step=on_step, on_round=measure_round, progress=lambda f, m: report(0.05 + 0.6 * f, m))
    small, layout = result.smaller()
    final = (replace(stages[-1], name="final") if result.accepted else replace(stages[0], name="final"))
    stages.append(final)
    int8_info = None
    if int8 and causal:
        report(0.7, "INT8: ONNX export and quantization")
        int8_info, int8_stage = _int8_stage(loaded, result, final, eval_text, workdir, config, threads, repeats)
        stages.append(int8_stage)
    report(0.85, "perplexity vs sparsity curves")
    curves = _curves(loaded, config, result, eval_text, train_data, should_stop)
    report(1.0, "report ready")
    rep = CompressionReport(model=loaded.name, metric=result.metric, config=_plain(config.as_dict()),
                            stages=_with_ratios(stages), curves=curves, rounds=[r.as_dict() for r in result.rounds],
                            int8=int8_info)
    return rep, result


def _curves(loaded, config, result, eval_text, train_data, should_stop) -> dict:
    sparsities = [r.sparsity for r in result.accepted]
    curves = {}
    if sparsities:
        curves["one-shot"] = {"sparsity": sparsities, "metric": one_shot_curve(loaded, sparsities, config, eval_text)}
    if config.recovery_steps and len(sparsities):
        plain = run_pipeline(loaded, replace(config, recovery_steps=0), eval_text=eval_text, should_stop=should_stop)
        curves["iterative"] = {"sparsity": [r.sparsity for r in plain.accepted],
                               "metric": [r.metric for r in plain.accepted]}
        curves["iterative + recovery"] = {"sparsity": sparsities, "metric": [r.metric for r in result.accepted]}
    elif sparsities:
        curves["iterative"] = {"sparsity": sparsities, "metric": [r.metric for r in result.accepted]}
    return {name: {"sparsity": [0.0] + c["sparsity"], "metric": [result.dense_metric] + list(c["metric"])}
            for name, c in curves.items()}


def _int8_stage(loaded, result, final: Stage, eval_text, workdir, config, threads, repeats):
    from analysis.compress.quantize import OnnxLM, compare_onnx, quantize_onnx
    with tempfile.TemporaryDirectory(prefix="headscope-int8-", dir=workdir) as folder:
        fp32 = export_round("onnx", result.model, result.pruned, result.head_rounds, folder, "fp32",
                            kv_policy=config.kv_policy)
        int8_file = quantize_onnx(fp32.path, Path(folder) / "int8")
        cmp = compare_onnx(loaded, fp32.path, int8_file, eval_text, max_tokens=config.eval_tokens, repeats=repeats,
                           threads=threads)
        model = OnnxLM(int8_file, loaded.model.config, threads)
        x = _ids(loaded, 128)
        ms = alternating_times({"p": lambda: model(input_ids=x)}, repeats=repeats, warmup=1).median_ms("wall")["p"]
    stage = replace(final, name="INT8 (ONNX, weight-only)", size_mb=cmp.bytes_int8 / 2 ** 20, prefill_ms=ms,
                    decode_ms=None, metric=cmp.perplexity_int8)
    return cmp.as_dict(), stage


def write_report(report: CompressionReport, folder, *, overwrite: bool = False) -> dict[str, Path]:
    """report.json, report.md and ppl_vs_sparsity.png in `folder` (written atomically)."""
    folder = Path(folder)
    with atomic_folder(folder, overwrite=overwrite) as tmp:
        (tmp / "report.json").write_text(report.to_json(), encoding="utf-8")
        (tmp / "report.md").write_text(report.to_markdown(), encoding="utf-8")
        report.plot_png(tmp / "ppl_vs_sparsity.png")
    return {name: folder / name for name in REPORT_FILES}
