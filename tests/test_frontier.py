"""The frontier's arithmetic (analysis/compress/recover/frontier.py): which points no other point beats in
size and perplexity, and the verdict in words, refused files included."""
import pytest

from analysis.compress.recover.frontier import FRONTIER_TYPES, ZOOM_RATIO, parse_types, pareto, plot_png, verdict
from analysis.core.errors import InputError

MIB = 2 ** 20


def _point(label, gguf_type, mib, ppl):
    return {"label": label, "type": gguf_type, "bytes": int(mib * MIB), "ppl": ppl, "lo": ppl * 0.95,
            "hi": ppl * 1.05, "tokens": 1000}


POINTS = {"dense f16": _point("dense", "f16", 258, 15.2), "dense q8_0": _point("dense", "q8_0", 138, 15.3),
          "dense q4_k_m": _point("dense", "q4_k_m", 101, 17.0),
          "cut q8_0": _point("cut", "q8_0", 131, 19.0),       # bigger than q4_k_m and worse: off
          "cut q4_k_m": _point("cut", "q4_k_m", 90, 21.0),    # the smallest file: on
          "cut q2": {"label": "cut", "type": "q2", "refused": "self-check FAILED: ..."}}


def test_pareto_keeps_what_nothing_beats_in_both():
    assert pareto(POINTS) == ["cut q4_k_m", "dense q4_k_m", "dense q8_0", "dense f16"]


def test_verdict_compares_with_the_best_dense_file_at_or_below_the_size():
    lines = verdict(POINTS)
    cut8 = next(line for line in lines if line.startswith("cut q8_0"))
    assert "not on the frontier" in cut8 and "q4_k_m (101.0 MiB, perplexity 17.00): the cut is +11.8%" in cut8
    cut4 = next(line for line in lines if line.startswith("cut q4_k_m"))
    assert "ON the frontier" in cut4 and "no dense file is this small" in cut4
    assert "against the smallest, q4_k_m (101.0 MiB, perplexity 17.00), the cut saves 10.9% of the file for +23.5%" in cut4
    assert lines[-1] == "cut q2: not written: self-check FAILED: ..."


def test_types_are_checked_before_any_work():
    assert parse_types("") == () and parse_types("default") == FRONTIER_TYPES
    assert parse_types("Q8_0, q4_k_m") == ("q8_0", "q4_k_m")
    with pytest.raises(InputError, match="Unknown GGUF type 'int3'"):
        parse_types("q8_0,int3")
    with pytest.raises(InputError, match="twice"):
        parse_types("q8_0,q8_0")


def _closed_figures(monkeypatch) -> list:
    """The figures plot_png closes, kept open to be read (appended as plot_png closes them)."""
    from matplotlib import pyplot as plt
    seen = []
    monkeypatch.setattr(plt, "close", lambda fig: seen.append(fig))
    return seen


def test_a_damaged_cut_gets_a_second_panel_near_the_frontier(monkeypatch, tmp_path):
    """A cut at 10x dense perplexity squeezes every other point into one line on the full log axis: the
    figure adds a linear panel up to ZOOM_RATIO x the best dense file, names what lies above it, and
    draws each series in the same colour in both panels."""
    from matplotlib.colors import to_hex
    damaged = {**POINTS, "wreck q8_0": _point("wreck", "q8_0", 120, 220.0)}
    seen = _closed_figures(monkeypatch)
    plot_png(damaged, tmp_path / "f.png", "t")
    (fig,) = seen
    left, right = fig.axes
    top = ZOOM_RATIO * 15.2
    assert right.get_ylim() == pytest.approx((0.97 * 0.95 * 15.2, top))
    assert "above it: wreck" in right.get_title()
    colour = {ax: {c.get_label(): to_hex(c.lines[0].get_color()) for c in ax.containers} for ax in (left, right)}
    assert set(colour[right]) == {"dense", "cut"} and set(colour[left]) == {"dense", "cut", "wreck"}
    assert all(colour[right][label] == colour[left][label] for label in colour[right])
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_panel_when_every_point_is_near_dense(monkeypatch, tmp_path):
    seen = _closed_figures(monkeypatch)
    plot_png(POINTS, tmp_path / "f.png", "t")
    (fig,) = seen
    assert len(fig.axes) == 1 and fig.axes[0].get_yscale() == "log"


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _snap(model, levels: int) -> None:
    """Every linear weight (the head apart) put on a per-32-block grid of `levels` values from its min to
    its max: what dequantizing a Q4_1 (levels=16) file gives."""
    import torch
    head = model.get_output_embeddings()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m is not head:
                b = m.weight.reshape(-1, 32)                                            # [n, 32]
                lo, hi = b.min(1, keepdim=True).values, b.max(1, keepdim=True).values
                d = (hi - lo) / (levels - 1)                                            # [n, 1]
                m.weight.copy_((lo + torch.round((b - lo) / d) * d).reshape(m.weight.shape))


def test_prior_lattice_finds_weights_that_were_quantized_at_4_bits():
    from analysis.compress.recover.frontier import LATTICE_SHARE, prior_lattice
    model = _tiny_llama()
    fresh = prior_lattice(model)
    assert fresh["blocks"] > 0 and fresh["share"] < 0.01 and fresh["distinct"] > 30     # float weights: ~32 per block
    _snap(model, 256)                                                                    # 8-bit: not a 4-bit lattice
    assert prior_lattice(model)["share"] < LATTICE_SHARE
    _snap(model, 16)
    snapped = prior_lattice(model)
    assert snapped["share"] == 1.0 and snapped["distinct"] <= 16 and snapped["blocks"] == fresh["blocks"]


def test_the_verdict_says_when_the_dense_model_was_quantized_before():
    from analysis.compress.recover.frontier import lattice_line
    on = {k: {**p, "lattice": {"share": 1.0, "distinct": 13.1, "blocks": 10}} if p.get("label") == "dense" else p
          for k, p in POINTS.items()}
    off = {k: {**p, "lattice": {"share": 0.0, "distinct": 31.9, "blocks": 10}} if p.get("label") == "dense" else p
           for k, p in POINTS.items()}
    assert lattice_line(POINTS) is None and lattice_line(off) is None
    assert verdict(off) == verdict(POINTS)
    assert verdict(on)[:-1] == verdict(POINTS)
    assert verdict(on)[-1].startswith("The dense model was quantized before: 100.0% of the 32-value blocks")
