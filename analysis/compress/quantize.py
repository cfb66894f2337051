"""INT8 quantization of the final (pruned, recovered) model, measured against float32.

Two routes:
- ONNX: `quantize_onnx(fp32_folder, target)` with ONNX Runtime's quantization tools on the
  model.onnx of an ONNX export, into a new export folder written atomically
  (export.atomic_folder), the sidecar files copied. Methods (`ONNX_METHODS`):
  "weight-only" (default): the embedding Gather gets per-channel INT8 weights
  (`quantize_dynamic` with op_types ["Gather"]), then every MatMul gets INT8 weights in blocks
  of `block_size` along the input (`MatMulNBitsQuantizer`, bits=8); activations stay float32.
  "dynamic" (integer kernels: MatMulInteger, which is what makes INT8 faster than float32): the
  weight MatMuls (those with an initializer input: the Linear layers) get per-channel INT8 weights
  and 8-bit activations quantized on the fly (one asymmetric scale per tensor per call); the
  activation x activation MatMuls of attention (Q K^T, P V) stay float, and so do the Linear layers
  named in `keep_float`. Why the first version agreed with float32 on only ~48-56 % of top-1
  predictions on SmolLM2 (measured: docs/results.md and issue 23's report): it quantized every
  MatMul per tensor, but above all the inputs of some MLP down projections carry a few huge
  values (SmolLM2 layer 11: max 3066 at an RMS of 5, 256 calibration tokens), so one 8-bit step
  is larger than the typical value and the rest of the tensor rounds to 0. `sensitive_linears`
  finds those layers from one forward pass on calibration text (8-bit step / input RMS above
  `OUTLIER_STEP`) and keeps them in float. Measured on dense SmolLM2 (512 evaluation tokens, ONNX
  Runtime, 2 threads, a loaded machine): every MatMul per tensor: top-1 agreement 0.56, perplexity
  1.81x; weight MatMuls only, per channel: 0.63, 1.73x; + down projections float: 0.88, 1.01x;
  + the 29 layers above step/RMS 0.3 float instead: 0.87, 1.02x (prefill@128 1.96x faster, 1-token
  1.69x); + layers above 0.15 and the LM head float: 0.92, 1.006x (1.74x, 1.36x). SmoothQuant
  scales (alpha 0.5, folded into the norms and up_proj) made it worse (0.875, 1.06x), so they are
  not used. The 95 % top-1 target is not reached on SmolLM2 by per-tensor dynamic activations.
  `int8_output_errors` ranks the Linear layers by their simulated INT8 output error: the outlier
  rule already keeps almost exactly the worst ones, and keeping more float buys agreement slowly
  (2048 tokens: 0.83 / 0.88 / 0.91 / 0.93 at 16 / 29 / 48 / 64 layers) at the cost of the 1-token
  speed-up; per-tensor weights, reduce_range and static QDQ (MinMax, Percentile) agree less
  (docs/EXPORT.md, bench/bench_int8_variants.py).
- PyTorch: `quantize_linear(model, keep_float)` is `torch.ao.quantization.quantize_dynamic` of
  every nn.Linear but those kept float, per-channel INT8 weights, on a copy (the input model is not
  changed); `torch_int8_report` measures it against float32 in PyTorch (prefill and KV-cache decode).
Which layers stay float in the integer routes (`int8_keep_float`): the LM head, and the layers
whose calibration input has outliers (`sensitive_linears`: on SmolLM2 mostly MLP down projections).

`OnnxLM` wraps an ONNX Runtime session as a module with `.config` and `forward(input_ids) ->
.logits`, so the perplexity of an ONNX file is `evaluation.evaluate`'s own. `compare_onnx`
measures an INT8 file against its float32 source: next-token top-1 agreement and perplexity on
the same text, file sizes, prefill latency (median, alternating calls: speed.alternating_times).
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
from torch import nn

from analysis.core.errors import InputError
from analysis.measure.evaluation import evaluate, token_ids
from analysis.compress.export import ONNX_FILE, atomic_folder
from analysis.compress.speed import alternating_times
from analysis.core.threads import torch_threads

DEFAULT_BLOCK = 32


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


def _dynamic(src: Path, dst: Path, block_size: int, keep_float: Sequence[str] = ()) -> None:
    """Integer-kernel INT8: per-channel weights, dynamic 8-bit activations, sensitive layers float."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    nodes, _ = weight_matmuls(onnx.load(str(src), load_external_data=False), keep_float)
    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, nodes_to_quantize=nodes, per_channel=True)


