"""The compression report of one pipeline run, stage by stage, as JSON, markdown and a PNG plot.

`compression_report(loaded, config)` runs the configured schedule (analysis.compress.recover.pipeline) and, for
the plot, the same schedule without recovery and the one-shot cut (masks planned once from the
dense model's scores) at every round's sparsity. Stages: dense; each accepted round (cut and,
with recovery, recovered); final; INT8 (ONNX Runtime, weight-only, when `int8=True`). Each stage
is measured on its physically pruned model: parameters (`count_parameters` of the model surgery
built), checkpoint size (safetensors), KV-cache bytes per token (`masks.surgery_counts` of the
mask under the run's kv_policy: what that surgery builds), attention FLOPs of a `seq_len` prefill,
prefill and decode latency (median of `repeats`), the metric and the next-token top-1 accuracy on
the evaluation text; every number also as a ratio to dense (a ratio above 1 in parameters, size or
KV bytes means the cut GREW the model, and `CompressionReport.warnings` says so).

`write_report(report, folder)` writes report.json, report.md and ppl_vs_sparsity.png atomically
(one folder, renamed into place when complete).
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from analysis.core.ticks import matplotlib_log_y
from analysis.measure.evaluation import evaluate, evaluator_class
from analysis.compress.export import atomic_folder
from analysis.compress.recover.pipeline import PipelineConfig, PipelineResult, export_round, run_pipeline
from analysis.core.progress import Progress, ShouldStop
from analysis.score.masks import plan_mask, surgery_counts
from analysis.score.scoring import get_scorer
from analysis.arch.cut import Cut
from analysis.arch.models import count_parameters
from analysis.arch.adapters import input_device
from analysis.compress.cost import forward_flops
from analysis.compress.timing import DecodeSteps, alternating_times, saved_bytes
from analysis.core.threads import torch_threads
from analysis.compress.surgery import prune_heads
from analysis.compress import verdict

REPORT_FILES = ("report.json", "report.md", "ppl_vs_sparsity.png")
FRONTIER_PNG = "frontier.png"              # with a frontier (compression_report's frontier_types)
# the section of docs/results.md that bench/bench_recovery.py --write-docs owns (scripts/results.py keeps it)
RECOVERY_MARKERS = ("<!-- recovery:begin -->", "<!-- recovery:end -->")
EDGE_MARKERS = ("<!-- edge:begin -->", "<!-- edge:end -->")          # bench/bench_gguf.py's section
FRONTIER_MARKERS = ("<!-- frontier:begin -->", "<!-- frontier:end -->")  # bench/bench_frontier.py's section
LONG_CONTEXT_MARKERS = ("<!-- long-context:begin -->", "<!-- long-context:end -->")  # bench/bench_long_context.py
KV_POLICIES_MARKERS = ("<!-- kv-policies:begin -->", "<!-- kv-policies:end -->")    # bench/bench_kv_policies.py


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
    kv_bytes_per_token: int | None = None        # K/V cached per token (None: not a cached decoder)
    top1: float | None = None                    # next-token top-1 accuracy (causal LMs)
    ratios: dict = field(default_factory=dict)   # every number / dense's
    made_from: str | None = None                 # the stage this one was made from (its input)
    timed_as: str | None = None                  # latencies measured on that stage's model (same shapes), not again
    flags: list = field(default_factory=list)    # what is WORSE than its input (analysis.compress.verdict)


@dataclass
class CompressionReport:
    model: str
    metric: str
    config: dict
    stages: list[Stage]
    curves: dict                                  # name -> {"sparsity": [...], "metric": [...]}
    rounds: list[dict]
    int8: dict | None = None
    warnings: list = field(default_factory=list)  # e.g. a stage bigger than dense
    compensation: list | None = None              # analysis.measure.compensation rows (with recovery)
    capabilities: list | None = None              # per stage: the probes dense vs that stage (probes.breaks)
    frontier: dict | None = None                  # GGUF points, dense and final (analysis.compress.recover.frontier)

    @property
    def capability_warnings(self) -> list[str]:
        """A sentence per capability a stage lost (its probe accuracy CI below dense)."""
        return [f"{s['stage']}: {w}" for s in self.capabilities or () for w in s["warnings"]]

    def as_dict(self) -> dict:
        return {"model": self.model, "metric": self.metric, "config": self.config,
                "stages": [asdict(s) for s in self.stages], "curves": self.curves, "rounds": self.rounds,
                "int8": self.int8, "warnings": self.warnings, "compensation": self.compensation,
                "capabilities": self.capabilities, "frontier": self.frontier}

    def to_json(self) -> str:
        return json.dumps(_plain(self.as_dict()), indent=1)

    def to_markdown(self) -> str:
        policy = self.config.get("policy")
        head = (f"# Compression report: {self.model}\n\n"
                f"Metric: {self.metric} on the evaluation text (lower is better for perplexity); top-1 = next-token "
                f"top-1 accuracy on the same text. Mask policy: {policy}. Ratios are to the dense model.\n\n"
                + "".join(f"**Warning:** {w}\n\n" for w in self.warnings) +
                "A stage marked **WORSE** is worse than the stage it was made from (slower, bigger, or a "
                "broken file); latencies marked = were measured once on a model of the same shapes.\n\n"
                "| stage | sparsity | parameters | size MiB | KV bytes / token | attention FLOPs | prefill ms | "
                f"decode ms | {self.metric} | top-1 | worse than its input |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
        rows = []
        for s in self.stages:
            r = s.ratios
            same = f" (= {s.timed_as})" if s.timed_as else ""
            decode = "n/a" if s.decode_ms is None else f"{s.decode_ms:.2f} ({_speed(r, 'decode_ms')}){same}"
            kv = "n/a" if s.kv_bytes_per_token is None else f"{s.kv_bytes_per_token:,}{_times(r, 'kv_bytes_per_token')}"
            top1 = "n/a" if s.top1 is None else f"{s.top1:.3f}{_times(r, 'top1')}"
            rows.append(f"| {s.name} | {s.sparsity:.1%} | {s.parameters:,} ({r['parameters']:.3f}x) | "
                        f"{s.size_mb:.1f} ({r['size_mb']:.3f}x) | {kv} | {s.attention_flops:.3g} "
                        f"({r['attention_flops']:.3f}x) | {s.prefill_ms:.2f} ({_speed(r, 'prefill_ms')}){same} | "
                        f"{decode} | {s.metric:.3f} ({r['metric']:.3f}x) | {top1} | "
                        + (f"**WORSE than {s.made_from}**: {'; '.join(s.flags)}" if s.flags else "") + " |")
        curves = "\n".join(f"- {name}: " + ", ".join(f"{x:.1%} -> {y:.3f}" for x, y in zip(c["sparsity"], c["metric"]))
                           for name, c in self.curves.items())
        int8 = "" if not self.int8 else "\n\n## INT8 against float32 in the same runtime\n\n" + "\n".join(
            int8_lines(self.int8))
        from analysis.measure.compensation import compensation_markdown
        extra = "\n" + compensation_markdown(self.compensation) if self.compensation else ""
        if self.capabilities:
            from analysis.measure.probes.breaks import capabilities_markdown
            extra += "\n" + capabilities_markdown(self.capabilities)
        if self.frontier:
            extra += "\n" + frontier_markdown(self.frontier)
        return head + "\n".join(rows) + int8 + f"\n\n## {self.metric} vs sparsity\n\n{curves}\n" + extra

    def plot_png(self, path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
        try:
            for name, c in self.curves.items():
                ax.plot(np.asarray(c["sparsity"]) * 100, c["metric"], marker="o", label=name)
            if self.metric.endswith("perplexity"):     # spans orders of magnitude as heads go (as in the app)
                matplotlib_log_y(ax, [v for c in self.curves.values() for v in c["metric"]])
            ax.set_xlabel("heads pruned (%)")
            ax.set_ylabel(self.metric)
            ax.set_title(f"{self.model}: {self.metric} vs head sparsity")
            ax.grid(alpha=0.3)
            if self.curves:
                ax.legend()
            else:                     # a report without measured curves: say so, not an empty legend
                ax.text(0.5, 0.5, "no curves measured", ha="center", va="center", transform=ax.transAxes)
            fig.tight_layout()
            fig.savefig(path, format="png")
        finally:
            plt.close(fig)


def _speed(ratios: dict, key: str) -> str:
    """A latency's ratio to dense in words ("1.30x slower than dense")."""
    return f"{verdict.speed_words(1 / ratios[key])} than dense" if ratios.get(key) else "n/a"


