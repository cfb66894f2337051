"""The export command: the pruned model in any registered format (analysis.compress.export.FORMATS, with
each format's own options as --option-name) plus mask.json (and kv_plan.json with --kv-plan), written
atomically under --out-dir. The options are built from the formats' declarations
(analysis.compress.export.format_registry), and the format options are checked before the export machinery
is imported."""
from __future__ import annotations

import sys

from analysis.cli.common import (add_kv_policy_argument, add_model_mask_arguments, load_source, plan_from,
                                 progress_bar, register, warn)
from analysis.core.errors import InputError
from analysis.score.masks import MaskPlan, summarize_mask


def _option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _export_arguments(parser):
    from analysis.compress.export.format_registry import EXPORT_DTYPES, FORMATS

    declared = FORMATS.declared()                  # nothing imported: the formats' declarations
    add_model_mask_arguments(parser, streaming=True, mask_file=True)
    parser.add_argument("--export-format", dest="export_format", choices=tuple(FORMATS), default="pruned",
                        help="; ".join(f"{name}: {form.help}" for name, form in declared.items())
                        + "; with --checkpoint (streamed, the model is never built): the formats that can be "
                          "streamed")
    seen = set()
    for name, form in declared.items():         # each format's own options, e.g. --opset (onnx)
        for option, spec in form.options.items():
            if option in seen:
                continue
            seen.add(option)
            kind = None if isinstance(spec.default, bool) else type(spec.default)
            parser.add_argument(_option_flag(option), dest=f"format_{option}", default=None, type=kind,
                                choices=spec.choices, help=f"{name} export: {spec.help} (default {spec.default})")
    parser.add_argument("--export-dtype", dest="export_dtype", choices=EXPORT_DTYPES, default="source",
                        help="the dtype of the written weights (zeroed, pruned, stock): source = what the checkpoint "
                             "stores (a bfloat16 checkpoint stays bfloat16 even when loaded in float32); ONNX and "
                             "GGUF have their own precision")
    parser.add_argument("--out-dir", dest="out_dir", required=True, help="output root folder")
    parser.add_argument("--name", required=True, help="folder to create under --out-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--kv-plan", dest="kv_plan", default=None, metavar="FILE",
                        help="a kv_plan.json (per-KV-head full / window / prune) written with the model: its pruned "
                             "heads are the cut when no --sparsity / --mask-file is given (else the mask must remove "
                             "them); each format says what its runtime does with the windows")
    add_kv_policy_argument(parser)


def run_export(ns):
    """Write the pruned model (atomically) and print what was written."""
    from analysis.compress.export.format_registry import FORMATS, format_options

    declared = FORMATS.declared()
    given = {option: getattr(ns, f"format_{option}") for option in
             {o for f in declared.values() for o in f.options} if getattr(ns, f"format_{option}", None) is not None}
    foreign = sorted(set(given) - set(declared[ns.export_format].options))
    if foreign:
        raise InputError(f"{_option_flag(foreign[0])} is an option of another export format, not of "
                         f"{ns.export_format}; leave it out or choose that format.")
    format_options(ns.export_format, given)        # values and ranges (--opset 5), before anything is imported
    from analysis.compress.export import (check_export_name, export, export_dtype, mask_record, read_mask_json,
                                          resolve_under)

    form = FORMATS[ns.export_format]
    target = resolve_under(ns.out_dir, ns.name)   # a bad name fails before the model loads
    check_export_name(ns.name)
    kv_plan = None
    if ns.kv_plan is not None:                      # the file's own checks (schema, a window of 0) before any load
        from analysis.arch.kvplan import read_kv_plan
        kv_plan = read_kv_plan(ns.kv_plan)
    if ns.mask_file is None and ns.sparsity is None and kv_plan is None:
        raise InputError("export needs --sparsity (with the scorer options), --mask-file (a mask.json) or --kv-plan "
                         "(a kv_plan.json: its pruned heads are the cut).")
    if ns.checkpoint:
        return _export_streamed(ns, target, given, kv_plan)
    if ns.mask_file is not None:
        plan, scores, loaded, info = _plan_from_mask_file(ns)
        record = read_mask_json(ns.mask_file, geometry=loaded.geometry)
    elif ns.sparsity is None:                       # --kv-plan alone: its pruned KV heads are the cut
        plan, loaded, info = _plan_from_kv_plan(ns, kv_plan)
        record = mask_record(plan.pruned, geometry=loaded.geometry, model=loaded.name,
                             model_type=loaded.adapter.model_type, policy="kv-plan")
    else:
        plan, scores, loaded, info = plan_from(ns)
        record = mask_record(plan.pruned, geometry=loaded.geometry, model=loaded.name,
                             model_type=loaded.adapter.model_type, scores=scores, sparsity=ns.sparsity,
                             policy=ns.policy)
    surgery = {"kv_policy": ns.kv_policy} if form.physical else {}   # a full-shape format keeps the shapes
    if surgery:
        g = loaded.geometry
        bias = loaded.adapter.has_qkv_bias(loaded.model)
        warn(summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, bias=bias,
                            kv_policy=ns.kv_policy).warnings)
    with progress_bar(f"exporting ({ns.export_format})", not ns.quiet) as report:
        result = export(ns.export_format, loaded.model, plan.pruned, ns.out_dir, ns.name, record=record,
                        tokenizer=loaded.tokenizer, overwrite=ns.overwrite, progress=report,
                        dtype=export_dtype(ns.export_dtype, loaded.source_dtype), kv_plan=kv_plan, **surgery,
                        **given)
    payload = dict(model=info, format=result.format, path=str(result.path), files=result.files,
                   total_bytes=result.total_bytes, n_pruned=plan.n_pruned, notes=result.notes,
                   **_plan_payload(kv_plan))
    for note in result.notes:
        sys.stderr.write(f"note: {note}\n")
    sys.stderr.write(f"wrote {result.path} ({result.total_bytes / 2**20:.1f} MiB)\n")
    return payload, None


