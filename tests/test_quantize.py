"""INT8 (analysis/compress/recover/quantize.py): ONNX weight-only and dynamic INT8 files run in ONNX Runtime, the
ONNX perplexity path equals the PyTorch one, torch dynamic INT8 of the Linear layers; SmolLM2's
INT8 ONNX check against float32 (top-1, perplexity, file size; bench/bench_recovery.py measures it on
the pruned and distilled models too) and SmolLM2's self-checked "onnx-int8" export (its quality; the
self-check itself: tests/test_selfcheck.py), the two on one float32 trace of SmolLM2."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from analysis.core.errors import InputError
from analysis.measure.evaluation import evaluate
from analysis.compress.export import ExportError, export
from analysis.compress.export.onnx import OnnxLM
from analysis.compress.export.onnx_int8 import quantize_onnx
from analysis.compress.recover.quantize import compare_onnx, quantize_linear, state_bytes, top1_agreement
from tests._evalkit import tiny_loaded
from tests._tiny import tiny_input_ids, tiny_model
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

TEXT = ("The river flows north through the valley, past the old mill and the church, and then turns east "
        "towards the sea, where the fishing boats wait for the tide. ") * 6


@pytest.fixture(scope="module")
def onnx_pair(smollm2, tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    loaded = tiny_loaded("llama", smollm2.tokenizer, "causal-lm")
    pruned = np.zeros((2, 4), dtype=bool)
    pruned[0, 0] = pruned[1, 3] = True
    fp32 = export("onnx", loaded.model, pruned, root, "fp32")
    return loaded, pruned, fp32.path, root


@pytest.mark.parametrize("method", ["weight-only", "dynamic"])
def test_onnx_int8_runs_close_to_float32_and_is_smaller(onnx_pair, method):
    loaded, pruned, fp32, root = onnx_pair
    int8 = quantize_onnx(fp32, root / f"int8-{method}")
    assert sorted(p.name for p in int8.parent.iterdir()) == sorted(p.name for p in fp32.iterdir())  # sidecars too
    a, b = OnnxLM(fp32, loaded.model.config), OnnxLM(int8, loaded.model.config)
    ids = tiny_input_ids(2, 12)
    la, lb = a(input_ids=ids).logits, b(input_ids=ids).logits
    assert la.shape == lb.shape and not torch.equal(la, lb)       # really quantized
    assert float((la - lb).abs().max()) < 0.1 * float(la.abs().max()) + 0.05
    assert int8.stat().st_size < 0.6 * (fp32 / "model.onnx").stat().st_size
    assert top1_agreement(a, b, ids.reshape(-1)) > 0.5


def test_onnx_perplexity_path_equals_pytorch(onnx_pair):
    from analysis.compress.surgery import prune_heads
    loaded, pruned, fp32, _ = onnx_pair
    small, _ = prune_heads(loaded.model, pruned)
    torch_ppl = evaluate(replace(loaded, model=small), TEXT, max_tokens=96).value
    onnx_ppl = evaluate(replace(loaded, model=OnnxLM(fp32, loaded.model.config)), TEXT, max_tokens=96).value
    assert onnx_ppl == pytest.approx(torch_ppl, rel=1e-4)


def test_compare_onnx_reports_everything(onnx_pair):
    loaded, _, fp32, root = onnx_pair
    int8 = quantize_onnx(fp32, root / "cmp")
    c = compare_onnx(loaded, fp32, int8, TEXT, max_tokens=96, repeats=2).as_dict()
    assert 0 <= c["top1_agreement"] <= 1 and c["n_tokens"] == 96
    assert c["size_ratio"] == pytest.approx(c["bytes_int8"] / c["bytes_fp32"])
    assert c["latency_ms_fp32"] > 0 and c["latency_ms_int8"] > 0


def test_onnx_sessions_run_on_torchs_thread_count_unless_told(onnx_pair):
    """ONNX Runtime's own default is every physical core, whatever torch (or OMP_NUM_THREADS) is held to."""
    loaded, _, fp32, _ = onnx_pair
    threads = lambda lm: lm.session.get_session_options().intra_op_num_threads   # noqa: E731
    assert threads(OnnxLM(fp32, loaded.model.config)) == torch.get_num_threads() == 1    # one_torch_thread
    assert threads(OnnxLM(fp32, loaded.model.config, threads=3)) == 3


def test_onnx_bad_input(onnx_pair, tmp_path):
    _, _, fp32, root = onnx_pair
    with pytest.raises(InputError, match="not an ONNX file"):
        quantize_onnx(tmp_path, tmp_path / "x")
    with pytest.raises(InputError, match="Unknown ONNX quantization"):
        quantize_onnx(fp32, tmp_path / "y", method="int4")
    target = root / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists"):
        quantize_onnx(fp32, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]