def _times(ratios: dict, key: str) -> str:
    return f" ({ratios[key]:.3f}x)" if key in ratios else ""


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


def kv_bytes_per_token(loaded, pruned, kv_policy: str, dtype: torch.dtype = torch.float32) -> int:
    """KV-cache bytes per token of the model surgery builds from pruned [L, H] (masks.surgery_counts)."""
    g = loaded.geometry
    counts = surgery_counts(pruned, group_size=g.group_size, head_dim=g.head_dim, hidden=g.hidden,
                            kv_policy=kv_policy, dtype_bytes=torch.finfo(dtype).bits // 8)
    return counts.kv_cache_bytes_per_token_after


def measure_stage(name: str, loaded, model, sparsity: float, eval_text, *, eval_tokens: int, seq_len: int,
                  repeats: int, threads: int | None, causal: bool, metric: float | None = None,
                  top1: float | None = None, pruned=None, kv_policy: str = "auto") -> Stage:
    """Stage numbers of `model` (the dense one, or a physically pruned one cut by pruned [L, H]; None = nothing
    pruned), counted on the model itself (analysis.compress.cost). metric/top1 given: not measured again."""
    x = _ids(loaded, seq_len).to(input_device(model))                      # [1, T]
    calls = {"prefill": lambda: model(input_ids=x)}
    with torch_threads(threads):
        ms = alternating_times(calls, repeats=repeats, warmup=1, device=x.device).median_ms("wall")
        decode = None
        if causal:
            step = DecodeSteps(model, x, 8)
            with torch.inference_mode():
                step()
                decode = 1e3 * float(np.median([step()[0] for _ in range(repeats)]))   # per token
    if metric is None:
        ev = evaluate(replace(loaded, model=model), eval_text, max_tokens=eval_tokens)
        metric, top1 = ev.value, ev.accuracy
    pruned = np.zeros((loaded.geometry.n_layers, loaded.geometry.n_heads), bool) if pruned is None else pruned
    kv = kv_bytes_per_token(loaded, pruned, kv_policy, next(model.parameters()).dtype) if causal else None
    return Stage(name=name, sparsity=float(sparsity), parameters=count_parameters(model),
                 size_mb=saved_bytes(model) / 2 ** 20,
                 attention_flops=forward_flops(model, seq_len, seq_len).attention,
                 prefill_ms=ms["prefill"], decode_ms=decode, metric=float(metric), kv_bytes_per_token=kv,
                 top1=None if top1 is None else float(top1))


def _with_ratios(stages: list[Stage]) -> list[Stage]:
    dense = stages[0]
    for s in stages:
        s.ratios = {key: getattr(s, key) / getattr(dense, key)               # no ratio to a dense 0 or n/a
                    for key in RATIO_KEYS if getattr(s, key) is not None and getattr(dense, key)}
    return stages


RATIO_KEYS = ("parameters", "size_mb", "kv_bytes_per_token", "attention_flops", "prefill_ms", "decode_ms", "metric",
              "top1")
SIZE_KEYS = {"parameters": "parameters", "size_mb": "file size", "kv_bytes_per_token": "KV cache per token"}


def growth_warnings(stages: list[Stage]) -> list[str]:
    """A sentence for every pruned stage whose parameters, file size or KV cache is not below dense's
    (stages of one format: the safetensors-sized PyTorch models, not the ONNX / INT8 files)."""
    out = []
    for s in stages[1:]:
        grown = [what for key, what in SIZE_KEYS.items() if s.sparsity > 0 and (s.ratios.get(key) or 0) >= 1.0]
        if grown:
            out.append(f"stage '{s.name}' is not smaller than dense in {', '.join(grown)} (the mask policy "
                       f"leaves uneven KV groups, so surgery copies K/V per query head; the 'groups' or "
                       f"'balanced' policy never grows the model).")
    return out


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
                       on_round=None, probes: bool = True,
                       frontier_types: Sequence[str] = ()) -> tuple[CompressionReport, PipelineResult]:
    """Run the pipeline and measure every stage as its round is accepted (no round's model is kept); on_round
    passed through; probes: each round's capability probes vs dense; frontier_types: GGUF types of the dense
    and final model run in llama.cpp (`frontier`). Returns (report, result)."""
    report = progress or (lambda f, m: None)
    config = config.for_model(loaded.geometry)
    recovering = bool(config.steps_per_round())
    causal = loaded.kind == "causal-lm"
    higher = evaluator_class(loaded.kind).higher_is_better

    def flagged(stage: Stage, source: Stage, **what) -> Stage:
        return _flagged(stage, source, higher, **what)

    common = dict(eval_tokens=config.eval_tokens, seq_len=seq_len, repeats=repeats, threads=threads, causal=causal)
    report(0.0, "measuring the dense model")
    stages = [measure_stage("dense", loaded, loaded.model, 0.0, eval_text, **common)]
    check, capabilities = _capability_check(loaded, probes, should_stop), []

    def measure_round(r, model, mask):
        small, _ = prune_heads(model, mask, kv_policy=config.kv_policy)
        name = f"round {r.index}" + (" recovered" if recovering else "")
        stage = measure_stage(name, loaded, small, r.sparsity, eval_text, metric=r.metric, top1=r.accuracy,
                              pruned=mask, kv_policy=config.kv_policy, **common)
        cut = stage
        if recovering:                           # the cut has the recovered model's shapes: timed once
            cut = replace(stage, name=f"round {r.index} cut", metric=r.metric_cut, top1=r.accuracy_cut,
                          timed_as=name)
            stages.append(flagged(cut, stages[-1], times=True, sizes=True))
            flagged(stage, cut, metric=True)
        stages.append(stage if recovering else flagged(stage, stages[-1], times=True, sizes=True))
        if check is not None:
            capabilities.append(check.stage(name, r.sparsity, Cut.of_model(model, info=dict(stage=name))))
        if on_round is not None:
            on_round(r, model, mask)

    result = run_pipeline(loaded, config, train_data=train_data, eval_text=eval_text, should_stop=should_stop,
                          on_step=on_step, on_round=measure_round, progress=lambda f, m: report(0.05 + 0.6 * f, m))
    final = _final_stage(stages[-1] if result.accepted else stages[0])
    stages.append(final)
    n_torch = len(stages)          # the safetensors-sized stages, compared with dense in growth_warnings
    int8_info = None
    if int8 and causal:
        report(0.7, "INT8: ONNX export and quantization, PyTorch dynamic INT8")
        int8_info, int8_stages = _int8_stages(loaded, result, final, eval_text, workdir, config, threads, repeats,
                                              seq_len=seq_len)
        stages += _int8_flagged(int8_stages, int8_info, final, higher)
    points = _frontier(loaded, result, frontier_types, eval_text, workdir, config, threads, report, should_stop)
    curves, comp = _curves_and_roles(loaded, config, result, eval_text, train_data, report, should_stop)
    report(1.0, "report ready")
    stages = _with_ratios(stages)
    rep = CompressionReport(model=loaded.name, metric=result.metric, config=_plain(config.as_dict()),
                            stages=stages, curves=curves, rounds=[r.as_dict() for r in result.rounds],
                            int8=int8_info, warnings=growth_warnings(stages[:n_torch]) + int8_warnings(int8_info),
                            compensation=comp, capabilities=capabilities if check is not None else None,
                            frontier=points)
    return rep, result


