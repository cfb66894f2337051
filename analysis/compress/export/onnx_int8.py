"""The "onnx-int8" format: model.onnx with INT8 weights for ONNX Runtime, self-checked on this CPU.

Written from the physically pruned model: the float32 ONNX file first (a scratch copy inside the
export's temporary folder, `onnx.write_onnx`), then ONNX Runtime's quantization tools, then the
self-check (`selfcheck`: the INT8 file against the float32 file, on this machine's kernels, on
held-back tokens). Methods (`ONNX_METHODS`):
- "dynamic" (default; integer kernels, what makes INT8 faster than float32): MatMulInteger with
  per-channel **u8** weights and 8-bit activations quantized per tensor on every call; the
  activation x activation MatMuls of attention stay float, and so do the Linear layers in
  `keep_float` (the outlier layers and the LM head: `measure.outliers.int8_keep_float`).
- "weight-only": the embedding Gather per-channel INT8, every MatMul 8-bit blocks along the input
  (`MatMulNBits`); activations stay float32.
A file whose self-check fails is never written: "dynamic" falls back to "weight-only" (the note
says so), and a failed "weight-only" refuses the export.

Why u8 weights (docs/EXPORT.md, "INT8 on every CPU"): with s8 weights ONNX Runtime's x86 kernels
multiply u8 activations by s8 weights with VPMADDUBSW, which adds two adjacent products into a
*saturating* int16; on CPUs with AVX-512 VNNI (VPDPBUSD adds into int32) nothing saturates, but on
AVX2-only CPUs (AMD Zen 2/3, many cloud VMs) a pair of 255 x 127 products (64,770) is clamped to
32,767, and SmolLM2's INT8 file fell to top-1 agreement 0.174 and perplexity x167 there. u8 x u8 runs
through a kernel that widens to 16 bits first and adds into int32 (no saturation on any x86 CPU), at
the same agreement on SmolLM2 (measured: docs/EXPORT.md). `saturating_matmuls` finds the integer
MatMuls of a file that an AVX2-only CPU could saturate (the check every written file passes).
"""
from __future__ import annotations

import contextlib
import logging
import re
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import numpy as np
from torch import nn

from analysis.compress.export.folder import ExportError, atomic_folder
from analysis.compress.export.formats import PhysicalFormat
from analysis.compress.export.onnx import ONNX_FILE, OnnxLM, onnx_file, write_onnx
from analysis.compress.export.selfcheck import (SelfCheck, check_causal, check_outputs, held_back_windows, refuse,
                                                write_self_checks)
from analysis.arch.models import model_kind
from analysis.measure.outliers import int8_keep_float_for
from analysis.core.errors import InputError

DEFAULT_BLOCK = 32
INT16_MAX = 32767


def _onnx_path_of(module_name: str) -> str:
    """The ONNX scope of a module: 'model.layers.28.mlp.down_proj' -> 'model/layers.28/mlp/down_proj'
    (the TorchScript exporter keeps a ModuleList index with its list's name)."""
    return re.sub(r"\.(\d+)", r"#\1", module_name).replace(".", "/").replace("#", ".")


def weight_matmuls(model_proto, keep_float: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(MatMul nodes with an initializer input, to quantize; those of them kept float because their
    module is in keep_float)."""
    inits = {i.name for i in model_proto.graph.initializer}
    scopes = [f"/{_onnx_path_of(name)}/" for name in keep_float]
    weights = [n.name for n in model_proto.graph.node if n.op_type == "MatMul" and any(x in inits for x in n.input)]
    kept = [n for n in weights if any(scope in n + "/" for scope in scopes)]
    return [n for n in weights if n not in kept], kept


def _weight_only(src: Path, dst: Path, block_size: int, keep_float: Sequence[str] = ()) -> None:
    """Per-channel INT8 Gather (embedding), then 8-bit block-quantized MatMul weights."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    staged = dst.with_name(".gather-" + dst.name)
    quantize_dynamic(str(src), str(staged), weight_type=QuantType.QInt8, op_types_to_quantize=["Gather"],
                     per_channel=True)
    quantizer = MatMulNBitsQuantizer(onnx.load(str(staged)), bits=8, block_size=block_size, is_symmetric=True,
                                     op_types_to_quantize=("MatMul",))
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)
    staged.unlink()


