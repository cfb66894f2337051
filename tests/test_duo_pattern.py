"""KV plans that travel: DuoAttention's pattern folder (analysis/compress/export/duo.py), the kvpress bridge's
pattern (analysis/compress/kvpress_bridge.py, without kvpress) and `kv-plan --to-duo / --from-duo / --compare`.

- a plan -> pattern folder -> plan is the same plan (through the gates and through the kv_plan.json beside
  them); the gates file is byte for byte np.savetxt(..., delimiter="\\t"), what DuoAttention writes;
- gates are read as DuoAttention reads them (clipped to [0, 1]) and thresholded by its rules: gate >= t, or the
  quantile rule of a sparsity (checked against that rule on distinct gates; ties broken by (layer, head));
- a pattern of another geometry, a plan that prunes, and malformed files (NaN, ragged rows, a word, empty,
  huge, a FIFO, a config without the band) are one InputError; the CLI refuses in one line before any work;
- the agreement of two plans on full KV heads, counted by hand.
kvpress itself is not installed here: the press is checked by bench/peers/kvpress_ruler.py in its own
environment (docs/PEERS.md).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from analysis.arch.geometry import HeadGeometry
from analysis.compress.export import duo
from analysis.core.errors import InputError
from analysis.arch.kvplan import FULL, PRUNE, WINDOW, KVPlan, read_kv_plan
from analysis.arch.window import Window
from tests._input_checks import cli_error, cli_run, in_thread, released_fifo

GEO = HeadGeometry(4, 4, 2, 8, 32)                     # tests/_apptools.tiny_model_dir's default shape


def _plan(modes, sinks=3, recent=17, n_heads=4, model="tiny") -> KVPlan:
    return KVPlan(np.array(modes, np.int8), Window(sinks, recent), n_heads, model, ("made by hand",))


def _random_plan(seed: int, shape=(4, 2), prune=False) -> KVPlan:
    rng = np.random.default_rng(seed)
    return _plan(rng.integers(0, 3 if prune else 2, shape), n_heads=2 * shape[1])


def _write_gates(folder, gates, config=None):
    folder.mkdir(parents=True, exist_ok=True)
    np.savetxt(folder / duo.HEADS_FILE, np.asarray(gates, float), delimiter="\t")     # DuoAttention's writer
    (folder / duo.CONFIG_FILE).write_text(json.dumps(config or {"sink_size": 128, "recent_size": 256}))
    return folder


# ---- round trips and the file format ------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_plan_to_pattern_to_plan_is_the_same_plan(tmp_path, seed):
    plan = _random_plan(seed)
    folder = duo.write_pattern(tmp_path / "pattern", duo.pattern_from_plan(plan), plan=plan)
    back = duo.plan_from_pattern(duo.read_pattern(folder), GEO if plan.n_heads == 4 else None)
    assert back.as_dict() == plan.as_dict()
    assert read_kv_plan(folder).as_dict() == plan.as_dict()            # the kv_plan.json beside the gates
    again = duo.plan_from_pattern(duo.read_pattern(folder / duo.HEADS_FILE), sparsity=plan.windowed.mean())
    assert (again.modes == plan.modes).all()                           # the plan's own share gives it back


def test_the_gates_file_is_what_duoattention_writes(tmp_path):
    plan = _random_plan(7, shape=(6, 3))
    folder = duo.write_pattern(tmp_path / "p", duo.pattern_from_plan(plan))
    np.savetxt(tmp_path / "theirs.tsv", np.where(plan.modes == FULL, 1.0, 0.0), delimiter="\t")
    assert (folder / duo.HEADS_FILE).read_bytes() == (tmp_path / "theirs.tsv").read_bytes()
    assert json.loads((folder / duo.CONFIG_FILE).read_text())["sink_size"] == plan.window.sinks


def test_gates_are_read_as_duoattention_reads_them(tmp_path):
    gates = np.random.default_rng(1).normal(0.5, 0.6, (5, 4))          # trained gates stray outside [0, 1]
    pattern = duo.read_pattern(_write_gates(tmp_path / "p", gates))
    assert np.array_equal(pattern.gates, np.clip(np.loadtxt(tmp_path / "p" / duo.HEADS_FILE, delimiter="\t"), 0, 1))
    assert (pattern.sink_size, pattern.recent_size) == (128, 256)
    assert np.array_equal(pattern.full(), pattern.gates >= 0.5)
    assert np.array_equal(pattern.full(threshold=0.8), pattern.gates >= 0.8)


@pytest.mark.parametrize("sparsity", [0.0, 0.1, 0.25, 0.5, 0.6, 0.75, 0.95, 1.0])
def test_sparsity_follows_duoattentions_quantile_rule(sparsity):
    """duo_attn.utils.sparsify_attention_heads on distinct gates: full = gates >= np.quantile(gates, s); s >= 1
    all streaming, s <= 0 none."""
    gates = np.random.default_rng(2).permutation(40).reshape(8, 5) / 40.0 + 0.001
    theirs = np.ones_like(gates, bool) if sparsity <= 0 else np.zeros_like(gates, bool) if sparsity >= 1 \
        else gates >= np.quantile(gates, sparsity)
    assert np.array_equal(duo.DuoPattern(gates, 4, 64).full(sparsity=sparsity), theirs)


def test_tied_gates_break_by_layer_and_head():
    gates = np.zeros((3, 2))                                            # all tied: the first heads go first
    full = duo.DuoPattern(gates, 4, 64).full(sparsity=0.5)
    assert (~full).sum() == 3 and (~full).ravel().tolist() == [True, True, True, False, False, False]


def test_a_pattern_without_headscope_notes_says_where_it_came_from(tmp_path):
    pattern = duo.read_pattern(_write_gates(tmp_path / "p", [[1, 0], [0.2, 0.9], [1, 1], [0, 0]]))
    plan = duo.plan_from_pattern(pattern, GEO, model="tiny")
    assert plan.modes.tolist() == [[FULL, WINDOW], [WINDOW, FULL], [FULL, FULL], [WINDOW, WINDOW]]
    assert (plan.window, plan.n_heads, plan.model) == (Window(128, 256), 4, "tiny")
    assert plan.notes == ("from a DuoAttention pattern (gates >= 0.5 full)",)


# ---- what a pattern cannot hold, and other models ---------------------------------------------------

def test_a_plan_that_prunes_is_refused_or_written_as_asked():
    plan = _plan([[FULL, PRUNE], [WINDOW, FULL], [PRUNE, WINDOW], [FULL, FULL]])
    with pytest.raises(InputError, match=r"prunes 2 KV heads.*--duo-pruned"):
        duo.pattern_from_plan(plan)
    for pruned, gate in (("full", 1.0), ("window", 0.0)):
        pattern = duo.pattern_from_plan(plan, pruned=pruned)
        assert pattern.gates[plan.modes == PRUNE].tolist() == [gate, gate]
        assert pattern.gates[plan.modes == WINDOW].tolist() == [0.0, 0.0]
        assert pattern.config["headscope"]["notes"][-1] == f"pruned KV heads written as {pruned}"


def test_a_pattern_of_another_geometry_is_refused(tmp_path):
    pattern = duo.read_pattern(_write_gates(tmp_path / "p", np.ones((32, 8))))
    with pytest.raises(InputError, match=r"32 layers x 8 KV heads, but the model has 4 x 2"):
        duo.plan_from_pattern(pattern, GEO)
    with pytest.raises(InputError, match="different models"):
        duo.full_agreement(duo.plan_from_pattern(pattern, n_heads=32), _random_plan(0))


BAD_GATES = {
    "nan": ("1.0\t0.5\n0.3\tnan\n", r"layer 1, KV head 1 is nan"),
    "ragged": ("1.0\t0.5\n0.3\n", r"line 2 holds 1 gates but the first row 2"),
    "word": ("1.0\tyes\n", r"'yes' is not a gate"),
    "trailing tab": ("1.0\t0.5\t\n", r"'an empty cell' is not a gate"),
    "empty": ("\n# nothing\n", r"holds no gates"),
}


@pytest.mark.parametrize("case", sorted(BAD_GATES))
def test_malformed_gates_are_one_line(tmp_path, case):
    text, pattern = BAD_GATES[case]
    folder = _write_gates(tmp_path / "p", [[1.0]])
    (folder / duo.HEADS_FILE).write_text(text)
    with pytest.raises(InputError, match=pattern) as err:
        duo.read_pattern(folder)
    assert "\n" not in str(err.value)


BAD_CONFIGS = {
    "no band": ({"sink_size": 4}, r"config.json has no recent_size"),
    "a window of 0": ({"sink_size": 4, "recent_size": 0}, r"recent_size must be a whole number of tokens >= 1"),
    "a float": ({"sink_size": 4.5, "recent_size": 8}, r"sink_size must be a whole number"),
    "a list": ([4, 8], r"must hold a JSON object"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_malformed_configs_are_one_line(tmp_path, case):
    config, pattern = BAD_CONFIGS[case]
    folder = _write_gates(tmp_path / "p", [[1.0]])
    (folder / duo.CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(InputError, match=pattern):
        duo.read_pattern(folder)
    (folder / duo.CONFIG_FILE).write_text('{"sink_size": NaN, "recent_size": 8}')
    with pytest.raises(InputError, match="not valid JSON"):
        duo.read_pattern(folder)


def test_missing_huge_and_fifo_files_are_one_line(tmp_path):
    with pytest.raises(InputError, match="is not a folder"):
        duo.read_pattern(tmp_path / "nowhere")
    folder = _write_gates(tmp_path / "p", [[1.0]])
    (folder / duo.CONFIG_FILE).unlink()
    with pytest.raises(InputError, match=r"config.json.*does not exist"):
        duo.read_pattern(folder)
    huge = _write_gates(tmp_path / "huge", [[1.0]])
    with open(huge / duo.HEADS_FILE, "r+b") as f:
        f.truncate(duo.MAX_HEADS_BYTES + 1)                             # sparse: nothing big on disk
    with pytest.raises(InputError, match="larger than 16 MiB"):
        duo.read_pattern(huge)
    fifo_folder = tmp_path / "fifo"
    fifo_folder.mkdir()
    (fifo_folder / duo.CONFIG_FILE).write_text('{"sink_size": 4, "recent_size": 8}')
    with released_fifo(fifo_folder / duo.HEADS_FILE) as fifo:
        def release():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        with pytest.raises(InputError, match="pipe"):
            in_thread(lambda: duo.read_pattern(fifo_folder), 20, release)


def test_gate_rules_out_of_range_are_refused():
    pattern = duo.DuoPattern(np.ones((2, 2)), 4, 8)
    for kw, words in (({"threshold": 1.5}, "threshold"), ({"sparsity": -0.1}, "sparsity"),
                      ({"threshold": 0.5, "sparsity": 0.5}, "not both"), ({"threshold": float("nan")}, "threshold")):
        with pytest.raises(InputError, match=words):
            pattern.full(**kw)


# ---- agreement ----------------------------------------------------------------------------------------

def test_agreement_counts_full_heads_by_hand():
    a = _plan([[FULL, WINDOW], [FULL, FULL], [WINDOW, PRUNE], [WINDOW, WINDOW]])
    b = _plan([[FULL, FULL], [WINDOW, FULL], [WINDOW, WINDOW], [PRUNE, WINDOW]])
    agreement = duo.full_agreement(a, b)
    d = agreement.as_dict(("headscope", "duo"))
    assert d["counts"] == {"both": 2, "only_headscope": 1, "only_duo": 1, "neither": 4}
    assert d["heads"] == {"both": [[0, 0], [1, 1]], "only_headscope": [[1, 0]], "only_duo": [[0, 1]]}
    assert d["agree"] == 6 and d["of"] == 8 and agreement.jaccard == pytest.approx(2 / 4)


def test_the_bridge_reads_the_same_pattern_from_a_plan_a_pattern_and_a_folder(tmp_path):
    from analysis.compress.kvpress_bridge import plan_pattern
    plan = _random_plan(3)
    pattern = duo.pattern_from_plan(plan)
    folder = duo.write_pattern(tmp_path / "p", pattern)
    want = (plan.windowed, plan.window.sinks, plan.window.recent)
    for source in (plan, pattern, folder, str(folder)):
        got = plan_pattern(source)
        assert np.array_equal(got[0], want[0]) and got[1:] == want[1:]
    with pytest.raises(InputError, match="prunes"):
        plan_pattern(_plan([[PRUNE, FULL]] * 4))


def test_duo_press_without_kvpress_says_where_kvpress_lives():
    try:
        import kvpress  # noqa: F401
        pytest.skip("kvpress is installed here; the peers runner checks the press")
    except ImportError:
        pass
    from analysis.compress.kvpress_bridge import duo_press
    with pytest.raises(InputError, match=r"kvpress is not installed.*setup_kvpress\.sh"):
        duo_press(_random_plan(0))


# ---- the CLI ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests._apptools import tiny_model_dir
    return tiny_model_dir(tmp_path_factory.mktemp("duo-tiny"))


def test_cli_plan_to_duo_and_back_from_duo(tmp_path, tiny):
    plan = _random_plan(5)
    (tmp_path / "plan.json").write_text(plan.to_json())
    code, out, err = cli_run(["kv-plan", "--plan", tmp_path / "plan.json", "--to-duo", tmp_path / "duo"])
    assert code == 0, err
    assert json.loads(out)["duo"] == str(tmp_path / "duo")
    code, out, err = cli_run(["kv-plan", "--quiet", "--model", tiny, "--device", "cpu", "--from-duo", tmp_path / "duo",
                              "--out", tmp_path / "back.json", "--compare", tmp_path / "plan.json"])
    assert code == 0, err
    summary = json.loads(out)
    back = read_kv_plan(tmp_path / "back.json", geometry=GEO)
    assert (back.modes == plan.modes).all() and back.window == plan.window
    assert back.model == summary["model"]["source"]                      # the loaded model's name, not the file's
    assert summary["agreement"]["agree"] == 8 and summary["agreement"]["counts"]["only_this"] == 0


def test_cli_refuses_in_one_line_before_any_work(tmp_path, tiny):
    pruning = _plan([[PRUNE, FULL], [FULL, WINDOW], [FULL, FULL], [WINDOW, WINDOW]])
    (tmp_path / "pruning.json").write_text(pruning.to_json())
    cli_error(["kv-plan", "--plan", tmp_path / "pruning.json", "--to-duo", tmp_path / "d1"], "prunes 1 KV heads")
    assert not (tmp_path / "d1").exists()                               # nothing half-written
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    cli_error(["kv-plan", "--plan", tmp_path / "pruning.json", "--to-duo", tmp_path / "full"], "not empty")
    assert os.listdir(tmp_path / "full") == ["keep.txt"]
    cli_error(["kv-plan", "--plan", tmp_path / "pruning.json", "--duo-threshold", "2"], "threshold is a number")
    big = _write_gates(tmp_path / "big", np.ones((32, 8)))
    cli_error(["kv-plan", "--quiet", "--model", tiny, "--device", "cpu", "--from-duo", big, "--out",
               tmp_path / "x.json"], r"32 layers x 8 KV heads, but the model has 4 x 2")
    assert not (tmp_path / "x.json").exists()
    cli_error(["kv-plan", "--quiet", "--model", tiny, "--device", "cpu", "--compare", tmp_path / "nothing.json"],
              "does not exist")
    long = tmp_path / ("x" * 300)                                       # a name the file system refuses
    for option in ("--to-duo", "--compare"):
        cli_error(["kv-plan", "--plan", tmp_path / "pruning.json", option, long], "name is too long")
    cli_error(["kv-plan", "--from-duo", long], "name is too long")
    cli_error(["kv-plan", "--plan", long], "name is too long")
    with pytest.raises(SystemExit):                                     # argparse: one source of the plan
        from analysis.cli.main import build_parser
        build_parser(["kv-plan"]).parse_args(["kv-plan", "--plan", "a", "--from-duo", "b"])