def _final_stage(source: Stage) -> Stage:
    """The final model: the last accepted round's stage (or dense), its numbers not measured again."""
    return replace(source, name="final", made_from=source.name, timed_as=source.timed_as or source.name, flags=[])


def _curves_and_roles(loaded, config, result, eval_text, train_data, report, should_stop) -> tuple[dict, list | None]:
    """The metric-vs-sparsity curves, and with recovery the kept heads' roles before / after distillation."""
    report(0.85, "perplexity vs sparsity curves")
    curves = _curves(loaded, config, result, eval_text, train_data, should_stop)
    if not (config.recovery_steps and result.accepted):
        return curves, None
    from analysis.measure.compensation import compensation
    report(0.95, "roles of the kept heads before and after recovery")
    return curves, compensation(loaded, result.model, result.pruned, eval_text, should_stop=should_stop)


def _flagged(stage: Stage, source: Stage, higher: bool, *, times=False, sizes=False, metric=False,
             floor=None) -> Stage:
    """`stage` with its input and what is worse than it (analysis.compress.verdict)."""
    stage.made_from = source.name
    stage.flags = verdict.worse_than_input(
        times={"prefill": (source.prefill_ms, stage.prefill_ms), "decode": (source.decode_ms, stage.decode_ms)}
        if times else None,
        sizes={"parameters": (source.parameters, stage.parameters), "file": (source.size_mb, stage.size_mb),
               "KV cache": (source.kv_bytes_per_token, stage.kv_bytes_per_token)} if sizes else None,
        metric=(source.metric, stage.metric, higher) if metric else None, floor=floor)
    return stage