def _dynamic(src: Path, dst: Path, block_size: int, keep_float: Sequence[str] = ()) -> None:
    """Integer-kernel INT8: per-channel u8 weights (no int16 saturation on any x86 CPU), dynamic 8-bit
    activations, the keep_float layers float."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    nodes, _ = weight_matmuls(onnx.load(str(src), load_external_data=False), keep_float)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QUInt8, nodes_to_quantize=nodes, per_channel=True)


ONNX_METHODS = {"dynamic": _dynamic, "weight-only": _weight_only}   # keys: format_registry.ONNX_INT8_METHODS
FALLBACK = {"dynamic": "weight-only"}          # the variant a failed self-check falls back to


@contextlib.contextmanager
def quiet_logs():
    """ONNX Runtime's quantizer logs every node at INFO level (and warns about pre-processing);
    keep the CLI, the app and the tests quiet. The root logger is left as it was: importing
    onnxruntime.quantization.matmul_nbits_quantizer (the weight-only method) calls logging.basicConfig(level=
    INFO), which put every library's INFO records (the gguf writer's "This GGUF file is for Little Endian
    only") on stderr for the rest of the process."""
    root = logging.getLogger()
    previous, handlers, level = logging.root.manager.disable, list(root.handlers), root.level
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


def quantize_file(src: Path, dst: Path, method: str, *, block_size: int = DEFAULT_BLOCK,
                  keep_float: Sequence[str] = ()) -> Path:
    """INT8 `dst` from the float32 ONNX file `src` by `method` (ONNX_METHODS)."""
    if method not in ONNX_METHODS:
        raise InputError(f"Unknown ONNX quantization method {method!r}; choose one of {', '.join(ONNX_METHODS)}.")
    with quiet_logs():
        ONNX_METHODS[method](Path(src), Path(dst), int(block_size), tuple(keep_float))
    return Path(dst)


def quantize_onnx(source, target, *, method: str = "weight-only", block_size: int = DEFAULT_BLOCK,
                  keep_float: Sequence[str] = (), overwrite: bool = False) -> Path:
    """INT8 copy of an ONNX export folder (or model.onnx) written atomically to folder `target`, not
    self-checked (the "onnx-int8" format is the checked export; this is for measuring variants).
    keep_float: module names ("model.layers.11.mlp.down_proj") whose MatMul stays float32 ("dynamic").
    Returns the new model.onnx path."""
    if method not in ONNX_METHODS:
        raise InputError(f"Unknown ONNX quantization method {method!r}; choose one of {', '.join(ONNX_METHODS)}.")
    src = onnx_file(source)
    target = Path(target)
    with atomic_folder(target, overwrite=overwrite) as tmp:
        for side in src.parent.iterdir():                 # config, tokenizer, mask.json, head_layout.json
            if side.is_file() and side.suffix != ".onnx" and not side.name.startswith("."):
                shutil.copy2(side, tmp / side.name)
        quantize_file(src, tmp / ONNX_FILE, method, block_size=block_size, keep_float=keep_float)
    return target / ONNX_FILE


