"""Head detectors (induction, duplicate-token, previous-token, copying, DLA): planted circuits in a
hand-set 2-layer attention-only GPT-2 must be found exactly, DLA must equal a hand computation and
its parts must sum to the logit, masks and physically pruned models must line up, and bad input
must give one clear line."""
import json

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from analysis.arch.adapters import adapter_for
from analysis.core.errors import CancelledError, InputError
from analysis.measure.detectors import (DETECTORS, DuplicateTokenDetector, InductionDetector, default_detectors,
                                        detect_heads, duplicate_mass, get_detector, repeated_random_tokens)
from analysis.measure.dla import DirectLogitDetector, logit_parts
from analysis.measure.circuits import CopyingDetector, copying_score
from tests._tiny import tiny_input_ids, tiny_model

V, P, D, H = 16, 16, 128, 4     # vocab, positions, residual width, heads (head size 32)
POS, TOK, PREV = slice(0, 16), slice(16, 32), slice(32, 48)   # residual subspaces
N = 6                           # random tokens per copy; sequences are [BOS=0] r r (13 tokens)
PLANTED = {"previous-token": (0, 0), "duplicate-token": (0, 1), "induction": (1, 0), "copying": (1, 1),
           "successor": (1, 2)}
ORDINAL = list(range(1, 9))     # tokens 1..8 play "1, 2, ..., 8" for the successor detector


