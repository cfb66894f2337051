"""The shared long-context scan (analysis.measure.longpass, analysis.score.longscan): one set of passes gives the
long-context probes' dense side, the retrieval score and the streaming score, each EXACTLY what its own separate
run gives on the same rows (float64, rows batched as the probes batch them); the needle span it reads is the
asked needle; forwards of other inputs inside the block are left alone; a stored scan is read back with the
same numbers, and another window, other items or another precision is another result; the probes' report
with the scan's dense side equals the report that measures its own; bfloat16 runs the passes in bfloat16
where asked and is refused where the CPU has no fast kernels."""
import numpy as np
import pytest
import torch

from analysis.arch.window import Window
from analysis.core.errors import InputError
from analysis.core.store import Store
from analysis.measure.longheads import NeedleItem, retrieval_scores, streaming_scores
from analysis.measure.longpass import long_scan, probe_rows, recording
from analysis.measure.probes.longcontext import build_long, measure_long
from analysis.score.longscan import dense_of, stored_scan
from tests._evalkit import tiny_loaded
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

WINDOW = Window(4, 32)
QUERIES = 16


@pytest.fixture(scope="module")
def tiny64(smollm2):
    """A tiny random Llama (2 layers, 4 heads, 2 KV heads) with SmolLM2's tokenizer and 1,024 positions, float64."""
    lm = tiny_loaded("llama", smollm2.tokenizer, "causal-lm", max_position_embeddings=1024)
    lm.model.double()
    return lm


@pytest.fixture(scope="module")
def built(tiny64):
    return build_long(["passkey", "needle", "long-copying"], tiny64.tokenizer, "causal-lm", [192, 256], n_items=2,
                      depths=(0.3, 0.8))


@pytest.fixture(scope="module")
def scan(tiny64, built):
    return long_scan(tiny64.model, built, tokenizer=tiny64.tokenizer, window=WINDOW, queries=QUERIES)


def _as_needle_items(listed) -> list[NeedleItem]:
    """Each scanned row as the retrieval detector's item: the row and its last answer token (the detector's rows
    end with the whole answer), the same needle; its answer steps are then the row's reads."""
    out = []
    for (_, length), _, r in listed:
        assert r.reads.tolist() == list(range(r.ids.numel() - r.targets.numel(), r.ids.numel()))
        ids = torch.cat([r.ids, r.targets[-1:]])
        out.append(NeedleItem(ids, r.needle[0], r.needle[1], ids.numel() - r.targets.numel(), length, 0.0, "row"))
    return out


# A digit-answer probe's rows are read as a prefill of the prompt and a cached pass over the answer (the probes'
# own passes, answer_values), the separate detectors read each row in one pass: the same function, whose q / k / v
# differ only by the rotary cos / sin, built from a float32 inv_freq (float64 models included: DESIGN.md 4), about
# float32's epsilon relative; a bound of 1e-6 relative leaves that a margin of 8x and catches any real difference.
ROTARY = 1e-6


def test_one_scan_equals_each_measure_run_alone(tiny64, built, scan):
    alone = measure_long(tiny64.model, built, tokenizer=tiny64.tokenizer)
    mine = scan.dense(built)
    assert list(mine) == list(alone)
    for key in alone:
        assert (alone[key].written is None) == (key[0] == "long-copying") and mine[key].written == alone[key].written
        assert np.array_equal(mine[key].generated, alone[key].generated) if alone[key].generated is not None else True
        for label, want in alone[key].depths.items():
            got = mine[key].depths[label]
            for field in ("accuracy", "accuracy_ci", "logit_diff", "logit_diff_ci"):
                assert np.array_equal(getattr(got, field), getattr(want, field)), (key, label, field)
            assert got.extras.keys() == want.extras.keys()
            assert all(np.array_equal(got.extras[k], want.extras[k]) for k in want.extras)
    listed = probe_rows(built, window=WINDOW, queries=QUERIES)
    scores, accuracy = retrieval_scores(tiny64.model, _as_needle_items(listed))
    det = scan.retrieval()
    assert np.array_equal(det.scores, scores)                           # top-1 keys: no tie within the rounding
    assert det.extras["answer_accuracy"] == float(accuracy.mean())
    kv, head = streaming_scores(tiny64.model, [r.ids for _, _, r in listed], window=WINDOW, queries=QUERIES)
    det = scan.streaming()
    np.testing.assert_allclose(det.extras["kv_scores"], kv, rtol=ROTARY, atol=0)
    np.testing.assert_allclose(det.extras["head_scores"], head, rtol=ROTARY, atol=0)
    copying = [i for i, (key, _, _) in enumerate(listed) if key[0] == "long-copying"]   # one pass a row: exact
    kv_copy, _ = streaming_scores(tiny64.model, [listed[i][2].ids for i in copying], window=WINDOW, queries=QUERIES)
    total = np.zeros_like(kv_copy)
    for i in copying:                                                   # streaming_scores' own sum, in its order
        total += scan.stream_kv[i]
    assert np.array_equal(kv_copy, total / len(copying))
    assert det.scores.shape == (2, 4) and np.array_equal(det.scores[:, ::2], det.extras["kv_scores"])
    assert float(kv.min()) > 0.0                          # a random model's heads read outside a 36-token window


