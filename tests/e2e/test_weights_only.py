"""Weights only in a real headless Chromium (issue 22): a checkpoint folder is opened weights only on
the Model page, z and the sparsity are moved with the keyboard on the Prune page (the counts follow),
and the Export page writes the streamed export, whose mask is the one shown."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.e2e.conftest import ARTIFACTS, LOAD_TIMEOUT_MS, needs_chromium
from tests.e2e.test_journeys import _no_error_on_page, _settled

pytestmark = [pytest.mark.e2e, pytest.mark.slow, needs_chromium()]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny bfloat16 Llama checkpoint (4 layers x 4 heads, 2 KV heads), sharded, without a tokenizer."""
    from tests._tiny import tiny_model
    folder = tmp_path_factory.mktemp("weights-only") / "ckpt"
    tiny_model("llama", num_hidden_layers=4).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    return folder


def _metric(page, label: str) -> str:
    return page.get_by_test_id("stMetric").filter(has_text=label).first.get_by_test_id("stMetricValue").inner_text()


def _press(page, label: str, key: str, times: int) -> None:
    slider = page.get_by_test_id("stSlider").filter(has_text=label).first.get_by_role("slider")
    slider.focus()
    for _ in range(times):
        slider.press(key)
    _settled(page)


def test_weights_only_prune_and_export(server, page, checkpoint, export_root):
    from playwright.sync_api import expect
    ARTIFACTS.mkdir(exist_ok=True)
    page.goto(f"{server}/?model={checkpoint}&scorer=mp-g&z=2&sparsity=0.25")
    expect(page.get_by_role("heading", name="Model", level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    page.get_by_test_id("stCheckbox").filter(has_text="Weights only").click()     # st.toggle
    expect(page.get_by_text("Open weights only")).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    _no_error_on_page(page, "model (weights only)")

    nav = page.get_by_test_id("stSidebarNav")
    nav.get_by_role("link", name="Prune", exact=True).click()
    expect(page.get_by_role("heading", name="Prune", level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    counted = "Query heads after / before"                     # counted from the layout surgery builds
    expect(page.get_by_test_id("stMetric").filter(has_text=counted).first).to_be_visible(timeout=60_000)
    assert _metric(page, counted) == "12 / 16"
    _press(page, "Sparsity", "ArrowRight", 25)                 # 0.25 -> 0.5 in steps of 0.01
    expect(page.get_by_test_id("stMetric").filter(has_text=counted).first
           .get_by_test_id("stMetricValue")).to_have_text("8 / 16", timeout=60_000)
    zero_before = _metric(page, "Heads with score 0")
    _press(page, "Threshold z", "ArrowLeft", 20)               # z 2.0 -> 1.0: fewer heads in the bulk
    # the label exactly: "... at z = 1" is also a substring of "... at z = 1.1", one key press before the end
    expect(page.get_by_test_id("stMetricLabel").filter(has_text=re.compile(r"^Heads with score 0 at z = 1$")).first
           ).to_be_visible(
        timeout=60_000)
    assert int(_metric(page, "Heads with score 0")) <= int(zero_before)
    expect(page.get_by_text("runs the model (activations); this checkpoint is open weights only")).to_be_visible()
    _no_error_on_page(page, "prune (weights only)")
    page.screenshot(path=str(ARTIFACTS / "e2e_weights_only_prune.png"), full_page=True)

    nav.get_by_role("link", name="Export", exact=True).click()
    expect(page.get_by_role("heading", name="Export", level=1)).to_be_visible(timeout=LOAD_TIMEOUT_MS)
    _settled(page)
    name_box = page.get_by_role("textbox", name="Folder name (follows the settings until you edit it)")
    expect(name_box).to_have_value(re.compile(r"^ckpt-mp-g-s0\.5-[a-z-]+-pruned$"), timeout=30_000)
    name = name_box.input_value()
    page.get_by_role("button", name="Export", exact=True).click()
    expect(page.get_by_test_id("stAlertContentSuccess")).to_contain_text("Wrote the pruned checkpoint",
                                                                          timeout=LOAD_TIMEOUT_MS)
    folder = export_root / name
    record = json.loads((folder / "mask.json").read_text())
    assert (record["z"], record["sparsity"]) == (1.0, 0.5)
    assert sum(len(k) for k in record["kept"]) == 8 and (folder / "head_layout.json").is_file()
    from analysis.compress.export import load_pruned
    assert next(load_pruned(folder).parameters()).dtype == torch.bfloat16
    _no_error_on_page(page, "export (weights only)")
    page.screenshot(path=str(ARTIFACTS / "e2e_weights_only_export.png"), full_page=True)
