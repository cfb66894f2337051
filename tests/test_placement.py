"""Device / dtype / placement options (analysis/core/placement.py): parsing, the memory guard with a
simulated amount of free RAM (`available_bytes`), and every bad option as one clear CLI line.

The guard's test model is a tiny Llama folder: its float32 estimate does not fit a budget that its
bfloat16 estimate fits exactly, so the boundary is sharp; with an offload folder the same float32
model loads, placed partly on the disk.
"""
import os
import sys

import pytest
import torch

from analysis.core import placement as P
from analysis.core.errors import InputError, ModelLoadError, OutputError
from tests._apptools import tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("placement") / "tiny")


# -- parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [("auto", "auto"), ("CPU", "cpu"), ("cpu:0", "cpu"), ("cuda", "cuda"),
                                        ("cuda:1", "cuda:1"), ("mps", "mps"), (torch.device("cpu"), "cpu")])
def test_device_names(text, want):
    assert P.parse_device(text) == want


@pytest.mark.parametrize("text", ["tpu", "gpu", "cuda:x", "cpu:1", "", "cuda:-1"])
def test_unknown_devices(text):
    with pytest.raises(InputError, match="auto, cpu, cuda"):
        P.parse_device(text)


@pytest.mark.parametrize("text, want", [("bf16", "bfloat16"), ("float16", "float16"), ("torch.float32", "float32"),
                                        (torch.bfloat16, "bfloat16"), ("auto", "auto"), ("FP16", "float16")])
def test_dtype_names(text, want):
    assert P.parse_dtype(text) == want


@pytest.mark.parametrize("text", ["int8", "float64", torch.int8, "double"])
def test_unknown_dtypes(text):
    with pytest.raises(InputError, match="float32, bfloat16, float16"):
        P.parse_dtype(text)


def test_max_memory_strings():
    assert P.parse_max_memory("0=20GiB, cpu=8GiB,disk=1TB") == {0: 20 * 2**30, "cpu": 8 * 2**30, "disk": 10**12}
    assert P.parse_max_memory({"cpu": "512MiB"}) == {"cpu": 512 * 2**20}
    assert P.parse_max_memory("cpu=1024") == {"cpu": 1024}
    assert P.parse_max_memory(None) is None and P.parse_max_memory(" ") is None
    for bad in ("cpu", "gpu=1GiB", "cpu=lots", "cpu=0GiB", "cpu=-1GiB", ","):
        with pytest.raises(InputError, match="max_memory"):
            P.parse_max_memory(bad)


def test_auto_resolution_on_this_machine():
    device = P.resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert P.resolve_dtype("auto", torch.device("cpu")) == torch.float32     # the exact reference on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ModelLoadError, match="no CUDA GPU.*--device cpu"):
        P.resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="no CUDA GPU"):
        P.Placement.of(max_memory="0=1GiB").resolve()


def test_unwritable_offload_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="--offload-folder"):
        P.check_offload_folder(blocker / "sub")
    assert P.check_offload_folder(tmp_path / "new" / "deeper").is_dir()


# -- the memory guard ---------------------------------------------------------------------------

def _estimates(folder):
    from analysis.arch.models import estimate_model_bytes
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    return {dtype: estimate_model_bytes(config, dtype) for dtype in (torch.float32, torch.bfloat16)}


def test_guard_refuses_float32_and_names_bfloat16_which_then_loads(tiny):
    from analysis.arch.models import load_model
    need = _estimates(tiny)
    free = need[torch.bfloat16]
    assert need[torch.float32] > free
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tiny), available_bytes=free)
    text = str(info.value)
    assert "--dtype bfloat16" in text and "--offload-folder" in text and "\n" not in text
    assert load_model(str(tiny), dtype="bfloat16", available_bytes=free).dtype == torch.bfloat16


def test_guard_lets_an_offloaded_float32_model_load(tiny, tmp_path):
    from analysis.arch.models import load_model
    free = _estimates(tiny)[torch.bfloat16]
    loaded = load_model(str(tiny), available_bytes=free, offload_folder=tmp_path / "offload")
    assert loaded.dtype == torch.float32 and loaded.placement.dispatched
    assert "disk" in set(loaded.model.hf_device_map.values())            # the float32 blocks that did not fit
    assert loaded.placement.budgets["cpu"] < sum(p.numel() * 4 for p in loaded.model.parameters())


def test_guard_names_max_memory_when_nothing_fits(tiny):
    from analysis.arch.models import load_model
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tiny), max_memory="cpu=1KiB")
    text = str(info.value)
    assert "1 KiB" in text and "--max-memory" in text and "--offload-folder" in text


# -- the CLI: one clear line each -----------------------------------------------------------------

def _cli_error(capsys, *args) -> str:
    from analysis.cli import main
    rc = main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert "Traceback" not in err[0]
    return err[0]


BAD_OPTIONS = [
    (["--device", "tpu"], "Unknown device"),
    (["--dtype", "int8"], "Unknown dtype"),
    (["--max-memory", "cpu=1KiB"], "--max-memory"),
    (["--max-memory", "cpu=lots"], "not a size"),
]


@pytest.mark.parametrize("options, words", BAD_OPTIONS, ids=["device", "dtype", "nothing-fits", "size"])
def test_cli_bad_placement_is_one_line(capsys, tiny, options, words):
    line = _cli_error(capsys, "score", "--model", str(tiny), "--scorer", "mp", "--quiet", *options)
    assert words in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_cuda_without_cuda_is_one_line(capsys, tiny):
    assert "no CUDA GPU" in _cli_error(capsys, "score", "--model", str(tiny), "--quiet", "--device", "cuda")


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="root can write anywhere")
def test_cli_unwritable_offload_folder_is_one_line(capsys, tiny, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    line = _cli_error(capsys, "score", "--model", str(tiny), "--quiet", "--offload-folder", str(locked / "x"))
    assert "--offload-folder" in line and "cannot write" in line


def test_cli_offload_folder_that_is_a_file_is_one_line(capsys, tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _cli_error(capsys, "evaluate", "--model", str(tiny), "--sparsity", "0.25", "--quiet",
                      "--offload-folder", str(blocker))
    assert "--offload-folder" in line


def test_cli_reports_the_placement(capsys, tiny):
    import json
    from analysis.cli import main
    assert main(["score", "--model", str(tiny), "--scorer", "mp", "--quiet", "--dtype", "bfloat16"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["model"]["placement"] == "cpu, bfloat16"