def test_torch_dynamic_int8_of_linear_layers():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_linear(model)
    ids = tiny_input_ids(2, 10)
    with torch.no_grad():
        ref, out = model(input_ids=ids).logits, q(input_ids=ids).logits
    assert not torch.equal(ref, out) and float((ref - out).abs().max()) < 0.05
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())     # input unchanged
    assert not any(isinstance(m, torch.nn.Linear) and type(m) is torch.nn.Linear for m in q.modules()
                   if m is not q.lm_head)
    assert state_bytes(q) < state_bytes(model)


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2, tmp_path_factory):
    """SmolLM2's float32 ONNX export folder (nothing pruned), traced once for the module's two SmolLM2 INT8
    tests (a trace of the 135M model is ~13 s on a quiet core)."""
    root = tmp_path_factory.mktemp("smollm2-onnx")
    return export("onnx", smollm2.model, np.zeros((30, 9), dtype=bool), root, "fp32").path


@pytest.mark.slow
def test_smollm2_int8_onnx_agrees_with_float32(smollm2, smollm2_fp32, tmp_path):
    """The issue's INT8 acceptance on the real model (about 50 s here): top-1 agreement >= 95 %,
    perplexity within 5 %, file <= 0.35x float32. The comparison's latencies are not part of it (timed on
    8 tokens, not the default 128: 3 rounds of 4 runs of SmolLM2 were ~8 s of the test; the timing
    fields themselves are test_compare_onnx_reports_everything's)."""
    int8 = quantize_onnx(smollm2_fp32, tmp_path / "int8")
    c = compare_onnx(smollm2, smollm2_fp32, int8, max_tokens=512, latency_tokens=8, repeats=2)
    assert c.top1_agreement >= 0.95, c.as_dict()
    assert c.perplexity_ratio <= 1.05, c.as_dict()
    assert c.size_ratio <= 0.35, c.as_dict()


