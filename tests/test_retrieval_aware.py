"""The retrieval-aware KV-head score (analysis/measure/retrieval_aware.py) and plans made from it (issue 45).

- Exactness: the score of every KV head equals the answer log-probability change measured by hand (that KV
  head alone windowed through analysis.arch.spans.windowed, one whole forward, float64 tiny models), for the
  prefix-reuse path at several batch sizes and the naive path alike (EXACT).
- A planted circuit: a one-layer Llama whose KV head 0 copies the needle into the answer and whose KV head 1
  reads one far token into a direction the LM head ignores (its windowed output has the same norm, flipped).
  The streaming score (output change) ranks the distractor first; the retrieval-aware score ranks the copy
  head first, above ln 2 (windowing it loses the answer), and the distractor at ~0. A head mask that prunes
  the copy head leaves its KV head nothing to lose.
- Rows: only needles the window hides from every answer row are kept (Window.reads); none left is one line.
- Plans from the streaming and the retrieval-aware scores at the same shares hold the same KV bytes, in the
  plan's count and in the compact cache a Cut of each plan fills (they differ in which heads are windowed).
- The CLI: `kv-plan --window-score retrieval-aware` writes a plan whose windowed heads are the lowest on that
  score and whose notes name it; a bad choice is one line; `roles --detector retrieval-aware` runs it.
- Stop lands between replayed layers and leaves the model's attention as it was.
"""
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from analysis import cli
from analysis.arch.attention import current_implementation
from analysis.arch.geometry import HeadGeometry
from analysis.arch.kvplan import read_kv_plan
from analysis.arch.spans import windowed
from analysis.arch.window import Window
from analysis.core.errors import CancelledError, InputError
from analysis.measure.detector_registry import DETECTORS, default_detectors
from analysis.measure.long_options import RETRIEVAL_AWARE_THRESHOLD, WINDOW_SCORES
from analysis.measure.longheads import NeedleItem, needle_items, streaming_scores
from analysis.measure.retrieval_aware import RetrievalAwareDetector, hidden_needles, layer_passes, windowed_answers
from analysis.measure.splits import SCORE_SPLIT
from analysis.score.kvscores import KVScores, plan_from_scores
from tests._apptools import long_tiny, trivial_tokenizer  # noqa: F401 - long_tiny: a fixture
from tests._input_checks import run_captured
from tests._tiny import tiny_model
from tests._tolerance import EXACT

WINDOW = Window(2, 8)


def _random_item(needle_at: int, seed: int, T: int = 60, answer: int = 5) -> NeedleItem:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 128, (T,), generator=g)                      # [T]
    return NeedleItem(ids, needle_at, needle_at + 6, T - answer, T, needle_at / T, "random")


def _answer_logprobs(logits: torch.Tensor, items) -> np.ndarray:
    """[n] summed log-probability of each item's answer tokens from full logits [n, T, V]."""
    out = []
    for i, it in enumerate(items):
        lp = torch.log_softmax(logits[i, it.rows].double(), -1)           # [k, V]
        out.append(float(lp.gather(-1, it.targets[:, None]).sum()))
    return np.array(out)


