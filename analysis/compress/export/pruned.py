"""The "pruned" format: the physically smaller model (`analysis.compress.surgery.prune_heads`) as
model.safetensors keyed exactly by `state_dict()` names (tied tensors stored once), the original
config.json and head_layout.json (per-layer head counts); `load_pruned(path)` rebuilds it.

Loading never runs custom code (trust_remote_code is passed explicitly, default off), reads only
safetensors (a pickle .bin is refused, not unpickled), and checks that config.json's architecture is
a transformers model class of the config's own type.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from analysis.arch.adapters import adapter_for
from analysis.arch.models import quiet_load_report, quiet_progress_bars
from analysis.compress.export.formats import LAYOUT_FILE, WEIGHTS_FILE, PhysicalFormat, StreamSpec
from analysis.compress.export.records import TOOL
from analysis.compress.surgery import HeadLayout, apply_layout
from analysis.core import schemas
from analysis.core.errors import HeadscopeError, ModelLoadError, custom_code_refused, first_line
from analysis.core.files import read_file_text
from analysis.core.placement import DTYPES, dtype_name


def save_pruned(model: nn.Module, folder: Path) -> None:
    """model.safetensors keyed by `model.state_dict()` names (tied tensors once) + the original config.json."""
    from safetensors.torch import save_model
    save_model(model, str(folder / WEIGHTS_FILE), metadata={"format": "pt", "producer": TOOL})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)


class PrunedFormat(PhysicalFormat):
    name = "pruned"   # label, help, rank, options: its declaration (export/format_registry.py)
    keeps_dtype = True

    # streamed (analysis.compress.export.streamed): state-dict names, a tie stored once, the original config
    streamed = StreamSpec(names="state_dict", producer=True, config="original")

    def write_cut(self, smaller, layout, folder, *, original, **options):
        save_pruned(smaller, folder)


# ---------------------------------------------------------------------------------------------
# Loading the physically pruned format
# ---------------------------------------------------------------------------------------------

def architecture_class(config):
    """The transformers model class config.architectures names, if it is one for this config type."""
    import transformers
    from transformers import PreTrainedModel
    names = getattr(config, "architectures", None)
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    for name in names:
        cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
        if (isinstance(cls, type) and issubclass(cls, PreTrainedModel)
                and getattr(cls.config_class, "model_type", None) == config.model_type):
            return cls
    raise ModelLoadError(f"config.json names no {config.model_type} model class this transformers version "
                         f"provides (architectures: {names[:3]}); it was edited or comes from another version. "
                         f"Export the pruned model again with this version.")


def _producer(weights: Path) -> str | None:
    """The "producer" metadata of a safetensors file (headscope's pruned format sets it), or None."""
    from safetensors import safe_open
    if not weights.is_file():
        return None
    with safe_open(str(weights), framework="pt") as handle:
        return (handle.metadata() or {}).get("producer")


# the dtypes a pruned export's config.json may name (what headscope loads in, and float64)
LOADABLE_DTYPES = (*DTYPES.values(), torch.float64)


def has_layout(folder) -> bool:
    """Whether `folder` has anything named head_layout.json (a FIFO or a folder of that name included: it is
    then a broken pruned export, which `read_layout` refuses in one line, never a plain model)."""
    return os.path.lexists(Path(folder) / LAYOUT_FILE)


def read_layout(folder) -> HeadLayout:
    """The checked HeadLayout of an export folder's head_layout.json, read through the one capped,
    regular-file-only reader (a FIFO, a device, a folder, a 2 GiB file or bytes that are not UTF-8 are
    one InputError)."""
    return HeadLayout.from_json(read_file_text(Path(folder) / LAYOUT_FILE, schemas.MAX_JSON_CHARS, what=LAYOUT_FILE,
                                               fix="export the pruned model again"))


def load_pruned(path, *, attn_implementation: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """Rebuild a model exported in the pruned format: build it from config.json, apply
    head_layout.json's shapes, load model.safetensors. A stock export (a save_pretrained
    checkpoint whose config.json already holds the pruned counts) is loaded with its class's
    from_pretrained. Custom code in config.json (auto_map) runs only with trust_remote_code.
    Every file is checked before transformers or safetensors reads it (config.json and the
    tokenizer / generation files bounded, regular files only)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from analysis.arch.checkpoint import INDEX_FILE, check_side_files, read_config_json, weight_map
    folder = Path(path)
    if not has_layout(folder):
        raise ModelLoadError(f"{folder} has no {LAYOUT_FILE}; it is not a headscope pruned export. Load zeroed "
                             f"or stock exports with transformers' from_pretrained.")
    layout = read_layout(folder)
    if not (folder / WEIGHTS_FILE).is_file() and not (folder / INDEX_FILE).is_file():
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        if pickled:
            raise ModelLoadError(f"{folder} holds {pickled[0]}, a pickle file, not {WEIGHTS_FILE}: headscope exports "
                                 f"are safetensors and pickles are not loaded (they can run code). Export the pruned "
                                 f"model again.")
        raise ModelLoadError(f"{folder} has no {WEIGHTS_FILE}; an ONNX export holds model.onnx only (run it with "
                             f"ONNX Runtime). Otherwise export the pruned model again.")
    read_config_json(folder)                                  # bounded, regular, a JSON object with sane counts
    check_side_files(folder)
    mapping = weight_map(folder)                              # shards outside the folder are refused
    files = [folder / WEIGHTS_FILE] if mapping is None else [folder / f for f in sorted(set(mapping.values()))]
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=bool(trust_remote_code))
        if layout.model_type != config.model_type:
            raise ModelLoadError(f"{LAYOUT_FILE} in {folder} is for a {str(layout.model_type)[:40]!r} model but its "
                                 f"config.json builds {config.model_type!r}; export the pruned model again.")
        adapter = adapter_for(config)
        g = adapter.geometry(config)
        cls = architecture_class(config)
        if _producer(files[0]) != TOOL:                       # a stock (save_pretrained) checkpoint
            counts = layout.uniform_counts()
            if counts is None:                                # a stock config holds one count for every layer
                raise ModelLoadError(f"{LAYOUT_FILE} in {folder} gives per-layer head counts, but the weights are "
                                     f"not headscope's pruned format (a zeroed or stock export, or weights copied "
                                     f"in), so they cannot hold that cut; export the pruned model again.")
            if (g.n_heads, g.n_kv_heads) != counts:
                raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) does "
                                     f"not match its {LAYOUT_FILE}; export it again.")
            with quiet_progress_bars(), quiet_load_report():
                return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                           trust_remote_code=bool(trust_remote_code), **kwargs).eval()
        if (g.n_heads, g.n_kv_heads) != (layout.n_heads, layout.n_kv_heads):
            raise ModelLoadError(f"config.json in {folder} ({g.n_heads} heads, {g.n_kv_heads} KV heads) is not the "
                                 f"original model's config its {LAYOUT_FILE} expects; export it again.")
        state = {name: tensor for file in files for name, tensor in load_file(str(file)).items()}   # shards (streamed)
    except HeadscopeError:
        raise
    except Exception as err:  # a tampered config or file: transformers' and safetensors' own errors
        if not trust_remote_code and "trust_remote_code" in str(err):
            raise custom_code_refused(f"config.json in {folder}") from None
        raise ModelLoadError(f"Cannot read the pruned checkpoint in {folder} ({first_line(err)}); export it "
                             f"again.") from None
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""), None)
    if isinstance(dtype, torch.dtype):
        if dtype not in LOADABLE_DTYPES:     # float8, bool, ints: no model is built in them
            raise ModelLoadError(f"config.json in {folder} names dtype {dtype_name(dtype)}, which a model cannot be "
                                 f"built in (use one of {', '.join(dtype_name(d) for d in LOADABLE_DTYPES)}); "
                                 f"export the pruned model again.")
        kwargs["dtype"] = dtype
    model = cls._from_config(config, **kwargs)
    apply_layout(model, layout, adapter=adapter)
    _load_state(model, state, folder)
    return model.eval()


def _load_state(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    expected = model.state_dict()
    bad = [k for k, v in state.items() if k in expected and tuple(expected[k].shape) != tuple(v.shape)]
    if bad:
        raise ModelLoadError(f"The weights in {folder} do not fit its head_layout.json (e.g. {bad[0]}); "
                             f"export the pruned model again.")
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[k]) for k in state if k in params}
    # tied weights (e.g. lm_head = embeddings) are saved once: missing names that share a loaded tensor are fine
    missing = [k for k in result.missing_keys if not (k in params and id(params[k]) in loaded_ids)]
    if missing or result.unexpected_keys:
        what = missing[0] if missing else result.unexpected_keys[0]
        raise ModelLoadError(f"The weights in {folder} do not match the model its config builds ({what}); "
                             f"export the pruned model again.")
