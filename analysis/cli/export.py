"""The export command: the pruned model in any registered format (analysis.compress.export.FORMATS, with
each format's own options as --option-name) plus mask.json, written atomically under --out-dir."""
from __future__ import annotations

import sys

from analysis.cli.common import (add_kv_policy_argument, add_model_mask_arguments, plan_from, progress_bar,
                                 register, warn)
from analysis.core.errors import InputError
from analysis.score.masks import summarize_mask


def _option_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _export_arguments(parser):
    from analysis.compress.export import FORMATS

    add_model_mask_arguments(parser)
    parser.add_argument("--export-format", dest="export_format", choices=FORMATS, default="pruned",
                        help="; ".join(f"{name}: {form.help}" for name, form in FORMATS.items()))
    seen = set()
    for name, form in FORMATS.items():          # each format's own options, e.g. --opset (onnx)
        for option, spec in form.options.items():
            if option in seen:
                continue
            seen.add(option)
            kind = None if isinstance(spec.default, bool) else type(spec.default)
            parser.add_argument(_option_flag(option), dest=f"format_{option}", default=None, type=kind,
                                choices=spec.choices, help=f"{name} export: {spec.help} (default {spec.default})")
    parser.add_argument("--out-dir", dest="out_dir", required=True, help="output root folder")
    parser.add_argument("--name", required=True, help="folder to create under --out-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    add_kv_policy_argument(parser)


def run_export(ns):
    """Write the pruned model (atomically) and print what was written."""
    from analysis.compress.export import FORMATS, check_export_name, export, mask_record, resolve_under

    form = FORMATS[ns.export_format]
    given = {option: getattr(ns, f"format_{option}") for option in
             {o for f in FORMATS.values() for o in f.options} if getattr(ns, f"format_{option}", None) is not None}
    foreign = sorted(set(given) - set(form.options))
    if foreign:
        raise InputError(f"{_option_flag(foreign[0])} is an option of another export format, not of "
                         f"{ns.export_format}; leave it out or choose that format.")
    resolve_under(ns.out_dir, ns.name)   # a bad name fails before the model loads
    check_export_name(ns.name)
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
                        tokenizer=loaded.tokenizer, overwrite=ns.overwrite, progress=report, **surgery, **given)
    payload = dict(model=info, format=result.format, path=str(result.path), files=result.files,
                   total_bytes=result.total_bytes, n_pruned=plan.n_pruned)
    for note in result.notes:
        sys.stderr.write(f"note: {note}\n")
    sys.stderr.write(f"wrote {result.path} ({result.total_bytes / 2**20:.1f} MiB)\n")
    return payload, None


register("export", "write the pruned model in a registered format and mask.json", _export_arguments, run_export)