def test_the_retrieval_needle_is_the_asked_needle(tiny64, built):
    tok = tiny64.tokenizer
    for (key, row, r) in probe_rows(built, window=WINDOW, queries=QUERIES):
        text = tok.decode(r.ids[r.needle[0]:r.needle[1]].tolist())
        answer = tok.decode(r.targets.tolist()).replace(" ", "")
        if key[0] == "passkey":
            assert text.startswith(" The pass key is") and text.count(answer) == 2
        elif key[0] == "needle":
            assert "special magic number" in text and answer in text.replace(" ", "")
            question = tok.decode(r.ids[r.needle[1]:].tolist())
            assert text.split(" for ")[1].split(" is")[0] in question          # the city asked for
        else:
            assert r.targets.tolist() == r.ids[r.needle[0] + 1:r.needle[1]].tolist()   # the first copy


def test_other_forwards_in_the_block_are_left_alone(tiny64, built):
    listed = probe_rows(built, window=WINDOW, queries=QUERIES)
    rows = [r for _, _, r in listed[:2]]
    model = tiny64.model
    other = torch.arange(40)[None] + 100
    with torch.no_grad():
        want = model(other).logits
        with recording(model, rows, window=WINDOW) as rec:
            got = model(other).logits
            out = model(rows[0].ids[None], use_cache=True)                     # a prefill, then a decode step
            model(rows[0].targets[:1][None], past_key_values=out.past_key_values)
    assert torch.equal(got, want)
    assert rec.copy[0] is not None and rec.stream_kv[0] is not None and rec.top1[0] is not None
    assert rec.copy[1] is None and rec.top1[1] is None


def test_a_stored_scan_reads_back_and_another_setting_is_another_result(tiny64, built, scan, tmp_path):
    store = Store(tmp_path)
    first, found = stored_scan(tiny64, built, window=WINDOW, queries=QUERIES, store=store)
    again, found_again = stored_scan(tiny64, built, window=WINDOW, queries=QUERIES, store=store)
    assert (found.status, found_again.status) == ("miss", "hit")
    for a, b in ((first, again), (first, scan)):
        assert np.array_equal(a.copy, b.copy) and np.array_equal(a.stream_kv, b.stream_kv)
        assert np.array_equal(a.retrieval().scores, b.retrieval().scores)
    d1, d2 = dense_of(first, built), dense_of(again, built)
    assert all(np.array_equal(d1[k].depths[lab].accuracy_ci, d2[k].depths[lab].accuracy_ci) for k in d1
               for lab in d1[k].depths)
    assert all(d1[k].written == d2[k].written for k in d1)
    small = {k: v for k, v in built.items() if k == ("passkey", 192)}
    assert stored_scan(tiny64, small, window=Window(4, 16), queries=QUERIES, store=store)[1].status == "miss"
    assert stored_scan(tiny64, small, window=Window(4, 16), queries=QUERIES, store=store)[1].status == "hit"
    other = build_long(["passkey"], tiny64.tokenizer, "causal-lm", [192], n_items=2, depths=(0.3, 0.8), seed=1)
    assert stored_scan(tiny64, other, window=Window(4, 16), queries=QUERIES, store=store)[1].status == "miss"
    assert stored_scan(tiny64, small, window=Window(4, 16), queries=8, store=store)[1].status == "miss"


