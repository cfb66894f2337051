"""Streamed export (issue 22): a safetensors checkpoint cut without building the model writes the same
tensors as `prune_heads` + the in-memory export, bit for bit and in the checkpoint's dtype, for every
tiny family and every structural mask (uniform, uneven groups with K/V expanded, emptied groups and
layers), single-file and sharded, tied and untied embeddings; the folder loads (stock:
from_pretrained, pruned: load_pruned) and computes the in-memory pruned model's logits (float64:
equal). Broken checkpoints are one clear error with nothing written; a full disk, a stop and a kill
mid-export leave nothing behind and the next export works."""
import json
import re
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from analysis.arch.adapters import adapter_for
from analysis.arch.checkpoint import INDEX_FILE
from analysis.arch.resize import SURGERY
from analysis.compress.export import ExportError, export_to, load_pruned
from analysis.compress.export.folder import TMP_MARKER
from analysis.compress.export.streamed import SafetensorsWriter, export_checkpoint
from analysis.compress.surgery import prune_heads
from analysis.core.errors import CancelledError, HeadscopeError, ModelLoadError
from tests._tiny import FAMILIES, tiny_config, tiny_input_ids, tiny_model
from tests._masks import surgery_masks

STOCK_FAMILIES = [f for f in FAMILIES if SURGERY[f].stock_config is not None]
ROOT = Path(__file__).resolve().parents[1]


def export_pruned(model, pruned, target, **kwargs):
    """The in-memory pruned export (prune_heads + save_model), the reference."""
    return export_to("pruned", model, pruned, target, **kwargs)


def export_stock(model, pruned, target, **kwargs):
    """The in-memory stock export (prune_heads + save_pretrained), the reference."""
    return export_to("stock", model, pruned, target, **kwargs)


def _geometry(family, **overrides):
    config = tiny_config(family, **overrides)
    return adapter_for(config).geometry(config)


def _uniform(g):
    """Heads 1 and 3 of every layer: GQA keeps one head per group (2 query / 2 KV), MHA 2 / 2."""
    pruned = np.zeros((g.n_layers, g.n_heads), bool)
    pruned[:, [1, 3]] = True
    return pruned


def _masks(family):
    g = _geometry(family)
    return {"uniform": _uniform(g), **surgery_masks(g, zlib.crc32(family.encode()))}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _assert_same_tensors(mine: Path, theirs: Path):
    a, b = _tensors(mine), _tensors(theirs)
    assert a and sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for name in a:
        assert a[name].dtype == b[name].dtype, (name, a[name].dtype, b[name].dtype)
        assert a[name].shape == b[name].shape, (name, a[name].shape, b[name].shape)
        assert torch.equal(a[name], b[name]), name


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _checkpoint(tmp_path, family, dtype=torch.float32, shard=None, **overrides):
    model = tiny_model(family, **overrides).to(dtype)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model, folder


# ---------------------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_pruned_equals_in_memory_for_every_mask(family, tmp_path):
    model, ckpt = _checkpoint(tmp_path, family)
    for name, pruned in _masks(family).items():
        export_pruned(model, pruned, tmp_path / f"mem-{name}")
        result = export_checkpoint("pruned", ckpt, pruned, tmp_path / f"streamed-{name}")
        _assert_same_tensors(tmp_path / f"streamed-{name}", tmp_path / f"mem-{name}")
        assert result.layout.heads == prune_heads(model, pruned)[1].heads
        for file in ("head_layout.json", "mask.json"):
            assert (result.path / file).is_file()
        mem_mask = json.loads((tmp_path / f"mem-{name}" / "mask.json").read_text())
        assert json.loads((result.path / "mask.json").read_text())["kept"] == mem_mask["kept"]


