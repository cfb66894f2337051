"""Profiles page: the heatmaps show the row norms of the real weights; the histogram's lines sit at
mean and mean + z*std with the outliers counted right; moving z never recomputes the norms."""
import numpy as np
import pytest
from safetensors.torch import load_file

from tests._apptools import (figure_titled, fresh_caches, heatmap_z, new_app, no_exception,  # noqa: F401
                             tiny_dir)

pytestmark = pytest.mark.usefixtures("fresh_caches")
H, HKV, D_HEAD = 4, 2, 8


def _raw_row_norms(tiny_dir, layer: int, proj: str) -> np.ndarray:
    """Row norms straight from the checkpoint (O: its columns), shaped [units, d]."""
    w = load_file(tiny_dir / "model.safetensors")[f"model.layers.{layer}.self_attn.{proj}_proj.weight"].double()
    rows = w.t() if proj == "o" else w                                  # [units*d, D]
    return rows.norm(dim=1).numpy().reshape(-1, D_HEAD)                 # [units, d]


def test_heatmaps_show_mean_row_norm_per_head(tiny_dir):
    at = new_app(tiny_dir, page="profiles")
    no_exception(at)
    for proj, units in (("q", H), ("k", HKV), ("v", HKV), ("o", H)):
        shown = heatmap_z(figure_titled(at, f"{proj.upper()} (")).astype(float)   # [L, units]
        expected = np.stack([_raw_row_norms(tiny_dir, l, proj).mean(axis=1) for l in range(4)])
        assert shown.shape == (4, units)
        np.testing.assert_allclose(shown, expected, rtol=1e-5)


@pytest.mark.parametrize("z", [0.5, 1.0, 2.0])
def test_histogram_lines_and_outliers(tiny_dir, z):
    at = new_app(tiny_dir, page="profiles", z=z)
    at.slider(key="hs.w.profiles.layer").set_value(2).run()
    at.radio(key="hs.w.profiles.proj").set_value("v").run()
    no_exception(at)
    n = _raw_row_norms(tiny_dir, 2, "v").ravel()
    mean, tau = n.mean(), n.mean() + z * n.std()
    fig = figure_titled(at, "Layer 2, V")
    lines = sorted(shape["x0"] for shape in fig["layout"]["shapes"])
    np.testing.assert_allclose(lines, sorted([mean, tau]), rtol=1e-6)
    n_out = int((n > tau).sum())
    assert f"{n_out} of {n.size} rows above tau" in fig["layout"]["title"]["text"]
    markers = [t for t in fig["data"] if t["type"] == "scatter"][0]
    np.testing.assert_allclose(np.sort(np.asarray(markers["x"], dtype=float)), np.sort(n[n > tau]), rtol=1e-6)


def test_moving_z_never_recomputes_norms(tiny_dir, monkeypatch):
    from analysis.arch import adapters
    from analysis.measure import profiles
    calls = {"profile_model": 0, "read_heads": 0}
    real_profile, real_read = profiles.profile_model, adapters.Adapter.read_heads

    def counting_profile(*args, **kwargs):
        calls["profile_model"] += 1
        return real_profile(*args, **kwargs)

    def counting_read(self, *args, **kwargs):
        calls["read_heads"] += 1
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(profiles, "profile_model", counting_profile)
    monkeypatch.setattr(adapters.Adapter, "read_heads", counting_read)
    at = new_app(tiny_dir, page="profiles")
    first = dict(calls)
    assert first["profile_model"] == 1
    titles = []
    for z in (0.3, 1.1, 2.9):
        at.slider(key="hs.w.profiles.z").set_value(z).run()
        titles.append(figure_titled(at, "rows above tau")["layout"]["title"]["text"])
    no_exception(at)
    assert calls == first, "moving z re-read the weights"
    assert len(set(titles)) > 1, "moving z did not change the outlier count at all"
