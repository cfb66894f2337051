"""The "onnx" format: model.onnx of the physically pruned model (inputs input_ids, attention_mask;
output logits or last_hidden_state, dynamic batch and sequence axes), runnable by ONNX Runtime,
plus its config.json."""
from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from analysis.arch.adapters import input_device
from analysis.compress.export.folder import ExportError
from analysis.core.errors import InputError
from analysis.compress.export.format_registry import OPSETS  # noqa: F401 (the onnx format's declared opsets)
from analysis.compress.export.formats import PhysicalFormat

ONNX_FILE = "model.onnx"


class _FirstOutput(nn.Module):
    """ONNX wrapper: (input_ids, attention_mask) -> the model's first output, no KV cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.use_cache = hasattr(model.config, "use_cache")

    def forward(self, input_ids, attention_mask):
        extra = {"use_cache": False} if self.use_cache else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **extra)[0]


def _example_ids(model: nn.Module, batch: int = 2, seq: int = 8) -> torch.Tensor:
    vocab = int(model.config.get_text_config().vocab_size)
    g = torch.Generator().manual_seed(0)
    return torch.randint(min(4, vocab - 1), vocab, (batch, seq), generator=g)   # [batch, seq]


def write_onnx(model: nn.Module, path: Path, *, opset: int = 17) -> str:
    """Trace `model` to ONNX at `path` with dynamic batch and sequence axes; returns the output name."""
    ids = _example_ids(model).to(input_device(model))                             # [2, 8]
    mask = torch.ones_like(ids)                                                   # [2, 8]
    wrapper = _FirstOutput(model).eval()
    with torch.no_grad():
        outputs = model(input_ids=ids, attention_mask=mask, return_dict=True)
    name = next(iter(outputs.keys()))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
            name: {0: "batch", 1: "sequence"}}
    with warnings.catch_warnings():
        # the tracer's notes on Python-level shape logic; the dynamic axes are checked by the tests
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
        try:
            torch.onnx.export(wrapper, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                              output_names=[name], dynamic_axes=axes, opset_version=opset, dynamo=False)
        except OSError:
            raise
        except Exception as first:  # the TorchScript tracer failed: try the dynamo exporter
            try:
                batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence", min=2)
                torch.onnx.export(wrapper, (ids, mask), str(path), input_names=["input_ids", "attention_mask"],
                                  output_names=[name], opset_version=max(opset, 18), dynamo=True,
                                  dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                  "attention_mask": {0: batch, 1: seq}})
            except Exception as second:
                raise ExportError(f"ONNX export of this model failed (TorchScript: {str(first).splitlines()[0]}; "
                                  f"dynamo: {str(second).splitlines()[0]}). Use the safetensors exports "
                                  f"instead.") from second
    return name


class OnnxFormat(PhysicalFormat):
    name = "onnx"   # label, help, rank, options: its declaration (export/format_registry.py)
    kv_windows = ("ONNX Runtime runs every KV head of model.onnx with full attention (the graph has no windows); "
                  "the file holds the plan's cut, kv_plan.json records its windows")

    def write_cut(self, smaller, layout, folder, *, original, opset=17, **options):
        write_onnx(smaller, folder / ONNX_FILE, opset=int(opset))
        smaller.config.architectures = [type(smaller).__name__]
        smaller.config.save_pretrained(folder)


def onnx_file(path) -> Path:
    """model.onnx of an ONNX export folder (or the file itself); InputError if there is none."""
    path = Path(path)
    path = path / ONNX_FILE if path.is_dir() else path
    if not path.is_file():
        raise InputError(f"{path} is not an ONNX file; export the model in the 'onnx' format first.")
    return path


class OnnxLM(nn.Module):
    """An ONNX Runtime session as a causal-LM-like module: forward(input_ids) -> .logits."""

    def __init__(self, path, config, threads: int | None = None):
        super().__init__()
        import onnxruntime as ort
        options = ort.SessionOptions()
        # torch's thread count unless told (ONNX Runtime's own default is every physical core, whatever
        # OMP_NUM_THREADS or torch.set_num_threads say: its threads spin at each step, so more threads than
        # the process is given wait on each other, e.g. two pytest-xdist workers on two cores)
        options.intra_op_num_threads = int(threads or torch.get_num_threads())
        self.path = onnx_file(path)
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