@pytest.mark.parametrize("family", STOCK_FAMILIES)
def test_streamed_stock_equals_in_memory(family, tmp_path):
    model, ckpt = _checkpoint(tmp_path, family)
    pruned = _uniform(_geometry(family))
    export_stock(model, pruned, tmp_path / "mem")
    export_checkpoint("stock", ckpt, pruned, tmp_path / "streamed")
    _assert_same_tensors(tmp_path / "streamed", tmp_path / "mem")
    mine = json.loads((tmp_path / "streamed" / "config.json").read_text())
    theirs = json.loads((tmp_path / "mem" / "config.json").read_text())
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "architectures"):
        assert mine.get(key) == theirs.get(key), key


def test_stock_with_expanded_kv_equals_in_memory(tmp_path):
    """kv_policy 'expand' makes an uneven GQA mask uniform (K/V copied per query head)."""
    model, ckpt = _checkpoint(tmp_path, "llama", hidden_size=48)   # Llama's config needs hidden % heads == 0
    pruned = np.zeros((2, 4), bool)
    pruned[:, 0] = True                                   # groups keep 1 + 2 heads: uneven
    export_stock(model, pruned, tmp_path / "mem", kv_policy="expand")
    result = export_checkpoint("stock", ckpt, pruned, tmp_path / "streamed", kv_policy="expand")
    assert result.layout.kv_heads == [[0, 1, 1], [0, 1, 1]]
    _assert_same_tensors(tmp_path / "streamed", tmp_path / "mem")


@pytest.mark.parametrize("family,fmt", [("llama", "pruned"), ("llama", "stock"), ("gpt2", "pruned"),
                                        ("phi3", "stock"), ("bert", "pruned"), ("gpt_neox", "pruned")])
def test_sharded_checkpoint_gives_shards_and_the_same_tensors(family, fmt, tmp_path):
    model, ckpt = _checkpoint(tmp_path, family, shard="20KB")
    shards = sorted(ckpt.glob("*.safetensors"))
    assert (ckpt / INDEX_FILE).is_file() and len(shards) > 2
    pruned = _uniform(_geometry(family)) if fmt == "stock" else _masks(family)["emptied-layer"]
    (export_stock if fmt == "stock" else export_pruned)(model, pruned, tmp_path / "mem")
    result = export_checkpoint(fmt, ckpt, pruned, tmp_path / "streamed")
    _assert_same_tensors(result.path, tmp_path / "mem")
    written = sorted(result.path.glob("*.safetensors"))
    assert len(written) == len(shards)
    index = json.loads((result.path / INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {f.name for f in written}
    assert index["metadata"]["total_size"] == sum(f.stat().st_size for f in written)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint_stays_in_its_dtype(dtype, tmp_path):
    model, ckpt = _checkpoint(tmp_path, "qwen2", dtype=dtype)
    pruned = _masks("qwen2")["uneven-groups"]
    export_pruned(model, pruned, tmp_path / "mem")
    result = export_checkpoint("pruned", ckpt, pruned, tmp_path / "streamed")
    tensors = _tensors(result.path)
    assert {t.dtype for t in tensors.values()} == {dtype}
    _assert_same_tensors(result.path, tmp_path / "mem")


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied, tmp_path):
    model, ckpt = _checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as handle:
        assert ("lm_head.weight" in handle.keys()) is not tied      # save_pretrained stores a tie once
    pruned = _masks("llama")["emptied-group"]
    export_pruned(model, pruned, tmp_path / "mem")
    result = export_checkpoint("pruned", ckpt, pruned, tmp_path / "streamed")
    _assert_same_tensors(result.path, tmp_path / "mem")
    with safe_open(str(result.path / "model.safetensors"), "pt") as handle:
        names, metadata = set(handle.keys()), handle.metadata()
    assert ("model.embed_tokens.weight" in names) is not tied      # save_model keeps "lm_head.weight"
    assert (metadata.get("model.embed_tokens.weight") == "lm_head.weight") is tied
    loaded = load_pruned(result.path)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tied


# ---------------------------------------------------------------------------------------------
# The written folder loads and computes what the in-memory pruned model computes
# ---------------------------------------------------------------------------------------------

def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids)[0]


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "bloom", "bert", "gpt_neox", "qwen3"])
def test_pruned_folder_loads_with_the_in_memory_logits_float64(family, tmp_path):
    model, ckpt = _checkpoint(tmp_path, family, dtype=torch.float64)
    ids = tiny_input_ids()
    for name in ("uneven-groups", "emptied-layer"):
        pruned = _masks(family)[name]
        result = export_checkpoint("pruned", ckpt, pruned, tmp_path / name)
        loaded = load_pruned(result.path, attn_implementation="eager")     # the tiny models' attention
        assert next(loaded.parameters()).dtype == torch.float64
        expected = _logits(prune_heads(model, pruned)[0], ids)
        assert torch.equal(_logits(loaded, ids), expected), name


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_stock_folder_loads_with_from_pretrained_float64(shard, tmp_path):
    from transformers import AutoModelForCausalLM
    model, ckpt = _checkpoint(tmp_path, "llama", dtype=torch.float64, shard=shard)
    pruned = _uniform(_geometry("llama"))
    result = export_checkpoint("stock", ckpt, pruned, tmp_path / "stock")
    loaded = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float64, attn_implementation="eager").eval()
    assert loaded.config.num_attention_heads == 2 and loaded.config.num_key_value_heads == 2
    ids = tiny_input_ids()
    assert torch.equal(_logits(loaded, ids), _logits(prune_heads(model, pruned)[0], ids))