def _plan_payload(kv_plan) -> dict:
    return {} if kv_plan is None else {"kv_plan": dict(kv_plan.counts(), **kv_plan.window.as_dict())}


def _plan_from_kv_plan(ns, kv_plan):
    """(MaskPlan, LoadedModel, info) for --model with --kv-plan alone: the plan's pruned heads are the mask."""
    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    kv_plan.check_geometry(loaded.geometry)
    return MaskPlan.from_pruned(kv_plan.pruned_heads(), loaded.geometry.group_size, policy="kv-plan"), loaded, info


def _plan_from_mask_file(ns):
    """(MaskPlan, None, LoadedModel, info) for --model with --mask-file: the mask as given, no scoring."""
    from analysis.compress.export import read_mask_json

    with progress_bar("loading", not ns.quiet) as report:
        _, loaded, info = load_source(ns, report)
    record = read_mask_json(ns.mask_file, geometry=loaded.geometry)
    plan = MaskPlan.from_pruned(record.pruned(), loaded.geometry.group_size, sparsity=record.sparsity,
                                policy=record.policy or "given")
    return plan, None, loaded, info


def _export_streamed(ns, target, given: dict, kv_plan=None):
    """export --checkpoint: score by streaming (or read --mask-file) and cut the checkpoint tensor by tensor
    (analysis.compress.export.streamed); the model is never built."""
    from analysis.arch.adapters import adapter_for
    from analysis.arch.checkpoint import checkpoint_folder, load_config
    from analysis.compress.export import mask_record, read_mask_json
    from analysis.compress.export.streamed import checkpoint_has_qkv_bias, export_checkpoint, streamed_formats

    if ns.export_format not in streamed_formats():
        raise InputError(f"--checkpoint streams the {' and '.join(streamed_formats())} formats; for "
                         f"--export-format {ns.export_format} load the model with --model.")
    if ns.export_dtype != "source":
        raise InputError(f"--checkpoint copies the checkpoint's tensors as stored; for --export-dtype "
                         f"{ns.export_dtype} load the model with --model.")
    folder = checkpoint_folder(ns.checkpoint)
    config = load_config(folder, trust_remote_code=ns.trust_remote_code)
    adapter = adapter_for(config)
    g = adapter.geometry(config)
    if ns.mask_file is not None:
        record = read_mask_json(ns.mask_file, geometry=g)
        plan = MaskPlan.from_pruned(record.pruned(), g.group_size, sparsity=record.sparsity,
                                    policy=record.policy or "given")
        info = dict(source=str(folder), **g.as_dict())
    elif ns.sparsity is None:                       # --kv-plan alone
        kv_plan.check_geometry(g)
        plan = MaskPlan.from_pruned(kv_plan.pruned_heads(), g.group_size, policy="kv-plan")
        record = mask_record(plan.pruned, geometry=g, model=str(folder), model_type=adapter.model_type,
                             policy="kv-plan")
        info = dict(source=str(folder), **g.as_dict())
    else:
        plan, scores, _, info = plan_from(ns)
        record = mask_record(plan.pruned, geometry=g, model=str(folder), model_type=adapter.model_type,
                             scores=scores, sparsity=ns.sparsity, policy=ns.policy)
    warn(summarize_mask(plan, head_dim=g.head_dim, hidden=g.hidden, bias=checkpoint_has_qkv_bias(folder, adapter),
                        kv_policy=ns.kv_policy).warnings)
    with progress_bar(f"exporting ({ns.export_format}, streamed)", not ns.quiet) as report:
        result = export_checkpoint(ns.export_format, folder, plan.pruned, target, record=record,
                                   kv_policy=ns.kv_policy, overwrite=ns.overwrite, progress=report,
                                   trust_remote_code=ns.trust_remote_code, kv_plan=kv_plan, **given)
    for note in result.notes:
        sys.stderr.write(f"note: {note}\n")
    sys.stderr.write(f"wrote {result.path} ({result.total_bytes / 2**20:.1f} MiB)\n")
    return dict(model=info, format=result.format, path=str(result.path), files=result.files,
                total_bytes=result.total_bytes, n_pruned=plan.n_pruned, streamed=True, notes=result.notes,
                **_plan_payload(kv_plan)), None


register("export", "write the pruned model in a registered format and mask.json", _export_arguments, run_export)