ONNX_METHODS = {"weight-only": _weight_only, "dynamic": _dynamic}


def _onnx_file(path) -> Path:
    path = Path(path)
    path = path / ONNX_FILE if path.is_dir() else path
    if not path.is_file():
        raise InputError(f"{path} is not an ONNX file; export the model in the 'onnx' format first.")
    return path


def quantize_onnx(source, target, *, method: str = "weight-only", block_size: int = DEFAULT_BLOCK,
                  keep_float: Sequence[str] = (), overwrite: bool = False) -> Path:
    """INT8 copy of an ONNX export folder (or model.onnx) written atomically to folder `target`.
    keep_float: module names ("model.layers.11.mlp.down_proj", from `sensitive_linears`) whose
    MatMul stays float32 ("dynamic"). Returns the new model.onnx path."""
    if method not in ONNX_METHODS:
        raise InputError(f"Unknown ONNX quantization method {method!r}; choose one of {', '.join(ONNX_METHODS)}.")
    src = _onnx_file(source)
    target = Path(target)
    with atomic_folder(target, overwrite=overwrite) as tmp:
        for side in src.parent.iterdir():                 # config, tokenizer, mask.json, head_layout.json
            if side.is_file() and side.suffix != ".onnx" and not side.name.startswith("."):
                shutil.copy2(side, tmp / side.name)
        with warnings.catch_warnings(), _quiet_logs():
            warnings.simplefilter("ignore")
            ONNX_METHODS[method](src, tmp / ONNX_FILE, int(block_size), tuple(keep_float))
    return target / ONNX_FILE


@contextlib.contextmanager
def _quiet_logs():
    """ONNX Runtime's quantizer logs every node at INFO level; keep the CLI and tests quiet."""
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        yield
    finally:
        logging.disable(previous)


OUTLIER_STEP = 0.3     # 8-bit step / input RMS above which a Linear layer stays float
CALIBRATION_SHAPE = (2, 256)   # sequences x tokens of the calibration split that find the sensitive layers


@torch.no_grad()
def activation_steps(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """For every nn.Linear of `model`: the step of a per-tensor 8-bit activation quantizer
    ((max - min) / 255 of its input) over the input's RMS, on ids [B, T]. Above ~1 the typical input
    value is below one step, so dynamic INT8 of that layer rounds most of its input to zero."""
    steps: dict[str, float] = {}

    def hook(name):
        def record(module, inputs):
            x = inputs[0].detach().float()                                 # [B, T, D_in]
            rms = float(x.pow(2).mean().sqrt())
            steps[name] = max(steps.get(name, 0.0), float(x.max() - x.min()) / 255 / rms if rms else math.inf)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if type(m) is nn.Linear]
    try:
        model(input_ids=torch.as_tensor(ids).long())
    finally:
        for h in handles:
            h.remove()
    return steps


def sensitive_linears(model: nn.Module, ids: torch.Tensor, threshold: float = OUTLIER_STEP) -> list[str]:
    """Names of the nn.Linear layers whose calibration input (ids [B, T]) has an 8-bit step above
    `threshold` x its RMS (`activation_steps`): the layers dynamic INT8 keeps in float."""
    return sorted(name for name, step in activation_steps(model, ids).items() if step > threshold)