def _int8_flagged(int8_stages: list[Stage], info: dict, final: Stage, higher: bool) -> list[Stage]:
    """The INT8 stages, each flagged against its own input: the ONNX float file against the final model
    (metric), the ONNX INT8 files against the ONNX float file and PyTorch INT8 against the final model
    (same runtime: timed, sizes, the self-check floor), llama.cpp's Q8_0 by size and floor only (it was
    timed against its own F32 GGUF: its line in the INT8 section)."""
    fp32 = _flagged(int8_stages[0], final, higher, metric=True)
    out, info_key = [fp32], {**ONNX_INT8, GGUF_INT8: "gguf", TORCH_INT8: "torch"}
    for s in int8_stages[1:]:
        c = info[info_key[s.name]]
        floor = {**c["floor"], "top1_agreement": c["top1_agreement"],
                 "ratio": c.get("perplexity_ratio", c.get("metric_int8", 1) / c.get("metric_fp32", 1))}
        source = final if s.name == TORCH_INT8 else fp32
        out.append(_flagged(s, source, higher, times=s.name != GGUF_INT8, sizes=True, floor=floor))
    return out


def _frontier(loaded, result, types, eval_text, workdir, config, threads, report, should_stop) -> dict | None:
    """The frontier's points (analysis.compress.recover.frontier) on the report's held-out tokens; None
    without types, for a model that is not a causal LM, or of a family llama.cpp's GGUF does not take."""
    from analysis.compress.export.gguf.writer import family_for
    from analysis.compress.recover.frontier import frontier_points
    from analysis.core.errors import UnsupportedModelError
    if not types or loaded.kind != "causal-lm":
        return None
    try:
        family_for(loaded.adapter.model_type)
    except UnsupportedModelError:
        return None
    report(0.8, "the frontier: dense and final model at " + ", ".join(types) + " in llama.cpp")
    with tempfile.TemporaryDirectory(prefix="headscope-frontier-", dir=workdir) as folder:
        return frontier_points(loaded, result, types, eval_text, folder=folder, max_tokens=config.eval_tokens,
                               threads=threads or 2, kv_policy=config.kv_policy, label="final",
                               should_stop=should_stop)