def test_the_report_with_the_scans_dense_side_equals_its_own(tiny64, built, scan):
    from analysis.arch.cut import Cut
    from analysis.arch.kvplan import KVPlan
    from analysis.score.longcontext import long_context_report
    small = {k: v for k, v in built.items() if k[1] == 192}
    modes = np.zeros((2, 2), np.int8)
    modes[1, 0] = 1
    cut = Cut.of_plan(KVPlan(modes, Window(4, 32), 4, tiny64.name))
    own = long_context_report(tiny64, built=small, cut=cut)
    given = long_context_report(tiny64, built=small, cut=cut, dense=dense_of(scan, small))
    assert own.rows() == given.rows()
    assert given.work.rows == {192: sum(v[2].ids.shape[0] for v in small.values())}       # the cut's rows only


def test_bfloat16_runs_the_passes_in_bfloat16_where_asked(tiny64, built, monkeypatch):
    from analysis.core import placement
    small = {("passkey", 192): built[("passkey", 192)]}
    monkeypatch.setattr(placement, "fast_bfloat16", lambda device_type="cpu", flags=None: False)
    with pytest.raises(InputError, match="no fast bfloat16"):
        long_scan(tiny64.model.float(), small, window=WINDOW, queries=QUERIES, precision="bfloat16")
    with pytest.raises(InputError, match="float32, bfloat16"):
        long_scan(tiny64.model, small, window=WINDOW, queries=QUERIES, precision="float16")
    monkeypatch.setattr(placement, "fast_bfloat16", lambda device_type="cpu", flags=None: True)
    seen, attention = [], []
    real, real_sdpa = torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention

    def spy(x, w, b=None):
        out = real(x, w, b)
        seen.append(out.dtype)
        return out

    def spy_sdpa(q, *args, **kwargs):
        attention.append(q.dtype)
        return real_sdpa(q, *args, **kwargs)
    model = tiny64.model.float()
    try:
        monkeypatch.setattr(torch.nn.functional, "linear", spy)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
        model.config._attn_implementation = "sdpa"                   # the kernel the app's models run
        scan16 = long_scan(model, small, window=WINDOW, queries=QUERIES, precision="bfloat16")
        assert set(seen) == {torch.bfloat16} and scan16.precision == "bfloat16"
        assert set(attention) == {torch.float32} and model.config._attn_implementation == "sdpa"
        seen.clear()
        from analysis.arch.cut import Cut
        from analysis.arch.kvplan import KVPlan
        from analysis.measure.longpass import precision_block
        from analysis.score.longcontext import long_context_report
        modes = np.array([[0, 2], [1, 0]], np.int8)                  # a pruned and a windowed KV head
        cut = Cut.of_plan(KVPlan(modes, WINDOW, 4, tiny64.name))
        with precision_block(model, "bfloat16"):                      # the plan's side: the spans kernel's parts
            rep = long_context_report(tiny64, built=small, cut=cut)
        assert set(seen) == {torch.bfloat16} and len(rep.rows()) == 3
        seen.clear()
        long_scan(model, small, window=WINDOW, queries=QUERIES)
        assert set(seen) == {torch.float32}
    finally:
        tiny64.model.double()
        tiny64.model.config._attn_implementation = "eager"


def test_cpu_flags_decide_fast_bfloat16():
    from analysis.core.placement import cpu_flags, fast_bfloat16
    zen4 = cpu_flags("processor : 0\nflags : fpu avx2 avx512f avx512_bf16 sha_ni\n")
    assert fast_bfloat16("cpu", zen4) and fast_bfloat16("cpu", frozenset({"amx_bf16", "avx2"}))
    assert not fast_bfloat16("cpu", cpu_flags("flags : fpu avx2 avx512f avx512bw\n"))
    assert not fast_bfloat16("mps", zen4) and cpu_flags("no flags here") == frozenset()


def test_the_kv_groups_alone_equal_their_columns_of_the_whole_sweep():
    """The importance a plan prunes by sweeps the KV groups alone (a quarter of the work at G = 3): each group's
    loss change equals its column of the sweep of every head and group (float64; the rows of a layer are
    batched differently, so equal to the last few bits of float64, far below any difference between groups)."""
    from analysis.measure.ablation import FastAblation
    from tests._tiny import tiny_model
    model = tiny_model("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=48).double()
    x = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    whole = FastAblation().sweep(model, x)
    groups = FastAblation(heads=False).sweep(model, x)
    assert groups.head_delta.shape == (2, 0) and groups.group_delta.shape == (2, 2)
    assert np.abs(groups.group_delta - whole.group_delta).max() <= 1e-12 * max(1.0, np.abs(whole.group_delta).max())
    assert np.ptp(whole.group_delta) > 1e-6                              # the groups do differ