def test_sharded_pruned_folder_loads(tmp_path):
    model, ckpt = _checkpoint(tmp_path, "llama", dtype=torch.float64, shard="20KB")
    pruned = _masks("llama")["emptied-layer"]
    result = export_checkpoint("pruned", ckpt, pruned, tmp_path / "cut")
    assert (result.path / INDEX_FILE).is_file() and not (result.path / "model.safetensors").exists()
    ids = tiny_input_ids()
    loaded = load_pruned(result.path, attn_implementation="eager")
    assert torch.equal(_logits(loaded, ids), _logits(prune_heads(model, pruned)[0], ids))


def test_progress_per_tensor_and_tokenizer_files_copied(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama")
    (ckpt / "tokenizer.json").write_text('{"fake": true}')
    seen = []
    result = export_checkpoint("pruned", ckpt, _masks("llama")["uneven-groups"], tmp_path / "cut",
                               progress=lambda f, m: seen.append((f, m)))
    assert (result.path / "tokenizer.json").read_text() == '{"fake": true}'
    messages = [m for _, m in seen]
    assert any("layer 1/2: cut" in m for m in messages) and any(m.startswith("pruned export: copied") for m in messages)
    fractions = [f for f, _ in seen]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0


def test_writer_refuses_tensors_out_of_order(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [("a", "F32", (2,)), ("b", "F32", (1,))], {})
    with pytest.raises(ValueError, match="expected 'a'"):
        writer.write("b", torch.zeros(1))
    writer.write("a", torch.ones(2))
    with pytest.raises(ValueError, match="never written"):
        writer.close()


# ---------------------------------------------------------------------------------------------
# Bad input: one clear line, nothing written
# ---------------------------------------------------------------------------------------------

def _refused(tmp_path, ckpt, error, match, fmt="pruned", pruned=None):
    pruned = _masks("llama")["uneven-groups"] if pruned is None else pruned
    out = tmp_path / "exports"
    with pytest.raises(error, match=match) as info:
        export_checkpoint(fmt, ckpt, pruned, out / "cut")
    assert "\n" not in str(info.value)
    assert not out.exists(), "the export left something behind"
    return str(info.value)


def test_missing_shard(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama", shard="20KB")
    victim = sorted(ckpt.glob("*.safetensors"))[1]
    victim.unlink()
    _refused(tmp_path, ckpt, ModelLoadError, f"missing 1 of its shards: {victim.name}")


def test_truncated_shard(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama", shard="20KB")
    victim = sorted(ckpt.glob("*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    _refused(tmp_path, ckpt, ModelLoadError, rf"{victim.name}.*truncated.*re-copy")


def test_index_pointing_outside_the_folder(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama", shard="20KB")
    index = json.loads((ckpt / INDEX_FILE).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../elsewhere.safetensors"
    (ckpt / INDEX_FILE).write_text(json.dumps(index))
    _refused(tmp_path, ckpt, ModelLoadError, "outside the checkpoint folder")


@pytest.mark.parametrize("key,value,match", [("intermediate_size", 48, "config.json builds"),
                                             ("num_key_value_heads", 4, "config.json")])
def test_shape_disagrees_with_config(tmp_path, key, value, match):
    _, ckpt = _checkpoint(tmp_path, "llama")
    config = json.loads((ckpt / "config.json").read_text())
    config[key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    pruned = np.zeros((2, 4), bool)
    pruned[0, 0] = True
    _refused(tmp_path, ckpt, ModelLoadError, match, pruned=pruned)


def test_attention_dtype_the_cut_cannot_keep(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama")
    state = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    state[name] = (state[name] * 100).to(torch.int8)              # a quantized attention weight
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    _refused(tmp_path, ckpt, ExportError, r"is I8; the streamed export cuts attention heads of F64, F32")


@pytest.mark.parametrize("shard,match", [(None, r"X9Y.*Re-download or re-save"),
                                         ("20KB", r"dtype 'X9Y'.*cannot read or copy.*Convert the checkpoint")])
def test_unknown_dtype_in_a_header(tmp_path, shard, match):
    _, ckpt = _checkpoint(tmp_path, "llama", shard=shard)
    marker = '"model.norm.weight":{"dtype":"F32"'
    for file in ckpt.glob("*.safetensors"):
        data = bytearray(file.read_bytes())
        n = int.from_bytes(data[:8], "little")
        header = data[8:8 + n].decode()
        if marker in header:
            data[8:8 + n] = header.replace(marker, marker.replace("F32", "X9Y")).encode()
            file.write_bytes(bytes(data))
            break
    else:
        raise AssertionError("no header names model.norm.weight")
    _refused(tmp_path, ckpt, ModelLoadError, match)


def test_stop_mid_export_leaves_nothing(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama")
    calls = []
    out = tmp_path / "exports"
    with pytest.raises(CancelledError):
        export_checkpoint("pruned", ckpt, _masks("llama")["uneven-groups"], out / "cut",
                          should_stop=lambda: calls.append(1) or len(calls) > 5)
    assert not out.exists(), "the stopped export left something behind"


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    folder = tmp_path / "disk"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(folder)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_full_disk_mid_export(tmpfs, tmp_path):
    # about 8.6 MB of float32 weights: the 5 MB disk fills in the middle of the shard
    _, ckpt = _checkpoint(tmp_path, "llama", hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                          num_key_value_heads=2)
    pruned = np.zeros((2, 4), bool)
    pruned[:, 0] = True
    with pytest.raises(ExportError, match=r"disk is full.*nothing was left behind.*free some space") as info:
        export_checkpoint("pruned", ckpt, pruned, tmpfs / "cut")
    assert "\n" not in str(info.value)
    assert list(tmpfs.iterdir()) == []
    result = export_checkpoint("pruned", ckpt, pruned, tmp_path / "elsewhere" / "cut")   # the rerun works
    assert load_pruned(result.path) is not None


_CHILD = """
import sys, time
from pathlib import Path
import numpy as np
import analysis.compress.export.streamed as streamed
original = streamed.SafetensorsWriter.copy
def slow_copy(self, name, entry, should_stop=None):
    original(self, name, entry, should_stop)
    Path(sys.argv[3]).touch()
    time.sleep(60)
streamed.SafetensorsWriter.copy = slow_copy
pruned = np.zeros((2, 4), bool); pruned[0, 0] = True
streamed.export_checkpoint("pruned", sys.argv[1], pruned, sys.argv[2])
"""


@pytest.mark.slow          # a child process imports torch and transformers (about 10 s on a loaded machine)
def test_kill_mid_export_then_the_next_export_cleans_up(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama")
    out, flag = tmp_path / "exports", tmp_path / "writing"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(ckpt), str(out / "cut"), str(flag)], env=env)
    try:
        deadline = time.time() + 120
        while not flag.exists() and child.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert flag.exists(), "the child never started writing"
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    leftovers = _leftovers(out)
    assert len(leftovers) == 1 and (out / leftovers[0] / TMP_MARKER).is_file()
    assert not (out / "cut").exists()
    pruned = np.zeros((2, 4), bool)
    pruned[0, 0] = True
    result = export_checkpoint("pruned", ckpt, pruned, out / "cut")
    assert any("killed" in note for note in result.notes) and not _leftovers(out)
    assert load_pruned(result.path) is not None


def test_formats_the_stream_cannot_write(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "llama")
    with pytest.raises(HeadscopeError, match="pruned and stock"):
        export_checkpoint("onnx", ckpt, np.zeros((2, 4), bool), tmp_path / "x")
    with pytest.raises(HeadscopeError, match="same head counts in every layer"):
        export_checkpoint("stock", ckpt, _masks("llama")["emptied-layer"], tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------------------------
# The CLI: export --checkpoint takes every mask option of the in-memory export
# ---------------------------------------------------------------------------------------------

def _cli(argv, capsys):
    from analysis import cli
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("options", [["--sparsity", "0.5", "--policy", "groups"],
                                     ["--sparsity", "0.25", "--scorer", "mp", "--z", "1.5", "--kv-policy", "expand"],
                                     ["--sparsity", "0.5", "--policy", "balanced-uniform", "--export-format", "stock"]])
def test_cli_streamed_equals_cli_in_memory(options, tmp_path, capsys):
    from tests._apptools import trivial_tokenizer
    _, ckpt = _checkpoint(tmp_path, "llama", shard="20KB")
    trivial_tokenizer().save_pretrained(ckpt)                   # --model needs one
    capsys.readouterr()
    common = ["export", "--quiet", "--out-dir", str(tmp_path / "out"), *options]
    code, out, err = _cli([*common, "--checkpoint", str(ckpt), "--name", "streamed"], capsys)
    assert code == 0, err
    assert json.loads(out)["streamed"] is True
    code, _, err = _cli([*common, "--model", str(ckpt), "--name", "memory"], capsys)
    assert code == 0, err
    _assert_same_tensors(tmp_path / "out" / "streamed", tmp_path / "out" / "memory")
    streamed, memory = tmp_path / "out" / "streamed", tmp_path / "out" / "memory"
    assert (json.loads((streamed / "mask.json").read_text())["kept"]
            == json.loads((memory / "mask.json").read_text())["kept"])
    assert {p.name for p in memory.glob("tokenizer*")} <= {p.name for p in streamed.iterdir()}


@pytest.mark.parametrize("fmt", ["pruned", "stock", "zeroed"])
def test_cli_bfloat16_checkpoint_exports_in_bfloat16_through_model_and_checkpoint(fmt, tmp_path, capsys):
    """Issue 35: `export --model` of a bfloat16 checkpoint (loaded in float32 on a CPU) wrote float32, twice
    the checkpoint; the export keeps the source dtype, so --model and --checkpoint write the same bytes."""
    from tests._apptools import trivial_tokenizer
    _, ckpt = _checkpoint(tmp_path, "llama", dtype=torch.bfloat16)
    trivial_tokenizer().save_pretrained(ckpt)
    capsys.readouterr()
    common = ["export", "--quiet", "--out-dir", str(tmp_path / "out"), "--sparsity", "0.5", "--policy",
              "balanced-uniform", "--export-format", fmt]
    sources = [("memory", ["--model", str(ckpt)])] + ([("streamed", ["--checkpoint", str(ckpt)])] if fmt != "zeroed" else [])
    for name, source in sources:
        code, _, err = _cli([*common, *source, "--name", name], capsys)
        assert code == 0, err
    memory = tmp_path / "out" / "memory"
    assert {t.dtype for t in _tensors(memory).values()} == {torch.bfloat16}
    if fmt != "zeroed":
        streamed = tmp_path / "out" / "streamed"
        _assert_same_tensors(memory, streamed)
        assert ({f.name: f.stat().st_size for f in memory.glob("*.safetensors")}
                == {f.name: f.stat().st_size for f in streamed.glob("*.safetensors")})
    code, _, err = _cli([*common, "--model", str(ckpt), "--name", "wide", "--export-dtype", "float32"], capsys)
    assert code == 0, err                                      # asked for: float32, twice the bytes
    assert {t.dtype for t in _tensors(tmp_path / "out" / "wide").values()} == {torch.float32}
    if fmt != "zeroed":                                        # the stream copies bytes: it cannot cast
        code, _, err = _cli([*common, "--checkpoint", str(ckpt), "--name", "x", "--export-dtype", "float16"], capsys)
        assert code == 2 and "--export-dtype float16" in err and "Traceback" not in err


@pytest.mark.parametrize("source", ["--checkpoint", "--model"])
def test_cli_mask_file(source, tmp_path, capsys):
    from tests._apptools import trivial_tokenizer
    model, ckpt = _checkpoint(tmp_path, "llama")
    trivial_tokenizer().save_pretrained(ckpt)                   # --model needs one
    pruned = _masks("llama")["uneven-groups"]
    export_pruned(model, pruned, tmp_path / "mem")
    capsys.readouterr()
    code, _, err = _cli(["export", "--quiet", source, str(ckpt), "--mask-file",
                         str(tmp_path / "mem" / "mask.json"), "--out-dir", str(tmp_path / "out"), "--name", "cut"],
                        capsys)
    assert code == 0, err
    assert "K/V are expanded" in err                      # growth is said, as for the in-memory export
    _assert_same_tensors(tmp_path / "out" / "cut", tmp_path / "mem")
    assert json.loads((tmp_path / "out" / "cut" / "mask.json").read_text())["kept"] == [
        [h for h in range(4) if not pruned[layer, h]] for layer in range(2)]


@pytest.mark.parametrize("extra,match", [(["--sparsity", "0.25", "--scorer", "wanda"], "needs the model"),
                                         (["--sparsity", "0.25", "--export-format", "onnx"], "pruned and stock"),
                                         ([], "needs --sparsity"),
                                         (["--sparsity", "0.25", "--policy", "uniform", "--kv-policy", "strict"], "strict"),
                                         (["--mask-file", "nowhere.json"], "(?i)cannot read the mask file")])
def test_cli_errors_are_one_line_and_write_nothing(extra, match, tmp_path, capsys):
    _, ckpt = _checkpoint(tmp_path, "llama")
    capsys.readouterr()
    code, out, err = _cli(["export", "--quiet", "--checkpoint", str(ckpt), "--out-dir", str(tmp_path / "out"),
                           "--name", "cut", *extra], capsys)
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(match, errors[0]), err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_cli_truncated_shard_exit_2(tmp_path, capsys):
    _, ckpt = _checkpoint(tmp_path, "llama", shard="20KB")
    victim = sorted(ckpt.glob("*.safetensors"))[-1]
    victim.write_bytes(victim.read_bytes()[:-8])
    capsys.readouterr()
    code, _, err = _cli(["export", "--quiet", "--checkpoint", str(ckpt), "--sparsity", "0.25", "--out-dir",
                         str(tmp_path / "out"), "--name", "cut"], capsys)
    assert code == 2 and "truncated" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# GGUF from the checkpoint (analysis.compress.export.gguf.writer fed tensor by tensor)
# ---------------------------------------------------------------------------------------------

def _gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    from gguf import GGUFReader
    return {t.name: np.array(t.data) for t in GGUFReader(str(path)).tensors}


def _gguf_counts(path: Path) -> dict:
    from gguf import GGUFReader
    fields = GGUFReader(str(path)).fields
    return {k: fields[k].contents() for k in fields if k.endswith(("head_count", "head_count_kv"))}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mask", ["uniform", "uneven-groups", "emptied-group"])
@pytest.mark.parametrize("tied", [False, True])
def test_streamed_gguf_equals_in_memory(family, mask, tied, tmp_path):
    pytest.importorskip("gguf")
    model, ckpt = _checkpoint(tmp_path, family, tie_word_embeddings=tied)
    pruned = _masks(family)[mask]
    export_to("gguf", model, pruned, tmp_path / "mem", gguf_type="f32")
    result = export_checkpoint("gguf", ckpt, pruned, tmp_path / "streamed", gguf_type="f32")
    mine, theirs = _gguf_tensors(result.path / "model.gguf"), _gguf_tensors(tmp_path / "mem" / "model.gguf")
    assert mine and sorted(mine) == sorted(theirs)
    for name in mine:
        assert mine[name].dtype == theirs[name].dtype and np.array_equal(mine[name], theirs[name]), name
    assert _gguf_counts(result.path / "model.gguf") == _gguf_counts(tmp_path / "mem" / "model.gguf")
    assert sorted(p.name for p in result.path.iterdir()) == sorted(p.name for p in (tmp_path / "mem").iterdir())


def test_cli_streamed_gguf(tmp_path, capsys):
    pytest.importorskip("gguf")
    model, ckpt = _checkpoint(tmp_path, "llama")
    capsys.readouterr()
    code, out, err = _cli(["export", "--quiet", "--checkpoint", str(ckpt), "--sparsity", "0.5", "--policy",
                           "min-per-layer", "--export-format", "gguf", "--gguf-type", "f32", "--out-dir", str(tmp_path / "out"), "--name", "cut"], capsys)
    assert code == 0, err
    pruned = np.ones((2, 4), bool)
    for layer, kept in enumerate(json.loads((tmp_path / "out" / "cut" / "mask.json").read_text())["kept"]):
        pruned[layer, kept] = False
    export_to("gguf", model, pruned, tmp_path / "mem", gguf_type="f32")
    mine, theirs = _gguf_tensors(tmp_path / "out" / "cut" / "model.gguf"), _gguf_tensors(tmp_path / "mem" / "model.gguf")
    assert sorted(mine) == sorted(theirs) and all(np.array_equal(mine[k], theirs[k]) for k in mine)


def test_cli_streamed_gguf_with_an_embedding_type_equals_in_memory(tmp_path, capsys):
    """--gguf-embedding-type reaches llama.cpp's quantizer on the streamed path too: the same tensors
    (types and bytes) as the in-memory export with the same options, token_embd in that type."""
    pytest.importorskip("gguf")
    model, ckpt = _checkpoint(tmp_path, "llama")
    capsys.readouterr()
    code, out, err = _cli(["export", "--quiet", "--checkpoint", str(ckpt), "--sparsity", "0.5", "--policy",
                           "min-per-layer", "--export-format", "gguf", "--gguf-type", "q4_k_m",
                           "--gguf-embedding-type", "q4_0", "--out-dir", str(tmp_path / "out"), "--name", "cut"],
                          capsys)
    assert code == 0, err
    pruned = np.ones((2, 4), bool)
    for layer, kept in enumerate(json.loads((tmp_path / "out" / "cut" / "mask.json").read_text())["kept"]):
        pruned[layer, kept] = False
    export_to("gguf", model, pruned, tmp_path / "mem", gguf_type="q4_k_m", gguf_embedding_type="q4_0")
    from gguf import GGUFReader
    mine = {t.name: (t.tensor_type.name, np.array(t.data)) for t in
            GGUFReader(str(tmp_path / "out" / "cut" / "model.gguf")).tensors}
    theirs = {t.name: (t.tensor_type.name, np.array(t.data)) for t in
              GGUFReader(str(tmp_path / "mem" / "model.gguf")).tensors}
    assert sorted(mine) == sorted(theirs) and mine["token_embd.weight"][0] == "Q4_0"
    assert all(mine[k][0] == theirs[k][0] and np.array_equal(mine[k][1], theirs[k][1]) for k in mine)


def test_streamed_gguf_refuses_what_the_writer_refuses(tmp_path):
    pytest.importorskip("gguf")
    _, ckpt = _checkpoint(tmp_path, "gpt2")
    with pytest.raises(HeadscopeError, match="GGUF export supports") as info:
        export_checkpoint("gguf", ckpt, _masks("gpt2")["uniform"], tmp_path / "out" / "cut")
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    with pytest.raises(HeadscopeError, match="gguf_type"):
        export_checkpoint("gguf", _checkpoint(tmp_path / "b", "llama")[1], _masks("llama")["uniform"],
                          tmp_path / "out" / "cut", gguf_type="q3_nonsense")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_gguf_q4_k_m_equals_in_memory_and_runs_in_llama_cpp(family, dtype, tmp_path):
    """llama.cpp's k-quants (Q4_K_M: Q4_K for most matrices, Q6_K for some, and a fallback type where
    a row is no multiple of the 256-value super-block) from the checkpoint, tensor by tensor: every
    tensor's type and quantized bytes equal the in-memory export's (the quantizer is deterministic
    and sees the same float32 values: a bf16 checkpoint's values upcast exactly), so llama.cpp's
    logits of the two files are equal, and finite."""
    pytest.importorskip("gguf")
    from gguf import GGUFReader
    from analysis.compress.export.gguf import llamacpp
    # rows of 256 (the k-quant super-block; the tiny default hidden 32 would fall back everywhere)
    model, ckpt = _checkpoint(tmp_path, family, dtype=dtype, hidden_size=256, intermediate_size=512)
    pruned = _masks(family)["uneven-groups"]                     # 4 heads / 2 KV heads, as the default
    export_to("gguf", model, pruned, tmp_path / "mem", gguf_type="q4_k_m")
    result = export_checkpoint("gguf", ckpt, pruned, tmp_path / "streamed", gguf_type="q4_k_m")
    mine = {t.name: t for t in GGUFReader(str(result.path / "model.gguf")).tensors}
    theirs = {t.name: t for t in GGUFReader(str(tmp_path / "mem" / "model.gguf")).tensors}
    assert mine and sorted(mine) == sorted(theirs)
    types = set()
    for name, tensor in mine.items():
        assert tensor.tensor_type == theirs[name].tensor_type, name
        assert np.array_equal(np.asarray(tensor.data), np.asarray(theirs[name].data)), name
        types.add(tensor.tensor_type.name)
    assert "Q4_K" in types, types                    # k-quants were written, not only fallbacks
    assert _gguf_counts(result.path / "model.gguf") == _gguf_counts(tmp_path / "mem" / "model.gguf")
    ids = tiny_input_ids(batch=1, seq=16)[0].tolist()
    streamed = llamacpp.logits(result.path / "model.gguf", ids)
    assert streamed.shape == (16, model.config.vocab_size) and np.isfinite(streamed).all()
    assert np.array_equal(streamed, llamacpp.logits(tmp_path / "mem" / "model.gguf", ids))