def output_head_names(model: nn.Module) -> list[str]:
    """The module name(s) of the LM head (tied to the embedding in SmolLM2): kept float by default,
    it is the last projection, whose errors go straight into the logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules() if head is not None and m is head]


def calibration_ids(tokenizer, shape: tuple[int, int] = CALIBRATION_SHAPE) -> torch.Tensor:
    """Token ids [n, T] of the built-in calibration split (the scorers' `scoring.calibration_ids`)."""
    from analysis.score.scoring import calibration_ids as scorer_calibration
    return scorer_calibration(tokenizer, n_sequences=shape[0], seq_len=shape[1])


def int8_keep_float(model: nn.Module, ids: torch.Tensor, threshold: float = OUTLIER_STEP) -> list[str]:
    """What integer INT8 keeps float: the outlier layers (`sensitive_linears` on ids [n, T]) and the
    LM head (`output_head_names`)."""
    return sorted(set(sensitive_linears(model, ids, threshold)) | set(output_head_names(model)))


def _fake_int8(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w) rounded as the dynamic integer route rounds them: x [.., D_in] to 8-bit asymmetric
    steps over its whole range (one scale per tensor, zero exact), w [D_out, D_in] to symmetric
    INT8 per output channel."""
    lo, hi = float(x.min().clamp(max=0)), float(x.max().clamp(min=0))
    step = (hi - lo) / 255 or 1.0
    zero = round(-lo / step)
    xq = ((x / step).round() + zero).clamp(0, 255).sub(zero).mul(step)                # [.., D_in]
    ws = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127                          # [D_out, 1]
    return xq, (w / ws).round().clamp(-127, 127) * ws                                  # [.., D_in], [D_out, D_in]


@torch.no_grad()
def int8_output_errors(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """For every nn.Linear of `model`: the relative error of its output when its input and weight
    are rounded as dynamic INT8 rounds them (`_fake_int8`), per token ||y_q - y|| / ||y|| averaged
    over tokens (a whole-tensor norm would be dominated by the few tokens that carry a massive
    activation, while every token's prediction counts), the largest over the sequences of ids
    [B, T] (one forward each: one activation scale per call, as in ONNX Runtime). The layers to
    keep float are the largest of these."""
    errors: dict[str, float] = {}

    def hook(name):
        def record(module, inputs, output):
            xq, wq = _fake_int8(inputs[0].detach().float(), module.weight.float())
            yq = nn.functional.linear(xq, wq, None if module.bias is None else module.bias.float())
            y = output.detach().float()                                                # [1, T, D_out]
            err = float(((yq - y).norm(dim=-1) / y.norm(dim=-1).clamp(min=1e-12)).mean())   # per token [1, T]
            errors[name] = max(errors.get(name, 0.0), err)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
               if type(m) is nn.Linear and m.weight.numel()]
    try:
        for row in torch.as_tensor(ids).long():                                        # [T]
            model(input_ids=row.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return errors


def worst_linears(model: nn.Module, ids: torch.Tensor, k: int) -> list[str]:
    """The k nn.Linear layers with the largest `int8_output_errors` on ids [B, T]."""
    errors = int8_output_errors(model, ids)
    return sorted(sorted(errors, key=errors.get, reverse=True)[:k])


def quantize_linear(model: nn.Module, keep_float: Sequence[str] = (), *, per_channel: bool = True) -> nn.Module:
    """A copy of `model` whose nn.Linear layers are PyTorch dynamic INT8 (CPU inference only): INT8
    weights (per output channel by default), activations quantized per tensor on the fly, integer
    matmuls (fbgemm / onednn). keep_float: module names left float (`sensitive_linears`)."""
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig, quantize_dynamic
    twin = copy.deepcopy(model).eval()
    qconfig = per_channel_dynamic_qconfig if per_channel else default_dynamic_qconfig
    spec = {name: qconfig for name, m in twin.named_modules()       # an emptied layer's 0-row Linear stays as it is
            if type(m) is nn.Linear and name not in set(keep_float) and m.weight.numel()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torch.ao.quantization's deprecation notice
        return quantize_dynamic(twin, spec, dtype=torch.qint8)


def state_bytes(model: nn.Module) -> int:
    """Bytes of torch.save(state_dict) (quantized Linear layers store packed INT8 weights)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


class OnnxLM(nn.Module):
    """An ONNX Runtime session as a causal-LM-like module: forward(input_ids) -> .logits."""

    def __init__(self, path, config, threads: int | None = None):
        super().__init__()
        import onnxruntime as ort
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        self.path = _onnx_file(path)
        self.session = ort.InferenceSession(str(self.path), options, providers=["CPUExecutionProvider"])
        self.config = config

    def get_input_embeddings(self) -> nn.Module:
        """A tensor-less stand-in, so `adapters.input_device` says the CPU: the ids go to ONNX
        Runtime's CPU provider as numpy arrays."""
        return nn.Identity()

    def forward(self, input_ids, attention_mask=None, **_):
        ids = torch.as_tensor(input_ids).long()                            # [B, T]
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask
        logits = self.session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.long().numpy()})[0]
        return SimpleNamespace(logits=torch.from_numpy(logits))            # [B, T, V]


