"""Seeds out of range, issue 47 item 4 class 1: every seed option of every command, and every library entry
point that takes a seed, refuses a seed numpy or torch would refuse (-1, 2**70) in one line before any work.

Before the fix: `probes --probe-seed=-1`, `longctx --probe-seed=-1` and `domains --seed=-1` ran their passes and
ended in numpy's "expected non-negative integer" traceback; `probes --probe-seed 2**70` in torch's "Overflow when
unpacking long long". The CLI's check is one place (analysis.cli.main.check_seeds, on the parsed options), so a
new command's seed option is covered without a line of its own: the first test finds the seed options by
building every registered command's parser.
"""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from analysis.core.errors import SEED_MAX, InputError
from tests._input_checks import cli_error

BAD_SEEDS = {"negative": -1, "2**70": 2**70}
# what a command needs besides the seed for its parser to accept the line (nothing runs: the seed is refused first)
REQUIRED = {"mask": ["--sparsity", "0.25"], "evaluate": ["--sparsity", "0.25"], "sweep": ["--sparsity", "0.25"],
            "export": ["--out-dir", "unused", "--name", "unused"], "pipeline": ["--out-dir", "unused", "--name", "unused"],
            "harness": ["--tasks", "boolq"],
            "plan-search": ["--kv-target", "0.5", "--out", "unused"], "deploy-report": ["--dense", "unused", "--pruned", "unused"]}


def seed_options() -> list[tuple[str, str]]:
    """(command, --option) for every seed option of every registered command, from the parsers themselves."""
    from analysis.cli import COMMANDS
    from analysis.cli.main import is_seed
    out = []
    for name, command in COMMANDS.items():
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        try:
            dests = vars(parser.parse_args(REQUIRED.get(name, [])))
        except SystemExit:
            raise AssertionError(f"give REQUIRED the options {name!r} requires (see its --help)") from None
        out += [(name, f"--{dest.replace('_', '-')}") for dest in dests if is_seed(dest)]
    return out


def test_the_seed_options_are_found():
    """The parametrization below is not empty, and holds the options the reviewer's cases used."""
    found = set(seed_options())
    assert {("probes", "--probe-seed"), ("longctx", "--probe-seed"), ("domains", "--seed"),
            ("pipeline", "--train-seed"), ("roles", "--seed"), ("kv-plan", "--seed")} <= found, found


@pytest.mark.parametrize("value", list(BAD_SEEDS.values()), ids=list(BAD_SEEDS))
@pytest.mark.parametrize("command,option", seed_options())
def test_every_seed_option_is_one_line_before_any_work(command, option, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli_error([command, "--quiet", *REQUIRED.get(command, []), f"{option}={value}"],
              rf"^error: {option} must be a whole number from 0 to 9,223,372,036,854,775,807", seconds=20)
    assert not any(tmp_path.iterdir())


def test_the_largest_seed_is_accepted():
    from analysis.cli.main import build_parser, check_seeds
    argv = ["probes", f"--probe-seed={SEED_MAX}", "--seed", "0"]
    check_seeds(build_parser(argv).parse_args(argv))


# -- the library: each entry point refuses before its work (None stands for what it would never reach) ------

def _library_calls():
    from analysis.compress.export.gguf.llamacpp import paired_decode_at, paired_speed, speed
    from analysis.compress.timing import measure
    from analysis.measure.detectors import repeated_random_tokens
    from analysis.measure.evaluation import bootstrap_perplexity
    from analysis.measure.loss import masked_positions
    from analysis.measure.probes.breaks import CapabilityCheck, cut_report
    from analysis.measure.probes.circuit import probe_map
    from analysis.measure.probes.longcontext import build_long, measure_long
    from analysis.measure.probes.measure import bootstrap, measure_probes, run_probes
    from analysis.measure.probes.registry import PROBES, probe_spec
    from analysis.score.domains import TextSet, compare_domains, domain_cuts, importance
    from analysis.score.kvscores import measure_kv_scores
    from analysis.score.longcontext import long_context_report
    text = TextSet("a", "x", "y")
    probes = {f"probe {name}": (lambda seed, name=name: probe_spec(name).make(seed=seed)) for name in PROBES}
    return {
        **probes,
        "build_long": lambda seed: build_long(None, None, "causal-lm", [256], seed=seed),
        "measure_probes": lambda seed: measure_probes(None, {}, seed=seed),
        "run_probes": lambda seed: run_probes(None, seed=seed),
        "cut_report": lambda seed: cut_report(None, None, seed=seed),
        "CapabilityCheck": lambda seed: CapabilityCheck(None, seed=seed),
        "probe_map": lambda seed: probe_map(None, None, None, seed=seed),
        "measure_long": lambda seed: measure_long(None, {}, seed=seed),
        "long_context_report": lambda seed: long_context_report(None, seed=seed),
        "bootstrap": lambda seed: bootstrap(np.zeros((1, 2)), np.arange(2), seed=seed),
        "bootstrap_perplexity": lambda seed: bootstrap_perplexity(np.zeros((1, 2)), np.ones(2), 4, seed),
        "importance": lambda seed: importance(None, "x", "a", seed=seed),
        "compare_domains": lambda seed: compare_domains(None, text, text, seed=seed),
        "domain_cuts": lambda seed: domain_cuts(None, text, text, {}, seed=seed),
        "measure_kv_scores": lambda seed: measure_kv_scores(None, seed=seed),
        "repeated_random_tokens": lambda seed: repeated_random_tokens(64, 1, 8, seed=seed),
        "masked_positions": lambda seed: masked_positions((1, 4), seed=seed),
        "speed.measure": lambda seed: measure(None, None, seed=seed),
        "llamacpp.speed": lambda seed: speed("unused.gguf", 8, seed=seed),
        "llamacpp.paired_speed": lambda seed: paired_speed({}, 8, seed=seed),
        "llamacpp.paired_decode_at": lambda seed: paired_decode_at({}, 8, seed=seed),
    }


LIBRARY = list(_library_calls())


@pytest.mark.parametrize("value", list(BAD_SEEDS.values()), ids=list(BAD_SEEDS))
@pytest.mark.parametrize("name", LIBRARY)
def test_library_entry_points_refuse_a_bad_seed(name, value):
    with pytest.raises(InputError, match=r"seed must be a whole number from 0 to 9,223,372,036,854,775,807"):
        _library_calls()[name](value)


def test_measure_kv_refuses_a_bad_seed():
    """measure_kv checks its model first, then the seed, before building the plans' twins."""
    from analysis.compress.timing import measure_kv
    from tests._tiny import tiny_model
    for value in BAD_SEEDS.values():
        with pytest.raises(InputError, match=r"seed must be a whole number from 0"):
            measure_kv(tiny_model("llama"), {}, context=8, seed=value)


def test_derived_seeds_stay_in_range():
    """A second generator's seed (domains' text set B, distillation's epochs) never leaves 0 .. SEED_MAX, and is
    seed + offset wherever that is in range (the results of every seed used so far are unchanged)."""
    from analysis.compress.recover.distill import batch_indices
    from analysis.core.errors import check_seed, derived_seed
    assert derived_seed(5, 1) == 6 and derived_seed(0, 1) == 1
    assert derived_seed(SEED_MAX, 1) == 0 and check_seed(derived_seed(SEED_MAX, 3)) == 2
    picked = batch_indices(10, 4, 7, SEED_MAX)        # seed * 1_000_003 + epoch overflowed torch's generator
    assert picked.shape == (4,) and bool(((picked >= 0) & (picked < 10)).all())