def _capability_check(loaded, probes: bool, should_stop):
    """The probes' dense side, measured once (None when the report is asked without probes)."""
    if not probes:
        return None
    from analysis.measure.probes.breaks import CapabilityCheck
    return CapabilityCheck(loaded, should_stop=should_stop)


def _curves(loaded, config, result, eval_text, train_data, should_stop) -> dict:
    sparsities = [r.sparsity for r in result.accepted]
    curves = {}
    if sparsities:
        curves["one-shot"] = {"sparsity": sparsities, "metric": one_shot_curve(loaded, sparsities, config, eval_text)}
    if config.steps_per_round() and len(sparsities):
        plain = run_pipeline(loaded, replace(config, recovery_steps=0, recovery_tokens=None), eval_text=eval_text,
                             should_stop=should_stop)
        curves["iterative"] = {"sparsity": [r.sparsity for r in plain.accepted],
                               "metric": [r.metric for r in plain.accepted]}
        curves["iterative + recovery"] = {"sparsity": sparsities, "metric": [r.metric for r in result.accepted]}
    elif sparsities:
        curves["iterative"] = {"sparsity": sparsities, "metric": [r.metric for r in result.accepted]}
    return {name: {"sparsity": [0.0] + c["sparsity"], "metric": [result.dense_metric] + list(c["metric"])}
            for name, c in curves.items()}


# INT8 stages: name -> ONNX Runtime method (analysis.compress.export.onnx_int8.ONNX_METHODS); the PyTorch route after them
ONNX_INT8 = {"INT8 weight-only (ONNX)": "weight-only", "INT8 integer (ONNX dynamic)": "dynamic"}
TORCH_INT8 = "INT8 integer (PyTorch dynamic)"
GGUF_INT8 = "INT8 Q8_0 (llama.cpp GGUF)"


