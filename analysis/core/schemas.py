"""JSON schemas of the files headscope reads back (mask.json, head_layout.json) and their checker; the schema
of kv_plan.json lives with the plan (analysis.arch.kvplan), built from the pieces here.

The schemas give exact types and ranges: an integer is a JSON integer (never "12", 1.7, 2.0 or
true), counts are bounded (no 1e13 heads), lists of heads hold unique integers. What a schema
cannot say (a list as long as another field, indices below a count, finite floats) is checked
by the readers in analysis/compress/export.py and analysis/compress/surgery.py after `check(...)` passes.

`load_json_text(text, what)` parses with a size cap and turns deep nesting (RecursionError)
into the same InputError as any other malformed file.
"""
from __future__ import annotations

import json

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match

from analysis.core.errors import InputError

MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_HEAD_DIM = 65536
MAX_JSON_CHARS = 64 * 2**20
MAX_TEXT = 4096                      # model names, paths, scorer names


def _strict_integer(checker, instance) -> bool:
    return isinstance(instance, int) and not isinstance(instance, bool)


def _strict_number(checker, instance) -> bool:
    return isinstance(instance, (int, float)) and not isinstance(instance, bool)


# Draft 2020-12 calls 2.0 an integer; headscope's files never hold one, so neither may a reader.
_Validator = validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many(
    {"integer": _strict_integer, "number": _strict_number}))


def count(maximum: int) -> dict:
    """A count: a JSON integer 1 .. maximum."""
    return {"type": "integer", "minimum": 1, "maximum": maximum}


def _index_lists(maximum: int, max_rows: int) -> dict:
    return {"type": "array", "minItems": 1, "maxItems": max_rows,
            "items": {"type": "array", "maxItems": maximum,
                      "items": {"type": "integer", "minimum": 0, "maximum": maximum - 1}}}


TEXT = {"type": "string", "maxLength": MAX_TEXT}
_OPTIONAL_TEXT = {"type": ["string", "null"], "maxLength": MAX_TEXT}
_TABLE = {"type": ["array", "null"], "maxItems": MAX_LAYERS,
          "items": {"type": "array", "maxItems": MAX_HEADS, "items": {"type": "number"}}}

MASK_SCHEMA = {
    "type": "object",
    "required": ["n_layers", "n_heads", "n_kv_heads", "kept"],
    "properties": {
        "model": TEXT, "model_type": TEXT,
        "n_layers": count(MAX_LAYERS), "n_heads": count(MAX_HEADS), "n_kv_heads": count(MAX_HEADS),
        "kept": {**_index_lists(MAX_HEADS, MAX_LAYERS),
                 "items": {**_index_lists(MAX_HEADS, MAX_LAYERS)["items"], "uniqueItems": True}},
        "scorer": _OPTIONAL_TEXT, "scorer_params": {"type": "object"},
        "z": {"type": ["number", "null"]}, "sparsity": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "policy": _OPTIONAL_TEXT, "kv_policy": _OPTIONAL_TEXT, "scores": _TABLE, "tiebreak": _TABLE,
        "tool": TEXT, "tool_version": TEXT, "format": {"type": "integer", "minimum": 1},
    },
}

LAYOUT_SCHEMA = {
    "type": "object",
    "required": ["model_type", "n_heads", "n_kv_heads", "head_dim", "heads", "kv_heads"],
    "properties": {
        "model_type": TEXT, "n_heads": count(MAX_HEADS), "n_kv_heads": count(MAX_HEADS),
        "head_dim": count(MAX_HEAD_DIM),
        "heads": _index_lists(MAX_HEADS, MAX_LAYERS), "kv_heads": _index_lists(MAX_HEADS, MAX_LAYERS),
        "kv_policy": {"type": "string", "maxLength": 64}, "format": {"type": "integer", "minimum": 1},
        "rounds": {"type": ["array", "null"], "maxItems": MAX_LAYERS,   # [L][H] pipeline round per head, 0 = kept
                   "items": {"type": "array", "maxItems": MAX_HEADS,
                             "items": {"type": "integer", "minimum": 0, "maximum": MAX_HEADS * MAX_LAYERS}}},
    },
}

_VALIDATORS: dict[int, object] = {}                # id(schema) -> its validator, built on first use


def _validator(schema: dict):
    """The validator of a schema (module-level constants: their ids are stable), built once."""
    found = _VALIDATORS.get(id(schema))
    if found is None:
        found = _VALIDATORS[id(schema)] = _Validator(schema)
    return found


def check(data, schema: dict, what: str, fix: str) -> None:
    """InputError naming the first problem of `data` against `schema` (where, and what it should be)."""
    try:
        error = best_match(_validator(schema).iter_errors(data))
    except RecursionError:
        raise InputError(f"{what} is nested too deeply to be a headscope file; {fix}.") from None
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the top level"
        message = error.message if len(error.message) <= 200 else error.message[:200] + "..."
        raise InputError(f"{what} is malformed at {where}: {message}; {fix}.")


def load_json_text(text: str, what: str, fix: str):
    """json.loads with a size cap; InputError (never RecursionError / ValueError) for bad text."""
    if len(text) > MAX_JSON_CHARS:
        raise InputError(f"{what} is larger than {MAX_JSON_CHARS // 2**20} MiB, far more than any headscope file; {fix}.")
    try:
        return json.loads(text)
    except RecursionError:
        raise InputError(f"{what} is nested too deeply to be a headscope file; {fix}.") from None
    except ValueError as err:
        raise InputError(f"{what} is not valid JSON ({err}); {fix}.") from None