@dataclass
class QuantComparison:
    """INT8 vs float32 on the same text (ONNX Runtime)."""
    top1_agreement: float
    perplexity_fp32: float
    perplexity_int8: float
    bytes_fp32: int
    bytes_int8: int
    latency_ms_fp32: float
    latency_ms_int8: float
    n_tokens: int
    accuracy_fp32: float | None = None    # next-token top-1 accuracy on the text
    accuracy_int8: float | None = None
    one_token_ms_fp32: float | None = None  # a 1-token forward: the weight-bound work of a decode step
    one_token_ms_int8: float | None = None  # (the ONNX export has no KV cache, so no real decode)
    keep_float: tuple = ()
    # {"prefill" | "one_token": {"min", "median", "max", "rounds"}} of the per-round fp32 / int8 time
    # ratios (the rounds alternate the four calls): the speed-ups as a bench prints and judges them
    speedups: dict = field(default_factory=dict)

    @property
    def size_ratio(self) -> float:
        return self.bytes_int8 / self.bytes_fp32

    @property
    def perplexity_ratio(self) -> float:
        return self.perplexity_int8 / self.perplexity_fp32

    def as_dict(self) -> dict:
        return {**asdict(self), "size_ratio": self.size_ratio, "perplexity_ratio": self.perplexity_ratio}


@torch.no_grad()
def top1_agreement(a: nn.Module, b: nn.Module, ids: torch.Tensor, window: int = 256) -> float:
    """Fraction of positions where a and b predict the same next token; ids [N] in windows."""
    same, total = 0, 0
    for begin in range(0, ids.numel() - 1, window):
        x = ids[begin:begin + window].unsqueeze(0)                         # [1, T]
        if x.shape[1] < 2:
            break
        pa, pb = a(input_ids=x).logits.argmax(-1), b(input_ids=x).logits.argmax(-1)  # [1, T]
        same += int((pa == pb).sum())
        total += pa.numel()
    return same / total


