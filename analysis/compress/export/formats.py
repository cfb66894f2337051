"""The export formats: one registry, one entry point.

A format is a small class (`ExportFormat`) with a name (the CLI's `--export-format` choice and the app's
name), a label, its own options (`FormatOption`: the CLI adds `--option-name`, the Export page a widget)
and one verb, `write`, that fills a fresh folder. The registry `FORMATS` (`register_format`,
`format_options`: analysis.compress.export.format_registry, re-exported here) holds each format's
declaration and names its class lazily; the CLI, the Export page and the pipeline read their choices
from there, so a new format is one module and one declaration (docs/ARCHITECTURE.md, "How to add an
export format").

`export_to(fmt, model, pruned, target, ...)` does what every format shares: an in-memory copy of a
dispatched model, the mask record, the atomic folder (`analysis.compress.export.folder`), mask.json,
head_layout.json for a physical cut, kv_plan.json when a KV plan is given (`analysis.compress.export.kvfile`,
with the format's `kv_windows` line in the notes: what its runtime does with the windows), the tokenizer
files, and the listing of what was written.
`export(fmt, model, pruned, root, name, ...)` is the same confined to an output root (what the app and
the CLI call).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

from torch import nn

from analysis.arch.adapters import adapter_for, in_memory_copy, is_dispatched
from analysis.arch.checkpoint import check_finite_tensor
from analysis.compress.export.format_registry import (  # noqa: F401 (the registry: re-exported)
    DECLARED_FIELDS, EXPORT_DTYPES, FORMATS, FormatOption, FormatSpec, format_options, get_format, register_format)
from analysis.compress.export.folder import (atomic_folder, check_export_name, clean_leftovers, listing,
                                             resolve_under)
from analysis.compress.export.kvfile import plan_for_export, write_kv_plan
from analysis.compress.export.records import MASK_FILE, MaskRecord, record_for
from analysis.compress.export.selfcheck import read_self_checks
from analysis.compress.surgery import HeadLayout, prune_heads
from analysis.core.errors import InputError
from analysis.core.registry import take_declared
from analysis.core.progress import Progress, check_stop, no_progress

LAYOUT_FILE = "head_layout.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class StreamSpec:
    """How a format is written from a checkpoint without building the model (`analysis.compress.export.streamed`):
    names "state_dict" (the model's state-dict names, a tied tensor once, as safetensors' save_model
    keeps it) or "checkpoint" (the checkpoint's save_pretrained names); producer: headscope's
    "producer" metadata (load_pruned reads the weights itself); config "original" or "stock" (the
    pruned head counts) or None (no config.json); writer "safetensors" (shards) or "gguf" (one
    model.gguf through analysis.compress.export.gguf.writer, fed tensor by tensor)."""
    names: str
    producer: bool
    config: str | None
    writer: str = "safetensors"


class ExportFormat:
    """One export format. Subclasses set the class attributes and implement `write`; a format declared
    in analysis.compress.export.format_registry (a `FormatSpec` naming the class) sets only `name` (and
    physical / keeps_dtype / streamed) and takes its label, help, rank and options from the declaration
    when the class is defined."""
    name: ClassVar[str] = ""
    label: ClassVar[str] = ""                  # what the app shows
    help: ClassVar[str] = ""                   # one line: what the folder holds and what loads it
    physical: ClassVar[bool] = True            # written from surgery's smaller model (kv_policy applies)
    options: ClassVar[dict[str, FormatOption]] = {}
    rank: ClassVar[int] = 100                  # where the format stands in the CLI's and the app's lists
    streamed: ClassVar[StreamSpec | None] = None   # also written from a checkpoint, tensor by tensor
    # writes the weights in the export's dtype (`export_to(dtype=...)`: the source checkpoint's by default);
    # False: the format has its own precision (ONNX float32, a GGUF type)
    keeps_dtype: ClassVar[bool] = False
    # what the format's runtime does with a KV plan's windowed heads (one line in the export's notes when a plan
    # is given); the default: headscope's PyTorch runtime runs them (analysis.compress.export.planned.load_planned)
    kv_windows: ClassVar[str] = ("the windowed KV heads run in headscope's PyTorch runtime: load the folder with "
                                 "analysis.compress.export.planned.load_planned (compact KV cache)")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        take_declared(cls, FORMATS, DECLARED_FIELDS)

    def write(self, model: nn.Module, pruned, folder: Path, *, kv_policy: str = "auto", rounds=None,
              **options) -> HeadLayout | None:
        """Write the format's files into `folder` (a fresh temporary folder that becomes the export;
        mask.json, head_layout.json and the tokenizer are written by `export_to`). Returns the
        HeadLayout of a physical cut, None for a full-shape one. `options` holds the format's own
        options and `tokenizer` (or None), which a lossy format's self-check reads its held-back
        tokens with; a lossy format writes what its self-check measured to self_check.json
        (`analysis.compress.export.selfcheck`)."""
        raise NotImplementedError


class PhysicalFormat(ExportFormat):
    """A format written from the physically pruned model: `write` cuts, `write_cut` writes it."""
    physical = True

    def write(self, model, pruned, folder, *, kv_policy="auto", rounds=None, dtype=None, **options):
        smaller, layout = prune_heads(model, pruned, kv_policy=kv_policy, rounds=rounds)
        if dtype is not None and self.keeps_dtype:     # the twin's own tensors: `model` keeps its dtype
            smaller = smaller.to(dtype)
        self.write_cut(smaller, layout, folder, original=model, **options)
        return layout

    def write_cut(self, smaller: nn.Module, layout: HeadLayout, folder: Path, *, original: nn.Module,
                  **options) -> None:
        raise NotImplementedError


@dataclass
class ExportResult:
    """What an export wrote: its format, final folder, file name -> size in bytes."""
    format: str
    path: Path
    files: dict[str, int]
    layout: HeadLayout | None = None
    notes: list[str] = field(default_factory=list)   # leftovers cleaned, self-check lines
    checks: list[dict] = field(default_factory=list)  # a lossy format's self-checks (self_check.json)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


def export_dtype(choice: str, source_dtype=None):
    """The dtype an export writes for the user's `choice` (EXPORT_DTYPES): "source" = the checkpoint's
    stored dtype (`LoadedModel.source_dtype`; None when unknown: the model's own); InputError otherwise."""
    from analysis.core.placement import DTYPES
    if choice == "source":
        return source_dtype
    if choice not in DTYPES:
        raise InputError(f"The export dtype must be one of {', '.join(EXPORT_DTYPES)}; got {choice!r}.")
    return DTYPES[choice]


def write_common(tmp: Path, record: MaskRecord, tokenizer, layout: HeadLayout | None, kv_plan=None) -> None:
    if layout is not None:          # a physical cut: mask.json says which kv_policy built it
        record = replace(record, kv_policy=layout.kv_policy)
    (tmp / MASK_FILE).write_text(record.to_json(), encoding="utf-8")
    if layout is not None:
        (tmp / LAYOUT_FILE).write_text(layout.to_json(), encoding="utf-8")
    if kv_plan is not None:         # in the original head slots, plus the file's heads for a physical cut
        write_kv_plan(tmp, kv_plan, layout)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def resident(model: nn.Module) -> nn.Module:
    """`model`, or for one accelerate dispatched or offloaded an in-memory copy on the CPU: an export
    writes real tensors from one device (costs the model's size in RAM, once, for the export)."""
    return in_memory_copy(model) if is_dispatched(model) else model


def export_to(fmt: str, model: nn.Module, pruned, target, *, record: MaskRecord | None = None, tokenizer=None,
              kv_policy: str = "auto", rounds=None, overwrite: bool = False, progress: Progress | None = None,
              dtype: torch.dtype | None = None, kv_plan=None, **options) -> ExportResult:
    """Export `model` under the mask `pruned` [L, H] in format `fmt` into the folder `target` (atomic).

    kv_policy / rounds go to surgery for physical formats (ignored by full-shape ones); `options` are the
    format's own (`FormatOption`s). dtype: the floating dtype the weight files store, for the formats that
    keep one (`keeps_dtype`); callers pass the source checkpoint's (`LoadedModel.source_dtype`) so that a
    bfloat16 checkpoint loaded in float32 is exported in bfloat16, not twice its size; None: the model's.
    kv_plan: a `KVPlan` written as kv_plan.json (`analysis.compress.export.kvfile`); pruned may then be None
    (the plan's own cut); a plan of another model or one pruning heads the mask keeps is refused first."""
    form = get_format(fmt)
    opts = format_options(fmt, options)
    report = progress or no_progress
    model = resident(model)
    plan_notes = []
    if kv_plan is not None:
        kv_plan, pruned, plan_notes = plan_for_export(kv_plan, pruned, adapter_for(model).geometry(model))
        plan_notes.append(f"{fmt}: {form.kv_windows}.")
    elif pruned is None:
        raise InputError("An export needs a mask (or a KV plan, whose pruned heads are the cut).")
    for name, tensor in model.state_dict().items():     # a mask file skips the scorers' own NaN check
        check_finite_tensor(tensor, name, "the model")
    record = record_for(model, pruned, record)
    target = Path(target)
    notes = clean_leftovers(target.parent)
    for note in notes:
        report(0.0, note)
    report(0.0, f"{fmt} export: writing to a temporary folder")
    with atomic_folder(target, overwrite=overwrite) as tmp:
        kept = {"dtype": dtype} if form.keeps_dtype and dtype is not None else {}
        layout = form.write(model, pruned, tmp, kv_policy=kv_policy, rounds=rounds, tokenizer=tokenizer, **kept, **opts)
        write_common(tmp, record, tokenizer, layout, kv_plan)
        check_stop(None, f"The {fmt} export")     # a signal during the write: the temporary folder goes
        report(0.9, f"{fmt} export: moving into place")
    checks = read_self_checks(target)
    for check in checks:
        report(1.0, check["line"])
    report(1.0, f"{fmt} export written to {target}")
    for note in plan_notes:
        report(1.0, note)
    return ExportResult(format=fmt, path=target, files=listing(target), layout=layout,
                        notes=notes + plan_notes + [c["line"] for c in checks], checks=checks)


def export(fmt: str, model: nn.Module, pruned, root, name: str, **kwargs) -> ExportResult:
    """Export in format `fmt` to the folder `name`, confined to the output folder `root` (see export_to)."""
    get_format(fmt)
    target = resolve_under(root, name)              # escapes first: their message says "outside"
    check_export_name(name)
    return export_to(fmt, model, pruned, target, **kwargs)
