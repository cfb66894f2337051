"""Exports of a pruned model: the atomic export folder (`folder`), mask.json (`records`), the format
registry and its entry point (`formats`: `export`, `export_to`, `FORMATS`, `register_format`), one
module per format: `zeroed`, `pruned` (+ `load_pruned`), `stock` (+ `stock_check`), `onnx`, `onnx_int8`,
the `gguf` package (writer, tokenizer, reader, llama.cpp runner, deployment report, the format); the
self-check of the lossy ones (`selfcheck`) and the export of a checkpoint that is never built
(`streamed`). docs/EXPORT.md describes the files.

Importing this package imports every module in it, so a format module registers itself by being here
(docs/ARCHITECTURE.md, "How to add an export format")."""
import importlib
import pkgutil

from analysis.compress.export.folder import (DEFAULT_EXPORT_ROOT, EXPORT_ROOT_ENV, NAME_RULE, ExportError,
                                             atomic_folder, check_export_name, check_export_root,
                                             clean_leftovers,
                                             default_export_root, is_headscope_export, resolve_under)
from analysis.compress.export.formats import (EXPORT_DTYPES, FORMATS, LAYOUT_FILE, WEIGHTS_FILE, ExportFormat, ExportResult,
                                              FormatOption, PhysicalFormat, export, export_dtype, export_to, format_options,
                                              get_format, register_format)
from analysis.compress.export.records import (MASK_FILE, TOOL, TOOL_VERSION, MaskRecord, mask_from_json,
                                              mask_record, read_mask_json)
for _module in pkgutil.iter_modules(__path__):          # every format module registers itself
    importlib.import_module(f"{__name__}.{_module.name}")
from analysis.compress.export.onnx import ONNX_FILE, write_onnx
from analysis.compress.export.pruned import load_pruned
from analysis.compress.export.stock import StockCheck, stock_check, stock_sparsities

__all__ = [
    "DEFAULT_EXPORT_ROOT", "EXPORT_ROOT_ENV", "NAME_RULE", "ExportError", "atomic_folder", "check_export_name", "check_export_root",
    "clean_leftovers", "default_export_root", "is_headscope_export", "resolve_under",
    "EXPORT_DTYPES", "FORMATS", "LAYOUT_FILE", "WEIGHTS_FILE", "ExportFormat", "ExportResult", "FormatOption", "PhysicalFormat",
    "export", "export_dtype", "export_to", "format_options", "get_format", "register_format",
    "MASK_FILE", "TOOL", "TOOL_VERSION", "MaskRecord", "mask_from_json", "mask_record", "read_mask_json",
    "ONNX_FILE", "write_onnx", "load_pruned", "StockCheck", "stock_check", "stock_sparsities",
]