@pytest.mark.slow
def test_smollm2_int8_export_keeps_its_quality(smollm2, smollm2_fp32, tmp_path, monkeypatch):
    """The integer INT8 file of SmolLM2 (issue 23's perplexity target), self-checked on its own 512
    held-back tokens: within 5 % of float32 in perplexity and far above the old per-tensor variant's
    agreement (0.56; 0.17 with saturating kernels). The agreement target 0.95 is not reached by this
    route (docs/EXPORT.md): not asserted. The export's own float32 trace of the same (unpruned) model at
    the same opset is the module's `smollm2_fp32` file, copied in (one SmolLM2 trace for the two tests);
    the trace inside the "onnx-int8" export is tests/test_selfcheck.py's, on the tiny models."""
    import shutil
    import warnings
    from analysis.compress.export import onnx_int8
    from analysis.compress.export.onnx import ONNX_FILE
    copied = []

    def same_trace(model, path, *, opset=17):
        assert opset == 17 and model.config.num_hidden_layers == 30
        assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3   # nothing cut
        shutil.copyfile(smollm2_fp32 / ONNX_FILE, path)
        copied.append(path)

    monkeypatch.setattr(onnx_int8, "write_onnx", same_trace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = export("onnx-int8", smollm2.model, np.zeros((30, 9), bool), tmp_path, "int8",
                        tokenizer=smollm2.tokenizer)
    assert len(copied) == 1
    check = result.checks[-1]
    assert check["artifact"] == "INT8 ONNX (dynamic)" and check["text"] == "held-back tokens", check
    keep = check["details"]["keep_float"]                 # the outlier layers (MLP down projections) and the head
    assert "lm_head" in keep and any("down_proj" in name for name in keep), keep
    assert check["agreement"] > 0.8, check
    assert check["perplexity_ratio"] <= 1.05, check


# -- integer INT8 (issue 23) ----------------------------------------------------------------------

def _markov_ids(n: int, seq: int, seed: int) -> torch.Tensor:
    """ids [n, seq] of a learnable chain: next = (5 * token + 3) mod VOCAB with probability 0.9,
    else uniform: a trained model predicts it with a wide logit margin, so top-1 agreement measures
    the quantization error, not ties between near-uniform logits (a random-weight model's case)."""
    from tests._tiny import VOCAB
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(4, VOCAB, (n,), generator=g)
    for t in range(1, seq):
        jump = torch.rand(n, generator=g) < 0.1
        ids[:, t] = torch.where(jump, torch.randint(4, VOCAB, (n,), generator=g), (5 * ids[:, t - 1] + 3) % VOCAB)
    return ids


@pytest.fixture(scope="module")
def trained_tiny():
    """A tiny llama trained 150 steps on the chain (a few seconds): top-1 accuracy ~0.9 on fresh text."""
    model = tiny_model("llama")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _markov_ids(256, 32, seed=0)                                   # [256, 32]
    for step in range(150):
        x = data[(step * 16) % 256:(step * 16) % 256 + 16]                 # [16, 32]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def test_integer_int8_of_a_trained_tiny_model_agrees_on_top1(trained_tiny, tmp_path):
    from analysis.measure.outliers import int8_keep_float
    held = _markov_ids(8, 32, seed=1)                                     # [8, 32] unseen sequences
    with torch.no_grad():
        accuracy = float((trained_tiny(input_ids=held).logits[:, :-1].argmax(-1) == held[:, 1:]).float().mean())
    assert accuracy > 0.7                                                 # trained: the agreement is meaningful
    keep = int8_keep_float(trained_tiny, _markov_ids(2, 32, seed=2))
    assert "lm_head" in keep
    fp32 = export("onnx", trained_tiny, np.zeros((2, 4), dtype=bool), tmp_path, "fp32")
    int8 = quantize_onnx(fp32.path, tmp_path / "int8", method="dynamic", keep_float=keep)
    import onnx
    ops = {n.op_type for n in onnx.load(str(int8)).graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= ops               # integer kernels, not dequantized weights
    a, b = OnnxLM(fp32.path, trained_tiny.config), OnnxLM(int8, trained_tiny.config)
    assert top1_agreement(a, b, held.reshape(-1), window=32) >= 0.95
    q = quantize_linear(trained_tiny, keep)
    assert top1_agreement(trained_tiny, q, held.reshape(-1), window=32) >= 0.95
    assert type(q.lm_head) is torch.nn.Linear                            # kept float
    assert type(q.model.layers[0].self_attn.q_proj) is not torch.nn.Linear


def test_sensitive_linears_find_an_injected_outlier():
    """A massive activation as in SmolLM2: one token drives one MLP channel of layer 1 to ~1e5, so
    down_proj's input has one huge value; its 8-bit step then exceeds OUTLIER_STEP x its RMS (for one
    outlier among n values the ratio is about sqrt(n) / 255: 4 x 64 tokens x 64 channels -> ~0.5)."""
    from analysis.measure.outliers import OUTLIER_STEP, activation_steps, sensitive_linears
    model = tiny_model("llama")
    ids = tiny_input_ids(4, 64, seed=5)
    ids[ids == 7] = 8
    ids[0, 10] = 7                                                        # token 7 once in the batch
    clean = activation_steps(model, ids)["model.layers.1.mlp.down_proj"]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.0
        model.model.embed_tokens.weight[7] = 0.0
        model.model.embed_tokens.weight[7, 0] = 1.0                     # token 7 = channel 0 only
        mlp = model.model.layers[1].mlp
        for proj in (mlp.gate_proj, mlp.up_proj):
            proj.weight[7] = 0.0
            proj.weight[7, 0] = 50.0                                      # MLP channel 7 reads channel 0
    steps = activation_steps(model, ids)
    found = sensitive_linears(model, ids)
    assert clean < OUTLIER_STEP < steps["model.layers.1.mlp.down_proj"], (clean, steps)
    assert "model.layers.1.mlp.down_proj" in found and "model.layers.0.mlp.down_proj" not in found


def test_fake_int8_is_exact_on_its_own_grid_and_rounds_off_it():
    """outliers.fake_int8 (the rounding int8_output_errors simulates): values already on the 8-bit
    activation grid and weights that are integer multiples of their row's max / 127 come back
    unchanged (float64, EXACT); a value between two steps moves by at most half a step."""
    from analysis.measure.outliers import fake_int8
    from tests._tolerance import EXACT
    step, zero = 0.5, 100                                                   # grid: (q - zero) * step, q in 0..255
    x = (torch.tensor([0, 3, 100, 181, 255], dtype=torch.float64) - zero) * step          # [5]
    w = torch.tensor([[127.0, -5.0, 0.0], [2.0, -127.0, 64.0]], dtype=torch.float64) / 127 * 3  # [2, 3]
    xq, wq = fake_int8(x, w)
    assert float((xq - x).abs().max()) <= EXACT and float((wq - w).abs().max()) <= EXACT
    off = x.clone()
    off[1] += 0.2 * step
    xq, _ = fake_int8(off, w)
    assert float((xq - off).abs().max()) <= step / 2 and float((xq - off).abs().max()) > 0


def test_worst_linears_rank_an_injected_outlier_first():
    """int8_output_errors: one huge input value of one Linear makes the 8-bit step large for the
    whole tensor, so that layer's simulated INT8 output error is the largest (worst_linears 1)."""
    from analysis.measure.outliers import int8_output_errors, worst_linears
    model = tiny_model("llama")
    ids = tiny_input_ids(2, 32, seed=3)
    target = model.model.layers[1].mlp.down_proj

    def outlier(module, inputs):
        x = inputs[0].clone()                                              # [1, T, D_in]
        x[0, 5, 3] = 1e3 * float(x.pow(2).mean().sqrt())
        return (x,)

    clean = int8_output_errors(model, ids)
    names = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    assert set(clean) == names and all(0 < e < 1 for e in clean.values()), clean
    handle = target.register_forward_pre_hook(outlier)
    try:
        assert worst_linears(model, ids, 1) == ["model.layers.1.mlp.down_proj"]
        assert int8_output_errors(model, ids)["model.layers.1.mlp.down_proj"] > 2 * max(clean.values())
    finally:
        handle.remove()