def _int8_stages(loaded, result, final: Stage, eval_text, workdir, config, threads, repeats, seq_len: int = 128):
    """The final model in float32 ONNX, its two ONNX INT8 files and PyTorch dynamic INT8, each
    measured against float32 in its own runtime (info[...]: agreement, speed-ups, sizes)."""
    from analysis.compress.export.onnx_int8 import quantize_onnx
    from analysis.compress.recover.quantize import compare_onnx, torch_int8_report
    from analysis.measure.outliers import int8_keep_float_for
    small, _ = result.smaller()
    keep = int8_keep_float_for(small, loaded.tokenizer)
    info, stages = {"keep_float": keep}, []
    with tempfile.TemporaryDirectory(prefix="headscope-int8-", dir=workdir) as folder:
        fp32 = export_round("onnx", result.model, result.pruned, result.head_rounds, folder, "fp32",
                            kv_policy=config.kv_policy)
        for name, method in ONNX_INT8.items():
            int8_file = quantize_onnx(fp32.path, Path(folder) / method, method=method,
                                      keep_float=keep if method == "dynamic" else ())
            cmp = compare_onnx(loaded, fp32.path, int8_file, eval_text, max_tokens=config.eval_tokens,
                               repeats=repeats, threads=threads)
            info[method] = {**cmp.as_dict(), "floor": floor_verdict(cmp.top1_agreement, cmp.perplexity_ratio, 8)}
            if not stages:
                stages.append(replace(final, name="final (ONNX fp32)", size_mb=cmp.bytes_fp32 / 2 ** 20,
                                      prefill_ms=cmp.latency_ms_fp32, decode_ms=None, metric=cmp.perplexity_fp32,
                                      top1=cmp.accuracy_fp32))
            stages.append(replace(final, name=name, size_mb=cmp.bytes_int8 / 2 ** 20, prefill_ms=cmp.latency_ms_int8,
                                  decode_ms=None, metric=cmp.perplexity_int8, top1=cmp.accuracy_int8))
        gguf = _gguf_int8(loaded, result, eval_text, folder, config, threads, repeats, seq_len=seq_len)
        if gguf is not None:
            info["gguf"] = gguf
            stages.append(replace(final, name=GGUF_INT8, size_mb=gguf["bytes_int8"] / 2 ** 20,
                                  prefill_ms=1e3 * seq_len / gguf["prefill_tok_s_int8"],
                                  decode_ms=1e3 / gguf["decode_tok_s_int8"], metric=gguf["perplexity_int8"],
                                  top1=gguf["accuracy_int8"]))
    t = torch_int8_report(loaded, small, eval_text, max_tokens=config.eval_tokens, repeats=repeats, threads=threads,
                          keep_float=keep)
    info["torch"] = {k: v for k, v in t.items() if k != "model"}
    info["torch"]["floor"] = floor_verdict(t["top1_agreement"], t["metric_int8"] / t["metric_fp32"], 8)
    stages.append(replace(final, name=TORCH_INT8, size_mb=t["bytes_int8"] / 2 ** 20, prefill_ms=t["latency_ms_int8"],
                          decode_ms=t["decode_ms_int8"], metric=t["metric_int8"], top1=t["accuracy_int8"]))
    info["recommended"] = int8_recommendation(info)
    return info, stages


def _gguf_int8(loaded, result, eval_text, folder, config, threads, repeats, *, seq_len: int) -> dict | None:
    """llama.cpp's INT8 route: the final model as F32 and Q8_0 GGUF (the gguf export: the Q8_0 file
    self-checked), compared in llama.cpp (`quantize.compare_gguf`); None, with the reason in the dict's
    place, for a family llama.cpp's GGUF does not take."""
    from analysis.compress.export.gguf.writer import family_for
    from analysis.compress.recover.quantize import compare_gguf
    from analysis.core.errors import UnsupportedModelError
    try:
        family_for(loaded.adapter.model_type)
    except UnsupportedModelError:
        return None
    files = {t: export_round("gguf", result.model, result.pruned, result.head_rounds, folder, f"gguf-{t}",
                             tokenizer=loaded.tokenizer, kv_policy=config.kv_policy, gguf_type=t).path / "model.gguf"
             for t in ("f32", "q8_0")}
    cmp = compare_gguf(loaded, files["f32"], files["q8_0"], eval_text, max_tokens=config.eval_tokens,
                       context=seq_len, rounds=max(3, repeats), threads=threads or 2)
    return {**cmp, "floor": floor_verdict(cmp["top1_agreement"], cmp["perplexity_ratio"], 8)}


# The bar an INT8 route meets to be recommended (issue 35's targets for llama.cpp's Q8_0 against F32)
INT8_BAR = {"agreement": 0.95, "perplexity_ratio": 1.01, "speedup": 1.5}


