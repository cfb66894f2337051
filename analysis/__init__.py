"""headscope's library: see, score and cut the attention heads of Hugging Face transformer models.

The public API is the table `API` below (name -> the module that owns it); `from analysis import
load_model` imports only what that name needs (PEP 562 lazy attributes, so `python -m analysis` and
the app pay for what they use). The packages, in import order (a module imports only from its own
package or those before it; tests/test_layering.py checks it):

    core      errors, atomic writes, progress and cancel, schemas, placement, processes, built-in text
    arch      head geometry, the family table and layouts, surgery mechanics, head gates, checkpoints, loading
    measure   row-norm profiles (also streamed), losses, evaluation, ablation, attribution, roles, redundancy,
              head detectors (induction, duplicate-token, copying, successor, DLA), capability probes
    score     the scorer registry, masks and policies, z sweeps, sparsity curves, domains
    compress  surgery, exports (format registry), cost and timing, distillation, INT8, the pipeline and its report
    cli       `python -m analysis ...` (nothing else imports it)

docs/ARCHITECTURE.md has one paragraph per package and the module table.
"""
from __future__ import annotations

import importlib

API: dict[str, str] = {
    # loading and geometry
    "load_model": "analysis.arch.models", "LoadedModel": "analysis.arch.models",
    "open_weights_only": "analysis.arch.models", "BUILTIN_MODELS": "analysis.arch.models",
    "DEFAULT_MODEL": "analysis.arch.models", "count_parameters": "analysis.arch.models",
    "HeadGeometry": "analysis.arch.geometry", "adapter_for": "analysis.arch.adapters",
    "SUPPORTED_MODEL_TYPES": "analysis.arch.adapters",
    # masking
    "head_mask": "analysis.arch.head_gates", "gates_from_mask": "analysis.arch.head_gates",
    "zero_heads": "analysis.arch.head_gates",
    # cuts and KV plans
    "Cut": "analysis.arch.cut", "KVPlan": "analysis.arch.kvplan", "read_kv_plan": "analysis.arch.kvplan",
    "Window": "analysis.arch.window", "plan_kv": "analysis.score.kvscores",
    # measuring
    "profile_model": "analysis.measure.profiles", "NormProfile": "analysis.measure.profiles",
    "profile_checkpoint": "analysis.measure.streaming",
    "evaluate": "analysis.measure.evaluation", "perplexity": "analysis.measure.evaluation",
    "head_ablation": "analysis.measure.ablation", "head_attribution": "analysis.measure.attribution",
    "head_roles": "analysis.measure.roles", "head_redundancy": "analysis.measure.redundancy",
    "detect_heads": "analysis.measure.detectors", "DETECTORS": "analysis.measure.detector_registry",
    "logit_parts": "analysis.measure.dla", "role_tests": "analysis.score.specialization",
    "PROBES": "analysis.measure.probes", "register_probe": "analysis.measure.probes",
    "ProbeSpec": "analysis.measure.probes", "run_probes": "analysis.measure.probes.measure",
    "cut_report": "analysis.measure.probes.breaks", "probe_map": "analysis.measure.probes.circuit",
    "compare_domains": "analysis.score.domains", "long_context_report": "analysis.score.longcontext",
    "build_long": "analysis.measure.probes.longcontext",
    # scoring and masks
    "get_scorer": "analysis.score.scorer_registry", "register_scorer": "analysis.score.scorer_registry",
    "SCORERS": "analysis.score.scorer_registry",
    "HeadScores": "analysis.score.scoring", "plan_mask": "analysis.score.masks", "default_policy": "analysis.score.masks",
    "summarize_mask": "analysis.score.masks", "POLICIES": "analysis.score.masks", "sweep_z": "analysis.score.sweep",
    "sparsity_curve": "analysis.score.curves",
    # compressing
    "prune_heads": "analysis.compress.surgery", "HeadLayout": "analysis.compress.surgery",
    "export": "analysis.compress.export", "export_to": "analysis.compress.export",
    "FORMATS": "analysis.compress.export.format_registry", "register_format": "analysis.compress.export.format_registry", "ExportFormat": "analysis.compress.export",
    "load_pruned": "analysis.compress.export", "export_checkpoint": "analysis.compress.export.streamed", "mask_record": "analysis.compress.export",
    "read_mask_json": "analysis.compress.export", "distill": "analysis.compress.recover.distill",
    "DistillConfig": "analysis.compress.recover.distill", "run_pipeline": "analysis.compress.recover.pipeline",
    "PipelineConfig": "analysis.compress.recover.pipeline", "compression_report": "analysis.compress.recover.report",
    "kv_plan_model": "analysis.compress.kvruntime", "measure_kv": "analysis.compress.timing",
    "load_planned": "analysis.compress.export.planned",
    "cut_of_folder": "analysis.compress.export.planned",
    # errors
    "HeadscopeError": "analysis.core.errors", "InputError": "analysis.core.errors",
    "ModelLoadError": "analysis.core.errors", "CancelledError": "analysis.core.errors",
}

__all__ = sorted(API)


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'analysis' has no attribute {name!r}")
    return getattr(importlib.import_module(API[name]), name)   # modules are cached by the import system


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(API))