def _by_hand(model, items, window) -> np.ndarray:
    """[L, Hkv] mean over items of dense - windowed answer log-probability, one whole forward per KV head."""
    x = torch.stack([it.ids for it in items])                            # [n, T]
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    out = np.zeros((L, Hkv))
    with torch.no_grad():
        dense = _answer_logprobs(model(x).logits, items)
        for layer in range(L):
            for head in range(Hkv):
                rows = np.zeros((L, Hkv), dtype=bool)
                rows[layer, head] = True
                with windowed(model, rows, window):
                    out[layer, head] = (dense - _answer_logprobs(model(x).logits, items)).mean()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_score_is_the_answer_log_probability_lost_by_hand(family):
    model = tiny_model(family, dtype=torch.float64)
    items = [_random_item(at, seed) for seed, at in enumerate((4, 12, 20))]
    want = _by_hand(model, items, WINDOW)
    assert (np.abs(want) > 1e-6).all()                                   # every KV head changes the answers here
    for batch_size in (1, 8):
        fast = windowed_answers(model, items, window=WINDOW, batch_size=batch_size)
        assert fast.method == "fast"
        np.testing.assert_allclose(fast.scores, want, rtol=0, atol=EXACT)
    naive = windowed_answers(model, items, window=WINDOW, method="naive")
    np.testing.assert_allclose(naive.scores, want, rtol=0, atol=EXACT)
    L, Hkv = want.shape
    assert fast.delta.shape == (L, Hkv, 3) and fast.layer_passes == layer_passes(model_geometry(model), 3, "fast")
    assert fast.layer_passes == 3 * (L + Hkv * L * (L + 1) // 2) < naive.layer_passes == 3 * L * (1 + L * Hkv)


def model_geometry(model):
    from analysis.arch.adapters import adapter_for
    return adapter_for(model).geometry(model)


# -- a planted circuit ---------------------------------------------------------------------------------------

VOCAB, HIDDEN, D = 128, 160, 16
NEEDLE = [100, 101, 110, 111, 112, 113, 114, 102]      # lead, five content tokens, end
QUESTION = [103, 104]
FAR = 99                                               # the token the distractor head reads from far back
COPY_DIMS, LOUD_DIM = 130, 140                         # residual dims: the copied token; the distractor's output
PLANT_WINDOW = Window(2, 16)


def _planted():
    """KV head 0 (query head 0): at the row holding prev_t it attends to the key holding the needle's next token
    and writes that token into residual dim COPY_DIMS + t, which the LM head reads as that token's logit. KV head 1
    (query head 2): every row attends to the FAR token (value +1, every other token -1) and writes into LOUD_DIM,
    which the LM head ignores; windowed, it writes -1 instead of +1: the same norm, so the final norm and the
    logits do not move."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=D, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e32}, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").double().eval()
    attn = m.model.layers[0].self_attn
    prev, nxt = [QUESTION[-1]] + NEEDLE[2:6], NEEDLE[2:7]
    with torch.no_grad():
        e = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
        e[:, 0] = 1.0
        e[torch.arange(VOCAB), 1 + torch.arange(VOCAB)] = 1.0
        m.model.embed_tokens.weight.copy_(e)
        m.model.layers[0].input_layernorm.weight.fill_(1.0)
        m.model.norm.weight.fill_(1.0)
        m.model.layers[0].mlp.down_proj.weight.zero_()
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, m.lm_head):
            proj.weight.zero_()
        for t, (a, b) in enumerate(zip(prev, nxt)):
            attn.q_proj.weight[0 * D + 1 + t, 1 + a] = 3.0
            attn.k_proj.weight[0 * D + 1 + t, 1 + b] = 3.0
            attn.v_proj.weight[0 * D + 1 + t, 1 + b] = 1.0
            attn.o_proj.weight[COPY_DIMS + t, 0 * D + 1 + t] = 1.0
            m.lm_head.weight[b, COPY_DIMS + t] = 1.0
        attn.q_proj.weight[2 * D + 6, 0] = 3.0                   # every row asks for FAR
        attn.k_proj.weight[1 * D + 6, 1 + FAR] = 3.0
        attn.v_proj.weight[1 * D + 0, 0] = -1.0                  # every token's value -1 ...
        attn.v_proj.weight[1 * D + 0, 1 + FAR] = 2.0             # ... FAR's +1
        attn.o_proj.weight[LOUD_DIM, 2 * D + 0] = 1.0
    return m


def _planted_item(needle_at: int, seed: int, T: int = 96) -> NeedleItem:
    g = torch.Generator().manual_seed(seed)
    answer = NEEDLE[2:7]
    text = torch.randint(4, FAR, (T - len(NEEDLE) - len(QUESTION) - len(answer),), generator=g)   # never FAR
    text[4] = FAR
    ids = torch.cat([text[:needle_at], torch.tensor(NEEDLE), text[needle_at:], torch.tensor(QUESTION + answer)])
    return NeedleItem(ids, needle_at, needle_at + len(NEEDLE), T - len(answer), T, needle_at / T, "planted")


def test_a_planted_copy_head_ranks_first_where_the_streaming_score_ranks_a_distractor_first():
    m = _planted()
    items = [_planted_item(at, seed) for seed, at in enumerate((10, 30, 50))]
    assert hidden_needles(items, PLANT_WINDOW) == items
    res = windowed_answers(m, items, window=PLANT_WINDOW)
    copy, loud = res.scores[0]
    assert int(res.scores.argmax()) == 0
    assert copy > RETRIEVAL_AWARE_THRESHOLD and abs(loud) < 1e-9
    assert (res.accuracy == 1.0).all()                                   # the dense model writes every answer token
    np.testing.assert_allclose(res.scores, _by_hand(m, items, PLANT_WINDOW), rtol=0, atol=EXACT)
    streaming, _ = streaming_scores(m, [it.ids for it in items], window=PLANT_WINDOW)
    assert streaming[0, 1] > streaming[0, 0]                             # the output change ranks the distractor first
    gates = torch.ones(1, 4)
    gates[0, 0] = 0.0                                                    # the copy head pruned: nothing left to lose
    assert abs(windowed_answers(m, items, window=PLANT_WINDOW, gates=gates).scores[0, 0]) < 1e-9


def test_a_stop_lands_between_replayed_layers_and_leaves_the_model_as_it_was():
    m = tiny_model("llama", dtype=torch.float64)
    items = [_random_item(4, 0)]
    before = current_implementation(m)
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) > 3
    with pytest.raises(CancelledError):
        windowed_answers(m, items, window=WINDOW, should_stop=should_stop)
    assert current_implementation(m) == before
    np.testing.assert_allclose(windowed_answers(m, items, window=WINDOW).scores, _by_hand(m, items, WINDOW),
                               rtol=0, atol=EXACT)


# -- rows, the detector, its record -----------------------------------------------------------------------

def test_both_kv_head_scores_refuse_a_physically_pruned_model_in_one_line():
    """The streaming and the retrieval-aware scores read every KV head of the whole model (longheads.whole_model):
    a physically pruned twin is one line, and a detector given an export's head layout one line naming the score."""
    from analysis.compress.surgery import prune_heads
    from analysis.measure.longheads import StreamingDetector
    model = tiny_model("llama", max_position_embeddings=512)
    geo = model_geometry(model)
    pruned = np.zeros((geo.n_layers, geo.n_heads), dtype=bool)
    pruned[0, 0] = True
    small, layout = prune_heads(model, pruned)
    item = _random_item(4, 0)
    calls = {"The streaming score": lambda: streaming_scores(small, [item.ids], window=WINDOW),
             "The retrieval-aware score": lambda: windowed_answers(small, [item], window=WINDOW)}
    for call in calls.values():                          # headmaps.head_slots' line: no layout for a pruned model
        with pytest.raises(InputError, match=r"physically pruned") as err:
            call()
        assert "\n" not in str(err.value)
    tok = trivial_tokenizer()
    detectors = {"The streaming score": StreamingDetector((256,), window=WINDOW, tokenizer=tok),
                 "The retrieval-aware score": RetrievalAwareDetector((256,), (0.5,), needles=1, window=WINDOW,
                                                                     tokenizer=tok)}
    for what, det in detectors.items():
        with pytest.raises(InputError, match=rf"^{what} is per KV head of the whole model; .*pruned export\.$"):
            det.detect(small, layout=layout)



def test_only_needles_the_window_hides_are_kept_and_none_is_one_line():
    items = [_random_item(at, 0) for at in (0, 4, 40, 49)]             # T 60: answer rows 54..58
    kept = hidden_needles(items, WINDOW)                                 # sinks 0, 1; recent: the 8 latest
    assert [it.needle_start for it in kept] == [4, 40]                   # 0: a sink; 49..54: inside the window
    tok = trivial_tokenizer()
    model = tiny_model("llama", max_position_embeddings=512)
    det = RetrievalAwareDetector((256,), (0.1, 0.5, 1.0), needles=1, window=Window(2, 100), tokenizer=tok)
    every = needle_items(tok, (256,), (0.1, 0.5, 1.0), needles=1, split=SCORE_SPLIT)
    items, left_out = det.built(model)
    assert [it.depth for it in items] == [it.depth for it in hidden_needles(every, Window(2, 100))]
    assert 0 < len(items) < len(every) and left_out == len(every) - len(items)
    geo = model_geometry(model)
    assert len(det.passes(model)) == len(items) * round(layer_passes(geo, 1, "fast") / geo.n_layers)
    with pytest.raises(InputError, match="still reads every needle"):
        RetrievalAwareDetector((256,), (0.5,), needles=1, window=Window(2, 250), tokenizer=tok).built(model)
    spec = DETECTORS["retrieval-aware"]
    assert spec.long and "retrieval-aware" not in default_detectors() and set(WINDOW_SCORES) <= set(DETECTORS)


# -- plans --------------------------------------------------------------------------------------------------

def test_plans_from_either_score_at_the_same_shares_hold_the_same_kv_bytes():
    from analysis.arch.cut import Cut
    from analysis.arch.kvcache import kv_cache_bytes
    model = tiny_model("llama", num_hidden_layers=4)                     # 4 layers x 2 KV heads
    geo = model_geometry(model)
    rng = np.random.default_rng(0)
    streaming = rng.random((4, 2))
    scores = KVScores(streaming, retrieval=np.zeros((4, 2))).with_window_score("retrieval-aware", -streaming)
    T = 40
    ids = torch.randint(4, 128, (1, T), generator=torch.Generator().manual_seed(0))
    for window_share in (0.25, 0.5, 0.75):
        plans = {name: plan_from_scores(geo, scores, window_share=window_share, window=WINDOW, window_score=name)
                 for name in WINDOW_SCORES}
        a, b = plans.values()
        assert (a.windowed != b.windowed).any()                          # the scores choose other heads ...
        assert a.counts() == b.counts()                                  # ... as many of them
        for name, plan in plans.items():
            assert plan.notes[0].startswith(f"windowed: the lowest {name} scores")
            cut = Cut.of_plan(plan)
            with torch.no_grad(), cut.running(model) as run:
                cache = cut.new_cache()
                run(input_ids=ids, past_key_values=cache, use_cache=True)
            assert kv_cache_bytes(cache) == plan.kv_bytes(T, head_dim=geo.head_dim, dtype_bytes=4)
        assert a.kv_bytes(T, head_dim=geo.head_dim) == b.kv_bytes(T, head_dim=geo.head_dim)
    with pytest.raises(InputError, match="Unknown window score"):
        plan_from_scores(geo, scores, window_score="nope")
    with pytest.raises(InputError, match="measure it"):
        plan_from_scores(geo, KVScores(streaming, retrieval=np.zeros((4, 2))), window_score="retrieval-aware")


# -- the CLI --------------------------------------------------------------------------------------------------

def test_kv_plan_windows_the_lowest_retrieval_aware_heads_and_says_so(long_tiny, tmp_path, capsys):
    out = tmp_path / "kv_plan.json"
    code, stdout, err = run_captured(capsys, "kv-plan", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--window-score", "retrieval-aware", "--lengths", "256", "--needles", "1", "--depths",
                             "0.1,0.5", "--sinks", "2", "--recent", "16", "--no-keep-retrieval",
                             "--window-share", "0.5", "--out", str(out))
    assert code == 0, err
    summary = json.loads(stdout)
    plan = read_kv_plan(out, geometry=HeadGeometry(4, 4, 2, 8, 32))
    aware = np.array(summary["scores"]["retrieval-aware"])               # [L, Hkv]
    assert summary["plan"]["window_score"] == "retrieval-aware" and "streaming" not in summary["scores"]
    assert plan.counts()["window"] == 4 and aware[plan.windowed].max() <= aware[~plan.windowed].min()
    assert plan.notes[0].startswith("windowed: the lowest retrieval-aware scores") and "256 tokens" in plan.notes[0]
    assert summary["scores"]["retrieval_aware_rows"]["n_items"] == 2
    with pytest.raises(SystemExit) as stop:                              # argparse's refusal: one line, exit 2
        cli.main(["kv-plan", "--model", str(long_tiny), "--window-score", "nope", "--out", str(tmp_path / "other.json")])
    out = capsys.readouterr()
    assert stop.value.code == 2 and out.out == "" and out.err.count("\n") == 1 and "--window-score" in out.err
    assert not (tmp_path / "other.json").exists()


def test_roles_runs_the_retrieval_aware_detector(long_tiny, capsys):
    code, stdout, err = run_captured(capsys, "roles", "--model", str(long_tiny), "--device", "cpu", "--quiet",
                             "--detector", "retrieval-aware", "--lengths", "200", "--needles", "1", "--depths", "0.2",
                             "--sinks", "2", "--recent", "16")
    assert code == 0, err
    det = json.loads(stdout)["detectors"]["retrieval-aware"]
    kv = np.array(det["kv_scores"])                                      # [L, Hkv]
    assert kv.shape == (4, 2) and det["recent"] == 16 and det["n_items"] == 1 and det["lengths"] == [200]
    np.testing.assert_allclose(np.array(det["scores"]), np.repeat(kv, 2, axis=1))