def compare_onnx(loaded, fp32, int8, text=None, *, max_tokens: int = 1024, window: int = 256,
                 latency_tokens: int = 128, repeats: int = 5, threads: int | None = None) -> QuantComparison:
    """INT8 ONNX `int8` vs float32 ONNX `fp32` (folders or files) of `loaded`'s (pruned) model."""
    config = loaded.model.config
    a, b = OnnxLM(fp32, config, threads), OnnxLM(int8, config, threads)
    ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens)   # [N]
    agree = top1_agreement(a, b, ids, window)
    evs = [evaluate(replace(loaded, model=m), text, max_tokens=max_tokens) for m in (a, b)]
    x, x1 = ids[:latency_tokens].unsqueeze(0), ids[:1].unsqueeze(0)         # [1, T], [1, 1]
    with torch_threads(threads):
        times = alternating_times({"fp32": lambda: a(input_ids=x), "int8": lambda: b(input_ids=x),
                                   "fp32-1": lambda: a(input_ids=x1), "int8-1": lambda: b(input_ids=x1)},
                                  repeats=repeats, warmup=1)
    ms = times.median_ms("wall")
    return QuantComparison(top1_agreement=agree, perplexity_fp32=evs[0].value, perplexity_int8=evs[1].value,
                           bytes_fp32=a.path.stat().st_size, bytes_int8=b.path.stat().st_size,
                           latency_ms_fp32=ms["fp32"], latency_ms_int8=ms["int8"], n_tokens=int(ids.numel()),
                           accuracy_fp32=evs[0].accuracy, accuracy_int8=evs[1].accuracy,
                           one_token_ms_fp32=ms["fp32-1"], one_token_ms_int8=ms["int8-1"],
                           speedups={"prefill": times.ratio_spread("fp32", "int8"),
                                     "one_token": times.ratio_spread("fp32-1", "int8-1")})


def evaluation_text_or(text):
    from analysis.core.text import evaluation_text
    return evaluation_text() if text is None else text


def torch_int8_report(loaded, model: nn.Module, text=None, *, max_tokens: int = 512, latency_tokens: int = 128,
                      repeats: int = 5, threads: int | None = None, keep_float: Sequence[str] | None = None,
                      window: int = 256) -> dict:
    """PyTorch dynamic INT8 of `model`'s Linear layers (`quantize_linear`; keep_float None = the
    sensitive layers and the LM head, `int8_keep_float` on the calibration split) vs the float32
    model in the same runtime: size, prefill and decode latency (alternating), metric, top-1."""
    from analysis.compress.speed import _decode_step
    if keep_float is None:
        keep_float = int8_keep_float(model, calibration_ids(loaded.tokenizer))
    q = quantize_linear(model, keep_float)
    evs = {name: evaluate(replace(loaded, model=m), text, max_tokens=max_tokens) for name, m in (("fp32", model),
                                                                                               ("int8", q))}
    all_ids = token_ids(loaded.tokenizer, evaluation_text_or(text), max_tokens=max_tokens)   # [N]
    ids = all_ids[:latency_tokens].unsqueeze(0)                            # [1, T]
    with torch.inference_mode(), torch_threads(threads):
        agree = top1_agreement(model, q, all_ids, window)
        times = alternating_times({"fp32": lambda: model(input_ids=ids), "int8": lambda: q(input_ids=ids)},
                                  repeats=repeats, warmup=1)
        decode = alternating_times({"fp32": _decode_step(model, ids, 8), "int8": _decode_step(q, ids, 8)},
                                   repeats=max(1, repeats), warmup=0, self_timed=True)   # per-token medians
    ms, decode_ms = times.median_ms("wall"), decode.median_ms("wall")
    sizes = {"fp32": state_bytes(model), "int8": state_bytes(q)}
    return {"metric_fp32": evs["fp32"].value, "metric_int8": evs["int8"].value, "bytes_fp32": sizes["fp32"],
            "accuracy_fp32": evs["fp32"].accuracy, "accuracy_int8": evs["int8"].accuracy, "top1_agreement": agree,
            "bytes_int8": sizes["int8"], "size_ratio": sizes["int8"] / sizes["fp32"],
            "latency_ms_fp32": ms["fp32"], "latency_ms_int8": ms["int8"],
            "decode_ms_fp32": decode_ms["fp32"], "decode_ms_int8": decode_ms["int8"],
            "speedups": {"prefill": times.ratio_spread("fp32", "int8"), "decode": decode.ratio_spread("fp32", "int8")},
            "keep_float": list(keep_float), "model": q}
