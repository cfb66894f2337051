"""The export-format registry: every format's declaration (name, label, help line, place in the lists,
its own options) and the registry `FORMATS` that the CLI (`export --export-format` and one option per
format option, `pipeline --formats`), the Export page and the pipeline read; the options' checks
(`format_options`) and the dtypes an export may be written in (`EXPORT_DTYPES`).

Declarations apart from implementations: this module imports neither torch nor transformers, so the
CLI's parser reads every format and option for free. The built-in formats are declared at the bottom,
one `FormatSpec` each, naming the class lazily ("analysis.compress.export.onnx:OnnxFormat"); the module
is imported and the format built the first time the entry itself is read (`FORMATS[name]`,
`get_format`, `.values()`, `.items()`), and the class takes its label, help, rank and options from the
declaration when it is defined (`ExportFormat.__init_subclass__`), so each is written once. A format may
also be registered as a class (`@register_format`): its own attributes are then its declaration.
analysis.compress.export.formats re-exports all of this.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analysis.compress.export.gguf.types import (DEFAULT_EMBEDDING_TYPE, DEFAULT_WEIGHT_TYPE, EMBEDDING_TYPES,
                                                 WEIGHT_TYPES)
from analysis.core.errors import InputError, check_whole_number
from analysis.core.registry import Declaration, Registry

# what an export's weights are stored in: the source checkpoint's dtype (the default), or one named
EXPORT_DTYPES = ("source", "float32", "bfloat16", "float16")
# the ONNX opsets written as asked: 9 is the lowest torch's TorchScript exporter writes for these models (7 and
# 8 fail), 20 its highest (torch.onnx._constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)
OPSETS = (9, 20)
ONNX_INT8_METHODS = ("dynamic", "weight-only")      # the onnx-int8 format's methods (onnx_int8.ONNX_METHODS)


@dataclass(frozen=True)
class FormatOption:
    """One option of a format: its default, the allowed values (None: any value of the default's type),
    a help line, and for a whole number its (lowest, highest) allowed value."""
    default: Any
    choices: tuple | None = None
    help: str = ""
    bounds: tuple[int, int] | None = None


@dataclass(frozen=True)
class FormatSpec(Declaration):
    """A format declared without importing it: what the CLI and the lists read. `cls` names the
    ExportFormat subclass ("package.module:Class"), which sets only `name` (and what it is: physical,
    keeps_dtype, streamed) and takes the rest from here."""
    name: str                                          # the CLI's --export-format choice, the app's name
    label: str                                         # what the app shows
    help: str                                          # one line: what the folder holds and what loads it
    cls: str                                           # "package.module:Class", imported on first use
    rank: int = 100                                    # its place in the CLI's and the app's lists
    options: dict[str, FormatOption] = field(default_factory=dict)

    def load(self):
        return super().load()()                        # the registry holds format instances


# what a declared format class takes from its FormatSpec (analysis.compress.export.formats.ExportFormat)
DECLARED_FIELDS = ("label", "help", "rank", "options")

FORMATS: Registry = Registry("export format")


def register_format(cls):
    """Add a format to the registry: an ExportFormat subclass (usable as a class decorator; the registry
    holds an instance) or a `FormatSpec` naming one lazily. Its name must be new (ValueError). The
    registry stays ordered by `rank` (then by registration)."""
    declared = FORMATS.declarations.get(getattr(cls, "name", ""))
    if isinstance(cls, FormatSpec):
        if not cls.name or (cls.name in FORMATS and declared != cls):
            raise ValueError(f"export format name {cls.name!r} is empty or taken")
        FORMATS.add(cls.name, cls)
    elif declared is not None and declared.names(cls):
        pass                                           # the class its declaration names: registered already
    elif not cls.name or cls.name in FORMATS:
        raise ValueError(f"export format name {cls.name!r} is empty or taken")
    else:
        FORMATS.add(cls.name, cls())
    FORMATS.reorder(lambda declared_format: declared_format.rank)     # stable: equal ranks keep their order
    return cls


def get_format(fmt: str):
    """The registered format (imported and built now if it was only declared); InputError otherwise."""
    if fmt not in FORMATS:
        raise InputError(f"Unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    return FORMATS[fmt]


def format_options(fmt: str, given: dict) -> dict:
    """The options of `fmt`: its defaults overridden by `given` (unknown names and values refused).
    Reads the declaration: nothing is imported."""
    if fmt not in FORMATS:
        raise InputError(f"Unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    spec = FORMATS.declaration(fmt).options
    unknown = sorted(set(given) - set(spec))
    if unknown:
        raise InputError(f"The {fmt} export has no option {unknown[0]!r}; its options are "
                         f"{', '.join(spec) or 'none'}.")
    out = {name: opt.default for name, opt in spec.items()}
    for name, value in given.items():
        if spec[name].choices is not None and value not in spec[name].choices:
            raise InputError(f"The {fmt} export's {name} must be one of {', '.join(map(str, spec[name].choices))}; "
                             f"got {value!r}.")
        if spec[name].bounds is not None:
            low, high = spec[name].bounds
            value = check_whole_number(value, f"The {fmt} export's {name}", low=low, high=high)
        out[name] = value
    return out


# The built-in formats (docs/EXPORT.md describes their files). A new format: its class in a module of
# this package setting only `name` (and physical / keeps_dtype / streamed), and one declaration here
# (docs/ARCHITECTURE.md, "How to add an export format").
_HERE = "analysis.compress.export"
for _spec in (
    FormatSpec("zeroed", "zeroed weights (original shapes)",
               "original shapes, pruned heads zeroed: loads anywhere, no smaller", f"{_HERE}.zeroed:ZeroedFormat",
               rank=10),
    FormatSpec("pruned", "pruned checkpoint (head layout)",
               "physically smaller, any per-layer head counts: load_pruned loads it", f"{_HERE}.pruned:PrunedFormat",
               rank=20),
    FormatSpec("stock", "stock checkpoint (from_pretrained)", "uniform head counts: plain from_pretrained loads it",
               f"{_HERE}.stock:StockFormat", rank=30),
    FormatSpec("onnx", "ONNX (ONNX Runtime)", "model.onnx of the pruned model, for ONNX Runtime",
               f"{_HERE}.onnx:OnnxFormat", rank=40,
               options={"opset": FormatOption(17, None, f"ONNX opset version ({OPSETS[0]} to {OPSETS[1]})",
                                              bounds=OPSETS)}),
    FormatSpec("onnx-int8", "ONNX INT8 (self-checked)",
               "model.onnx with INT8 weights for ONNX Runtime (integer kernels by default), measured against the "
               "float32 file on this CPU before it is written", f"{_HERE}.onnx_int8:OnnxInt8Format", rank=50,
               options={"opset": FormatOption(17, None, "ONNX opset version"),
                        "int8_method": FormatOption("dynamic", ONNX_INT8_METHODS,
                                                    "dynamic: integer kernels (u8 weights, 8-bit activations per "
                                                    "call, outlier layers float); weight-only: 8-bit weights, float "
                                                    "activations")}),
    FormatSpec("gguf", "GGUF (llama.cpp)",
               "model.gguf for llama.cpp (and what is built on it), per-layer head counts included",
               f"{_HERE}.gguf.format:GGUFFormat", rank=60,
               options={"gguf_type": FormatOption(DEFAULT_WEIGHT_TYPE, tuple(WEIGHT_TYPES),
                                                  "GGUF weight type (k-quants and q4_0/q4_1 by llama.cpp's "
                                                  "quantizer)"),
                        "gguf_embedding_type": FormatOption(
                            DEFAULT_EMBEDDING_TYPE, tuple(EMBEDDING_TYPES),
                            "type of the token embedding (and output) tensor that llama.cpp's quantizer is told to "
                            "use (its token_embedding_type / output_tensor_type; auto: its own choice, Q8_0 on "
                            "SmolLM2); the file keeps its weight type's name, the deployment report lists every "
                            "tensor's type")}),
):
    register_format(_spec)
del _spec