def int8_recommendation(info: dict) -> dict:
    """Which INT8 route meets INT8_BAR on this machine (agreement, perplexity ratio, and both its speed-ups,
    prefill and decode / 1-token, each the per-round median), the best by its decode speed-up if several;
    with the misses of every route, so a report can say why none does."""
    def speedup_of(c: dict, part: str) -> float | None:
        spread = (c.get("speedups") or {}).get(part)
        return None if spread is None else spread["median"]

    routes = {}
    for key, label, parts in (("dynamic", "ONNX dynamic", ("prefill", "one_token")),
                              ("weight-only", "ONNX weight-only", ("prefill", "one_token")),
                              ("torch", "PyTorch dynamic", ("prefill", "decode")),
                              ("gguf", "llama.cpp Q8_0", ("prefill", "decode"))):
        c = info.get(key)
        if not c:
            continue
        ratio = c["perplexity_ratio"] if "perplexity_ratio" in c else c["metric_int8"] / c["metric_fp32"]
        misses = []
        if c["top1_agreement"] < INT8_BAR["agreement"]:
            misses.append(f"top-1 agreement {c['top1_agreement']:.3f} < {INT8_BAR['agreement']}")
        if ratio > INT8_BAR["perplexity_ratio"]:
            misses.append(f"perplexity {ratio:.3f}x > {INT8_BAR['perplexity_ratio']}x")
        for part in parts:
            value = speedup_of(c, part)
            if value is None or value < INT8_BAR["speedup"]:
                misses.append(f"{part.replace('_', '-')} {'n/a' if value is None else f'{value:.2f}x'} < "
                              f"{INT8_BAR['speedup']}x")
        routes[label] = {"misses": misses, "decode": speedup_of(c, parts[1]) or 0.0}
    meeting = [name for name, r in routes.items() if not r["misses"]]
    best = max(meeting, key=lambda name: routes[name]["decode"]) if meeting else None
    return {"route": best, "bar": INT8_BAR, "routes": routes}


def floor_verdict(agreement: float, perplexity_ratio: float, bits: int) -> dict:
    """Whether an INT8 stage keeps the export self-check's floor for `bits`-bit weights
    (analysis.compress.export.selfcheck): what an export of that file would be refused below."""
    from analysis.compress.export.selfcheck import floor_for
    floor = floor_for(bits)
    return {"agreement": floor.agreement, "perplexity_ratio": floor.perplexity_ratio,
            "passed": bool(agreement >= floor.agreement and perplexity_ratio <= floor.perplexity_ratio)}


def int8_warnings(info: dict | None) -> list[str]:
    """A sentence for every INT8 file stage (ONNX, llama.cpp Q8_0) below the self-check floor on this CPU."""
    out = []
    for name, method in (*ONNX_INT8.items(), (GGUF_INT8, "gguf")):
        c = (info or {}).get(method)
        if c and not c["floor"]["passed"]:
            out.append(f"stage '{name}' is below the INT8 floor on this CPU (top-1 agreement {c['top1_agreement']:.3f}, "
                       f"floor {c['floor']['agreement']:.2f}; perplexity {c['perplexity_ratio']:.3g}x, floor "
                       f"{c['floor']['perplexity_ratio']:.2f}x): a broken file, which the export refuses.")
    return out


def speedup(c: dict, part: str, fp32: str, int8: str) -> float:
    """The median per-round fp32 / int8 time ratio of `part` ("prefill", "one_token", "decode"), what the
    1.5x targets are judged on; saved numbers from before the per-round spread fall back to the ratio of
    the two medians."""
    spread = c.get("speedups", {}).get(part)
    return spread["median"] if spread else c[fp32] / c[int8]


def speedup_text(c: dict, part: str, fp32: str, int8: str) -> str:
    """"1.96x faster (speed-up per round min 1.71 / max 2.20, 5 rounds)" or "2.86x slower (...)": the
    speed-up in words (analysis.compress.verdict.speed_words) with how far it can be trusted."""
    spread = c.get("speedups", {}).get(part)
    if not spread:
        return f"{verdict.speed_words(c[fp32] / c[int8])} (ratio of medians)"
    return (f"{verdict.speed_words(spread['median'])} (speed-up per round min {spread['min']:.2f} / max "
            f"{spread['max']:.2f}, {spread['rounds']} rounds)")


