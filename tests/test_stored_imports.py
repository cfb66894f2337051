"""The commands that find every result stored (kv-plan --rows probes, longctx --kv-plan) import no transformers
modeling code (issue 51 item 4: ~2 s of imports): the deferred load builds no model (analysis.arch.models.
load_deferred reads the built model's dtype and kernel back from the cache), and the attention kernels
(analysis.arch.attention's "sdpa-float32", analysis.arch.spans' "headscope-spans") are registered the first time a
model switches to them, not at import. Each check runs in a fresh process (sys.modules of its own)."""
import json
import os
import subprocess
import sys

from tests._apptools import long_tiny, results_store  # noqa: F401 (fixtures)
from tests._input_checks import ROOT, run_captured
from tests._threads import one_torch_thread  # noqa: F401 (autouse)

MODELING = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama")
KERNELS = ("sdpa-float32", "headscope-spans")


def _fresh(code: str) -> dict:
    """The JSON object a fresh Python process running `code` prints on its last stdout line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_stored_commands_import_no_modeling_code(long_tiny, results_store, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HEADSCOPE_CACHE", str(tmp_path / "cache"))      # the built model's facts kept there
    plan = tmp_path / "kv_plan.json"
    kv = ["kv-plan", "--model", str(long_tiny), "--rows", "probes", "--lengths", "320", "--sinks", "2", "--recent",
          "16", "--window-share", "0.5", "--out", str(plan), "--quiet"]
    lc = ["longctx", "--model", str(long_tiny), "--lengths", "320", "--items", "2", "--probe", "passkey",
          "--kv-plan", str(plan), "--quiet"]
    for argv in (kv, lc):                                                # fill the store (misses: measured)
        code, _, err = run_captured(capsys, *argv)
        assert code == 0, err
    script = ("import contextlib, io, json, sys\n"
              "from analysis import cli\n"
              "out = {}\n"
              f"for name, argv in (('kv', {kv!r}), ('lc', {lc!r})):\n"
              "    buffer = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buffer):\n"
              "        code = cli.main(argv)\n"
              "    out[name] = dict(code=code, stored=json.loads(buffer.getvalue())['stored'])\n"
              f"out['modeling'] = [m for m in {MODELING!r} if m in sys.modules]\n"
              "from analysis.arch import attention, spans\n"          # (AttentionInterface is modeling_utils')
              "out['registered'] = [m.register.cache_info().currsize for m in (attention, spans)]\n"
              "print(json.dumps(out))\n")
    got = _fresh(script)
    assert got["kv"] == dict(code=0, stored={"scan": "hit"})
    assert got["lc"] == dict(code=0, stored={"dense": "hit", "cut": "hit"})
    assert got["modeling"] == [] and got["registered"] == [0, 0]


def test_kernels_register_before_their_first_use():
    """Imported, nothing is registered; a model switched to either kernel runs it (registered on the way in), and
    the switches give the stock kernel's logits (float32, outside autocast: sdpa-float32 is sdpa there)."""
    script = ("import json, torch\n"
              "from transformers import AttentionInterface\n"
              "from analysis.arch.attention import float32_attention\n"
              "from analysis.arch.spans import tapped\n"
              f"before = [k for k in {KERNELS!r} if k in AttentionInterface()]\n"
              "from tests._tiny import tiny_input_ids, tiny_model\n"
              "m = tiny_model('llama')\n"
              "m.set_attn_implementation('sdpa')\n"
              "x = tiny_input_ids(2, 12)\n"
              "seen = []\n"
              "with torch.no_grad():\n"
              "    dense = m(x).logits\n"
              "    with float32_attention(m):\n"
              "        kernel = m.config._attn_implementation\n"
              "        f32 = m(x).logits\n"
              "    with tapped(m, lambda layer, q, k, v: seen.append(layer)):\n"
              "        spans = m(x).logits\n"
              f"after = [k for k in {KERNELS!r} if k in AttentionInterface()]\n"
              "gap = lambda a: (a - dense).abs().max().item()\n"
              "print(json.dumps(dict(before=before, after=after, kernel=kernel, taps=len(seen), f32=gap(f32),\n"
              "                      spans=gap(spans))))\n")
    got = _fresh(script)
    assert got["before"] == [] and got["after"] == list(KERNELS)
    assert got["kernel"] == "sdpa-float32" and got["taps"] > 0
    assert got["f32"] == 0.0 and got["spans"] <= 1e-5
