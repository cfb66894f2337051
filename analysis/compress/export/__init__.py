"""Exports of a pruned model: the atomic export folder (`folder`), mask.json (`records`), the format
registry (`format_registry`: every format declared, `FORMATS`, `register_format`, `format_options`) and
the entry point (`formats`: `export`, `export_to`), one module per format: `zeroed`, `pruned` (+
`load_pruned`), `stock` (+ `stock_check`), `onnx`, `onnx_int8`, the `gguf` package (writer, tokenizer,
reader, llama.cpp runner, deployment report, the format); the self-check of the lossy ones
(`selfcheck`) and the export of a checkpoint that is never built (`streamed`). docs/EXPORT.md describes
the files.

The names below are lazy (PEP 562): `from analysis.compress.export import FORMATS` imports only the
light registry, `... import export` the entry point, so the CLI's parser lists every format and option
without importing torch. The formats are declared in `format_registry` and each module is imported the
first time its format is used (docs/ARCHITECTURE.md, "How to add an export format")."""
import importlib

_HERE = "analysis.compress.export"
_NAMES: dict[str, str] = {
    **dict.fromkeys(("DEFAULT_EXPORT_ROOT", "EXPORT_ROOT_ENV", "NAME_RULE", "ExportError", "atomic_folder",
                     "check_export_name", "check_export_root", "clean_leftovers", "default_export_root",
                     "is_headscope_export", "resolve_under"), f"{_HERE}.folder"),
    **dict.fromkeys(("EXPORT_DTYPES", "FORMATS", "FormatOption", "FormatSpec", "format_options", "get_format",
                     "register_format"), f"{_HERE}.format_registry"),
    **dict.fromkeys(("LAYOUT_FILE", "WEIGHTS_FILE", "ExportFormat", "ExportResult", "PhysicalFormat", "export",
                     "export_dtype", "export_to"), f"{_HERE}.formats"),
    **dict.fromkeys(("MASK_FILE", "TOOL", "TOOL_VERSION", "MaskRecord", "mask_from_json", "mask_record",
                     "read_mask_json"), f"{_HERE}.records"),
    **dict.fromkeys(("ONNX_FILE", "write_onnx"), f"{_HERE}.onnx"),
    "load_pruned": f"{_HERE}.pruned",
    **dict.fromkeys(("StockCheck", "stock_check", "stock_sparsities"), f"{_HERE}.stock"),
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_NAMES[name]), name)   # modules are cached by the import system


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_NAMES))