def int8_lines(info: dict) -> list[str]:
    """Markdown bullets: each INT8 route against float32 in the same runtime."""
    rows = [f"- Kept in float32 by the integer routes: {', '.join(info['keep_float']) or 'nothing'}."]
    for method in ONNX_INT8.values():
        c = info[method]
        below = "" if c.get("floor", {}).get("passed", True) else "**BELOW THE INT8 FLOOR (a broken file):** "
        rows.append(f"- {below}ONNX {method}: top-1 agreement with fp32 {c['top1_agreement']:.3f}, perplexity "
                    f"{c['perplexity_ratio']:.3f}x, file {c['size_ratio']:.3f}x, prefill "
                    f"{speedup_text(c, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}, 1-token forward "
                    f"{speedup_text(c, 'one_token', 'one_token_ms_fp32', 'one_token_ms_int8')} (ONNX Runtime, "
                    f"same threads).")
    g = info.get("gguf")
    if g:
        below = "" if g["floor"]["passed"] else "**BELOW THE INT8 FLOOR (a broken file):** "
        rows.append(f"- {below}llama.cpp Q8_0 against F32 GGUF: top-1 agreement {g['top1_agreement']:.3f}, perplexity "
                    f"{g['perplexity_ratio']:.3f}x, file {g['size_ratio']:.3f}x, prefill "
                    f"{g['speedups']['prefill']['median']:.2f}x, decode {g['speedups']['decode']['median']:.2f}x "
                    f"the F32 file's speed (per-round medians, {g['speedups']['decode']['rounds']} interleaved rounds "
                    f"after warm-up; llama.cpp, {g['threads']} threads).")
    t = info["torch"]
    rows.append(f"- PyTorch dynamic: top-1 agreement {t['top1_agreement']:.3f}, perplexity "
                f"{t['metric_int8'] / t['metric_fp32']:.3f}x, state {t['size_ratio']:.3f}x, prefill "
                f"{speedup_text(t, 'prefill', 'latency_ms_fp32', 'latency_ms_int8')}, decode "
                f"{speedup_text(t, 'decode', 'decode_ms_fp32', 'decode_ms_int8')} (PyTorch, same threads).")
    rec = info.get("recommended")
    if rec:
        bar = rec["bar"]
        head = (f"top-1 agreement >= {bar['agreement']}, perplexity <= {bar['perplexity_ratio']}x, prefill and "
                f"decode >= {bar['speedup']}x faster than float")
        if rec["route"]:
            rows.append(f"- **Recommended on this machine: {rec['route']}** (meets the bar: {head}).")
        else:
            rows.append(f"- No INT8 route meets the bar on this machine ({head}): "
                        + "; ".join(f"{name}: {', '.join(r['misses'])}" for name, r in rec["routes"].items()) + ".")
    return rows


def frontier_markdown(points: dict) -> str:
    """The report's frontier section: the table and the verdict in words."""
    from analysis.compress.recover.frontier import measured, pareto, verdict
    front = set(pareto(points))
    rows = [f"| {p['label']} | {p['type']} | {p['bytes'] / 2**20:.1f} | {p['ppl']:.2f} [{p['lo']:.2f}, {p['hi']:.2f}] | "
            f"{'yes' if k in front else ''} |" for k, p in sorted(measured(points).items(), key=lambda kv: kv[1]["bytes"])]
    return ("\n## The frontier in llama.cpp (file size vs perplexity)\n\n"
            "| model | GGUF type | file MiB | perplexity [95 % CI] | on the frontier |\n|---|---|---:|---|---|\n"
            + "\n".join(rows) + "\n\n" + "\n".join(f"- {line}" for line in verdict(points)) + "\n")


def write_report(report: CompressionReport, folder, *, overwrite: bool = False) -> dict[str, Path]:
    """report.json, report.md and ppl_vs_sparsity.png in `folder` (written atomically), and frontier.png
    when the report has a frontier."""
    folder = Path(folder)
    with atomic_folder(folder, overwrite=overwrite) as tmp:
        (tmp / "report.json").write_text(report.to_json(), encoding="utf-8")
        (tmp / "report.md").write_text(report.to_markdown(), encoding="utf-8")
        report.plot_png(tmp / "ppl_vs_sparsity.png")
        if report.frontier:
            from analysis.compress.recover.frontier import plot_png
            plot_png(report.frontier, tmp / FRONTIER_PNG, f"{report.model}: GGUF size vs llama.cpp perplexity, "
                                                          f"dense vs the final model")
    names = REPORT_FILES + ((FRONTIER_PNG,) if report.frontier else ())
    return {name: folder / name for name in names}