def saturating_matmuls(model_proto) -> list[str]:
    """The MatMulInteger nodes of a file that an x86 CPU without VNNI could saturate: u8 activations
    times s8 weights whose two adjacent entries along the input (the pair VPMADDUBSW adds into one
    int16) reach 255 x (|b_k| + |b_k+1|) > 32,767 with equal signs. u8 weights never saturate (their
    kernel widens to 16 bits first); 7-bit s8 weights (reduce_range) cannot reach it."""
    from onnx import TensorProto, numpy_helper
    inits = {i.name: i for i in model_proto.graph.initializer}
    found = []
    for node in model_proto.graph.node:
        if node.op_type != "MatMulInteger" or node.input[1] not in inits:
            continue
        init = inits[node.input[1]]
        if init.data_type != TensorProto.INT8:
            continue
        b = numpy_helper.to_array(init).astype(np.int32)                  # [K, N] (or [..., K, N])
        b = b.reshape(-1, b.shape[-2], b.shape[-1])[:, : b.shape[-2] // 2 * 2]
        pairs = b[:, 0::2] + b[:, 1::2]                                   # same-sign pairs add up in size
        same = np.sign(b[:, 0::2]) == np.sign(b[:, 1::2])
        if (same & (255 * np.abs(pairs) > INT16_MAX)).any():
            found.append(node.name or node.output[0])
    return found


def _portable(path: Path) -> None:
    """ExportError if the file holds an integer MatMul that an x86 CPU without VNNI could saturate (this
    CPU's own self-check cannot see it when it has VNNI, but the file must run right everywhere)."""
    import onnx
    risky = saturating_matmuls(onnx.load(str(path), load_external_data=False))
    if risky:
        raise ExportError(f"{len(risky)} integer MatMuls of the INT8 file can saturate on x86 CPUs without VNNI "
                          f"(first: {risky[0]}); nothing was written. Export 'onnx' (float32) instead.")


class _Session:
    """One window of ids [T] -> the ONNX file's first output for it [T, *] (float32 numpy)."""

    def __init__(self, path: Path, config):
        self.model = OnnxLM(path, config)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        import torch
        return self.model(input_ids=torch.from_numpy(ids[None])).logits[0].numpy()


def self_check_onnx(fp32: Path, int8: Path, config, tokenizer, *, causal: bool, method: str) -> SelfCheck:
    """The INT8 file against the float32 file in ONNX Runtime on held-back tokens (`selfcheck`)."""
    text = held_back_windows(tokenizer, SimpleNamespace(config=config))
    check = check_causal if causal else check_outputs
    return check(_Session(fp32, config), _Session(int8, config), text, bits=8,
                 artifact_name=f"INT8 ONNX ({method})", reference_name="the float32 ONNX file")


class OnnxInt8Format(PhysicalFormat):
    name = "onnx-int8"   # label, help, rank, options: its declaration (export/format_registry.py)
    kv_windows = ("ONNX Runtime runs every KV head of model.onnx with full attention (the graph has no windows); "
                  "the file holds the plan's cut, kv_plan.json records its windows")

    def write_cut(self, smaller: nn.Module, layout, folder: Path, *, original, tokenizer=None, opset=17,
                  int8_method="dynamic", **options) -> None:
        scratch = Path(folder) / ".fp32"
        scratch.mkdir()
        fp32 = scratch / ONNX_FILE
        write_onnx(smaller, fp32, opset=int(opset))
        causal = model_kind(smaller) == "causal-lm"
        checks: list[SelfCheck] = []
        method = int8_method
        while True:
            keep = int8_keep_float_for(smaller, tokenizer) if method == "dynamic" else ()
            target = quantize_file(fp32, Path(folder) / ONNX_FILE, method, keep_float=keep)
            _portable(target)
            checks.append(self_check_onnx(fp32, target, smaller.config, tokenizer, causal=causal, method=method))
            checks[-1].details = {"int8_method": method, "weights": "u8" if method == "dynamic" else "s8 blocks",
                                  "keep_float": list(keep)}
            if checks[-1].passed:
                break
            if method not in FALLBACK:
                raise refuse(checks[-1], "the INT8 files of this model are wrong on this CPU's kernels; "
                                         "export 'onnx' (float32) instead.")
            method = FALLBACK[method]
        shutil.rmtree(scratch)
        write_self_checks(folder, checks)
        smaller.config.architectures = [type(smaller).__name__]
        smaller.config.save_pretrained(folder)