def planted_model(c: float = 1.5, seed: int = 0) -> GPT2LMHeadModel:
    """2-layer attention-only GPT-2 (MLPs zero, every bias zero, norms weight 1) with hand-set heads.

    Residual: position p is the one-hot e_p in POS, token t the one-hot in TOK (wte, tied to the
    unembedding); PREV starts empty. After ln_1 a hot entry is about 8 (2 or 3 hot dims of 128).
    Layer 0, head 0 previous-token: q_i = c e_i, k_j = c e_{j+1} (positions); its OV copies the
    token one-hot into PREV (scaled back to ~1).  Head 1 duplicate-token: q = k = c (token) on 16
    dims plus q_i = c e_i, k_j = -c e_j on 16 more (so a token matches itself less than an
    earlier copy); OV zero.
    Layer 1, head 0 induction: q_i = c (token_i), k_j = c (PREV_j), so it attends to where the
    previous token was the current one (K-composition with the previous-token head); OV small
    random.  Head 1 copying: q = k = 0 (uniform), OV = identity TOK -> TOK, so U W_O W_V E = I.
    Head 2 successor: OV maps token t to t + 1 (a shift: nilpotent, so its copying score is 0).
    Heads 2 (QK), 3 of both layers: small random weights (the 'others')."""
    cfg = GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=2, n_head=H, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    adapter = adapter_for(model)
    gen = torch.Generator().manual_seed(seed)
    small = lambda *shape: 0.02 * torch.randn(*shape, generator=gen)  # noqa: E731
    eye = torch.eye(16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        model.transformer.wte.weight[:, TOK] = torch.eye(V)
        model.transformer.wpe.weight[:, POS] = torch.eye(P)
        for layer in range(2):
            hw = adapter.read_heads(model, layer)                      # q, k, v: [H, 32, D]; o: [H, 32, D]
            for h in (2, 3):
                hw.q[h], hw.k[h], hw.v[h], hw.o[h] = (small(32, D) for _ in range(4))
            if layer == 0:
                shift = torch.zeros(16, 16)
                shift[torch.arange(1, 16), torch.arange(15)] = 1.0     # row a reads position a - 1
                hw.q[0, :16, POS], hw.k[0, :16, POS] = c * eye, c * shift
                hw.v[0, :16, TOK], hw.o[0, :16, PREV] = eye, eye / 8.0
                hw.q[1, :16, TOK], hw.k[1, :16, TOK] = c * eye, c * eye
                hw.q[1, 16:, POS], hw.k[1, 16:, POS] = c * eye, -c * eye
            else:
                hw.q[0, :16, TOK], hw.k[0, :16, PREV] = c * eye, c * eye
                hw.v[0], hw.o[0] = small(32, D), small(32, D)
                hw.v[1, :16, TOK], hw.o[1, :16, TOK] = eye, eye
                succ = torch.zeros(16, 16)
                succ[torch.arange(1, 16), torch.arange(15)] = 1.0          # token t -> t + 1
                hw.v[2], hw.o[2] = torch.zeros(32, D), torch.zeros(32, D)
                hw.v[2, :16, TOK], hw.o[2, :16, TOK] = eye, succ.T
            adapter.write_heads(model, layer, hw)
    return model


def _detect(model, name, ids=None, **kw):
    options = (dict(length=N, n_sequences=4, bos_id=0) if name in ("induction", "duplicate-token") else
               dict(categories=[ORDINAL]) if name == "successor" else {})
    return get_detector(name, **options).detect(model, ids, **kw)


def _random_text(n=3, T=16, seed=0):
    return torch.randint(1, V, (n, T), generator=torch.Generator().manual_seed(seed))


def test_every_planted_head_is_found_and_only_it():
    model = planted_model()
    for name, (layer, head) in PLANTED.items():
        det = _detect(model, name, _random_text())
        found = {(l, h) for l, h, _ in det.tagged()}
        assert found == {(layer, head)}, (name, det.scores.round(3))
        others = np.delete(det.scores.reshape(-1), layer * H + head)
        assert det.scores[layer, head] > 0.9 and others.max() < det.threshold, (name, det.scores.round(3))


def test_a_weaker_plant_scores_lower():
    strong = _detect(planted_model(1.5), "induction").scores[1, 0]
    weak = _detect(planted_model(0.3), "induction").scores[1, 0]
    assert weak < strong - 0.3


def test_pruning_the_previous_token_head_breaks_the_induction_head():
    """K-composition: the induction head finds its key through what the previous-token head wrote;
    with that head's gate at 0 it scores nothing itself and the induction head loses its signal."""
    model = planted_model()
    gates = torch.ones(2, H)
    gates[0, 0] = 0.0
    prev = _detect(model, "previous-token", _random_text(), gates=gates)
    ind = _detect(model, "induction", gates=gates)
    assert prev.scores[0, 0] == 0.0 and ind.scores[1, 0] < 0.2
    assert _detect(model, "copying", gates=gates).scores[0, 0] == 0.0
    # the mask lives only inside the call: the model is untouched
    assert _detect(model, "induction").scores[1, 0] > 0.9


def test_physically_pruned_model_lines_up_with_the_masked_one():
    from analysis.compress.surgery import prune_heads
    model = planted_model()
    pruned = np.zeros((2, H), dtype=bool)
    pruned[0, 3] = pruned[1, 2] = True
    small, layout = prune_heads(model, pruned)
    gates = torch.as_tensor(~pruned, dtype=torch.float32)
    ids = _random_text()
    for name in default_detectors():                    # the long-context ones: tests/test_longheads.py
        masked_det = _detect(model, name, ids, gates=gates)
        pruned_det = _detect(small, name, ids, layout=layout)
        np.testing.assert_allclose(pruned_det.scores, masked_det.scores, atol=1e-5, err_msg=name)
        assert pruned_det.scores[0, 3] == 0.0 and pruned_det.scores[1, 2] == 0.0
    with pytest.raises(InputError, match="head layout"):
        _detect(small, "copying")


def test_repeated_random_tokens_and_duplicate_mass_by_hand():
    ids = repeated_random_tokens(50, 3, 7, seed=1, bos_id=0, exclude=(1, 2))
    assert ids.shape == (3, 15) and (ids[:, 0] == 0).all()
    assert torch.equal(ids[:, 1:8], ids[:, 8:])
    for row in ids[:, 1:8]:
        assert len(set(row.tolist())) == 7 and not {0, 1, 2} & set(row.tolist())
    assert torch.equal(ids, repeated_random_tokens(50, 3, 7, seed=1, bos_id=0, exclude=(1, 2)))
    # hand-built pattern: tokens [5, 6, 5, 5]; head 0 puts 0.5 on each earlier 5, head 1 on the first key
    x = torch.tensor([[5, 6, 5, 5]])
    a = torch.zeros(1, 2, 4, 4)
    a[0, 0, 2, 0] = 1.0
    a[0, 0, 3, 0] = a[0, 0, 3, 2] = 0.5
    a[0, 0, 1, 1] = a[0, 0, 0, 0] = 1.0
    a[0, 1, :, 0] = 1.0
    # queries with an earlier copy: 2 (keys {0}) and 3 (keys {0, 2})
    np.testing.assert_allclose(duplicate_mass(a, x).numpy(), [1.0, 1.0])
    a[0, 1, 3, 0], a[0, 1, 3, 1] = 0.25, 0.75
    np.testing.assert_allclose(duplicate_mass(a, x).numpy(), [1.0, (1.0 + 0.25) / 2])
    with pytest.raises(InputError, match="usable tokens"):
        repeated_random_tokens(8, 1, 10)


def test_copying_score_by_hand():
    assert copying_score(torch.eye(4)) == pytest.approx(1.0)
    assert copying_score(-torch.eye(4)) == pytest.approx(-1.0)
    assert copying_score(torch.diag(torch.tensor([3.0, -1.0]))) == pytest.approx(0.5)
    rot = torch.tensor([[0.0, -1.0], [1.0, 0.0]])                      # eigenvalues +-i: no copying
    assert copying_score(rot) == pytest.approx(0.0, abs=1e-12)
    assert copying_score(torch.zeros(3, 3)) == 0.0


def test_copying_matches_the_full_vocabulary_circuit():
    """The d x d factor gives the eigenvalues of the V x V OV circuit (tiny Llama: GQA, untied)."""
    model = tiny_model("llama", seed=3).double()
    det = CopyingDetector().detect(model)
    adapter = adapter_for(model)
    E = model.get_input_embeddings().weight.detach()
    U = model.get_output_embeddings().weight.detach()
    gf = model.model.norm.weight.detach()
    for layer in range(2):
        hw = adapter.read_heads(model, layer)
        gl = model.model.layers[layer].input_layernorm.weight.detach()
        for h in range(4):
            full = U @ torch.diag(gf) @ hw.o[h].T @ hw.v[h // 2] @ torch.diag(gl) @ E.T   # [V, V]
            lam = torch.linalg.eigvals(full)
            keep = lam.abs() > 1e-9 * lam.abs().max()
            expected = float(lam.real[keep].sum() / lam.abs()[keep].sum())
            assert det.scores[layer, h] == pytest.approx(expected, abs=1e-8)


# ------------------------------------------------------------------------------------------------
# Direct logit attribution
# ------------------------------------------------------------------------------------------------


def test_dla_equals_a_hand_computation_on_one_layer_gpt2():
    """1-layer GPT-2 in float64: head h's output z_h W_O^h computed by hand from the attention
    probabilities and the raw Conv1D weights, through ln_f frozen, dotted with wte[next]."""
    model = tiny_model("gpt2", seed=4, n_layer=1, num_hidden_layers=1).double()
    x = tiny_input_ids(2, 9, seed=5)
    tr = model.transformer
    with torch.no_grad():
        out = model(input_ids=x, output_attentions=True)
        A = out.attentions[0]                                          # [n, H, T, T]
        resid0 = tr.wte(x) + tr.wpe(torch.arange(9))[None]             # [n, T, D]
        h1 = tr.h[0].ln_1(resid0)
        qkv = h1 @ tr.h[0].attn.c_attn.weight + tr.h[0].attn.c_attn.bias
        d = 32 // 4
        v = qkv[..., 64:96].reshape(2, 9, 4, d).transpose(1, 2)        # [n, H, T, d]
        z = A @ v                                                      # [n, H, T, d]
        W_O = tr.h[0].attn.c_proj.weight                               # [in = H*d, out = D]
        head_out = torch.stack([z[:, h] @ W_O[h * d:(h + 1) * d] for h in range(4)], 2)   # [n, T, H, D]
        mid = resid0 + head_out.sum(2) + tr.h[0].attn.c_proj.bias
        resid = mid + tr.h[0].mlp(tr.h[0].ln_2(mid))                   # [n, T, D] enters ln_f
        sigma = (resid.var(-1, unbiased=False, keepdim=True) + tr.ln_f.eps).sqrt()
        centered = head_out - head_out.mean(-1, keepdim=True)
        y = tr.ln_f.weight * centered / sigma[:, :, None]              # [n, T, H, D]
        U = model.lm_head.weight
        hand = torch.einsum("nthe,nte->nth", y[:, :-1], U[x[:, 1:]])   # [n, T-1, H]
    parts = logit_parts(model, x)
    np.testing.assert_allclose(parts.heads[:, :, 0, :], hand.numpy(), rtol=0, atol=1e-10)
    det = DirectLogitDetector().detect(model, x)
    np.testing.assert_allclose(det.scores[0], hand.numpy().mean((0, 1)), rtol=0, atol=1e-10)
    # GPT-2's LayerNorm runs in float64 here: the parts also sum to the model's own logit
    np.testing.assert_allclose(parts.total(), parts.model_logit, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "phi3"])
def test_dla_decomposition_closes_in_float64(family):
    model = tiny_model(family, seed=6).double()
    x = tiny_input_ids(2, 10, seed=7)
    parts = logit_parts(model, x)
    np.testing.assert_allclose(parts.total(), parts.logit, rtol=0, atol=1e-10)
    # the model's own norm may run in float32 (Llama's RMSNorm casts): agreement to float32 precision
    tol = 64 * np.finfo(np.float32).eps * max(1.0, float(np.abs(parts.logit).max()))
    np.testing.assert_allclose(parts.model_logit, parts.logit, rtol=0, atol=tol)
    assert np.abs(parts.heads).max() > 0 and np.abs(parts.mlp).max() > 0


def test_dla_under_a_mask_gives_nothing_to_pruned_heads_and_still_closes():
    model = tiny_model("llama", seed=8).double()
    x = tiny_input_ids(1, 10, seed=9)
    gates = torch.ones(2, 4)
    gates[1, 2] = 0.0
    parts = logit_parts(model, x, gates=gates)
    assert np.all(parts.heads[:, :, 1, 2] == 0.0) and np.abs(parts.heads[:, :, 1, 1]).max() > 0
    np.testing.assert_allclose(parts.total(), parts.logit, rtol=0, atol=1e-10)
    dense = logit_parts(model, x)
    assert not np.allclose(dense.logit, parts.logit)


def test_encoders_and_short_text_give_one_clear_line(minilm):
    with pytest.raises(InputError, match="unembedding"):
        DirectLogitDetector().detect(minilm.model, torch.tensor([[101, 2000, 102]]))
    with pytest.raises(InputError, match="unembedding"):
        CopyingDetector().detect(minilm.model)
    # attention-pattern detectors do run on an encoder
    det = get_detector("induction", minilm.tokenizer, length=10, n_sequences=2).detect(minilm.model)
    assert det.scores.shape == (6, 12) and np.isfinite(det.scores).all()
    with pytest.raises(InputError, match="two tokens"):
        DirectLogitDetector().detect(planted_model(), torch.tensor([[3]]))
    with pytest.raises(InputError, match="two tokens"):
        get_detector("previous-token").detect(planted_model(), torch.tensor([[3]]))
    with pytest.raises(CancelledError):
        InductionDetector(length=N, n_sequences=2).detect(planted_model(), should_stop=lambda: True)
    with pytest.raises(InputError, match="Unknown detector"):
        get_detector("nope")


def _cli(*args):
    """`headscope roles ARGS` in this process (cli.main, as tests/_bad_input.py's CLI cases run): its exit status,
    stdout and stderr, without a fresh interpreter importing torch and transformers for each call (about 10 s
    of the module's 90 s each, on 2 busy cores). The process entry itself is tests/test_cli*.py's."""
    import contextlib
    import io
    from types import SimpleNamespace

    from analysis import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["roles", *args])
        except SystemExit as stop:                   # argparse's refusals
            code = stop.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_cli_refuses_bad_input_with_one_line(tmp_path, builtin_cache_dir):
    short = tmp_path / "short.txt"
    short.write_text("Hi", encoding="utf-8")
    r = _cli("--model", "smollm2-135m", "--cache-dir", str(builtin_cache_dir), "--detector", "dla",
             "--text-file", str(short), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "token" in r.stderr
    r = _cli("--model", "minilm-l6", "--cache-dir", str(builtin_cache_dir), "--detector", "dla", "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unembedding" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_json_and_csv_on_a_tiny_folder(tmp_path):
    """`roles` on a saved model folder: JSON holds one [L, H] key per detector; CSV one row per head."""
    from tests._tiny import VOCAB
    folder = tmp_path / "tiny"
    planted_model().save_pretrained(folder)
    r = _cli("--model", str(folder), "--detector", "copying", "--detector", "induction", "--length", str(N),
             "--n-sequences", "2", "--quiet", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert np.array(data["detectors"]["copying"]["scores"]).shape == (2, H)
    assert np.array(data["detectors"]["induction"]["scores"])[1, 0] > 0.9
    r = _cli("--model", str(folder), "--detector", "copying", "--format", "csv", "--quiet", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split(",")[:3] == ["layer", "head", "copying"] and len(lines) == 1 + 2 * H
    del VOCAB


@pytest.mark.slow
def test_smollm2_has_induction_heads(smollm2):
    """The literature finds induction heads in every trained LM of this size (Olsson et al. 2022)."""
    res = detect_heads(smollm2, ["induction"], options=dict(length=30, n_sequences=4))["induction"]
    assert res.scores.shape == (30, 9) and res.scores.max() > 0.5
    assert res.extras["icl_score"] > 1.0          # the repeat is predicted far better than the first copy


def test_registry_lists_every_detector():
    assert set(DETECTORS) == {"previous-token", "induction", "duplicate-token", "copying", "successor", "dla",
                              "retrieval", "streaming", "retrieval-aware"}
    assert default_detectors() == ["previous-token", "induction", "duplicate-token", "copying", "successor", "dla"]
    assert {n for n, spec in DETECTORS.items() if spec.long} == {"retrieval", "streaming", "retrieval-aware"}
    assert isinstance(get_detector("duplicate-token", length=5), DuplicateTokenDetector)


def test_compensation_sees_a_kept_head_take_over_a_pruned_role(monkeypatch):
    """'Recovery' planted by hand: the previous-token head L0H0 is pruned and, in the recovered copy,
    kept head L0H2 is rewritten into a previous-token head: the table must show it."""
    import copy
    from types import SimpleNamespace

    from analysis.measure.compensation import compensation, compensation_markdown
    dense = planted_model()
    recovered = copy.deepcopy(dense)
    adapter = adapter_for(recovered)
    hw = adapter.read_heads(recovered, 0)
    hw.q[2], hw.k[2] = hw.q[0].clone(), hw.k[0].clone()
    adapter.write_heads(recovered, 0, hw)
    pruned = np.zeros((2, H), dtype=bool)
    pruned[0, 0] = True

    class Tok:                                                         # ids only: the text is given as ids
        bos_token_id, all_special_ids = 0, [0]

    loaded = SimpleNamespace(model=dense, tokenizer=Tok(), kind="causal-lm")
    ids = _random_text(2, 16).reshape(-1)                              # the "text", already tokenized (2 x 16)
    monkeypatch.setattr("analysis.measure.evaluation.token_ids", lambda tok, text, max_tokens=None: ids)
    rows = compensation(loaded, recovered, pruned, "unused", names=("previous-token", "dla"), max_tokens=16,
                        options=dict(length=N, n_sequences=2))
    prev = next(r for r in rows if r["role"] == "previous-token")
    assert (prev["kept_with_role_before"], prev["kept_with_role_after"]) == (0, 1)
    assert prev["largest_rises"][0].startswith("L0H2")
    dla = next(r for r in rows if r["role"] == "dla")
    assert {"pruned_heads_dla_dense", "kept_heads_dla_before", "kept_heads_dla_after"} <= set(dla)
    assert "Compensation after recovery" in compensation_markdown(rows)


def test_cli_on_a_pruned_export_puts_kept_heads_in_their_slots(tmp_path):
    from analysis.compress.export import export_to
    model = planted_model()
    pruned = np.zeros((2, H), dtype=bool)
    pruned[0, 2] = pruned[1, 3] = True
    export_to("pruned", model, pruned, tmp_path / "export")
    r = _cli("--model", str(tmp_path / "export"), "--detector", "copying", "--detector", "induction", "--length",
             str(N), "--n-sequences", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)["detectors"]
    gates = torch.as_tensor(~pruned, dtype=torch.float32)
    for name in ("copying", "induction"):
        shown = np.array(data[name]["scores"])
        expected = get_detector(name, length=N, n_sequences=2).detect(model, gates=gates).scores
        np.testing.assert_allclose(shown, expected, atol=1e-5, err_msg=name)
        assert shown[0, 2] == 0.0 and shown[1, 3] == 0.0
    # no tokenizer in this export: a text detector says so in one line
    r = _cli("--model", str(tmp_path / "export"), "--detector", "dla", "--quiet")
    assert r.returncode == 2 and "tokenizer" in r.stderr and len(r.stderr.strip().splitlines()) == 1
