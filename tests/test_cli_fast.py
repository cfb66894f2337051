"""The CLI starts fast (issue 42): the parser and everything it reads are declarations, never the
implementations (torch, transformers), so `--help`, `probes --list` and the refusals the parser or the
declarations can judge cost a Python start and numpy, not seconds of imports.

Checked on what is imported, never on a clock (bench/bench_cli.py measures the time): a child process
builds the parser of every command, prints every command's help, refuses options and lists the probes,
then reports which heavy packages `sys.modules` holds; the same child with one `import torch` added
shows the check can fail. Also: `probes --list` (JSON and CSV), every lazily named implementation loads
and carries its declaration, a declared scorer stays unimported until it is used, and importing every
implementation module registers nothing the declarations lack (a probe or detector added "beside its
class" only would be invisible to the CLI).
"""
from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import textwrap

import pytest

from tests._input_checks import ROOT

HEAVY = ("torch", "transformers", "accelerate", "safetensors", "onnx", "onnxruntime", "gguf", "peft", "captum")

# the child: every parser, every help, refusals the parser or the declarations judge, probes --list
CHILD = textwrap.dedent("""
    import contextlib, io, json, sys
    {extra}
    from analysis.cli import COMMANDS, build_parser, main

    codes = {{}}
    def run(*argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as stop:
                code = stop.code
        codes[" ".join(argv)] = (code, err.getvalue().strip().splitlines())

    build_parser()                                       # every command's options at once
    for name in COMMANDS:
        build_parser([name])
        run(name, "--help")
    run("--help")
    run("mask", "--sparsity", "2")                      # the declarations' check (masks.check_sparsity)
    run("score", "--scorer", "nope")                    # the parser's choices
    run("probes", "--probe", "nope")
    run("roles", "--detector", "nope")
    run("mask", "--sparsity", "0.5", "--policy", "nope")
    run("export", "--sparsity", "0.5", "--export-format", "onnx", "--opset", "5", "--out-dir", "x", "--name", "y")
    run("export", "--sparsity", "0.5", "--gguf-type", "q8_0", "--out-dir", "x", "--name", "y")
    run("probes", "--top", "0")                         # the command's own check, before its imports
    run("probes", "--list")
    heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
    print(json.dumps(dict(heavy=heavy, codes=codes)))
""")


def _child(extra: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(extra=extra, heavy=HEAVY)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_parser_help_and_refusals_import_no_torch_or_transformers():
    seen = _child()
    assert seen["heavy"] == [], f"building the CLI's parser imported {seen['heavy']}"
    codes = seen["codes"]
    helps = {argv: code for argv, (code, _) in codes.items() if argv.endswith("--help")}
    assert len(helps) >= 12 and set(helps.values()) == {0}, helps      # every command's help, and the top one
    assert codes["--help"][0] == 0 and codes["probes --list"] == [0, []]
    refused = {argv: lines for argv, (code, lines) in codes.items() if code != 0}
    assert set(refused) == {"mask --sparsity 2", "score --scorer nope", "probes --probe nope", "roles --detector nope",
                            "probes --top 0",
                            "mask --sparsity 0.5 --policy nope",
                            "export --sparsity 0.5 --export-format onnx --opset 5 --out-dir x --name y",
                            "export --sparsity 0.5 --gguf-type q8_0 --out-dir x --name y"}
    for argv, lines in refused.items():                 # each refusal: exit 2, one line
        assert codes[argv][0] == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, lines)
    assert "Sparsity must be in [0, 1)" in refused["mask --sparsity 2"][0]
    assert "invalid choice: 'nope'" in refused["score --scorer nope"][0] and "--help" in refused["score --scorer nope"][0]
    assert "opset must be a whole number from 9 to 20" in refused[
        "export --sparsity 0.5 --export-format onnx --opset 5 --out-dir x --name y"][0]
    assert "--gguf-type is an option of another export format" in refused[
        "export --sparsity 0.5 --gguf-type q8_0 --out-dir x --name y"][0]


def test_the_import_check_can_fail():
    """The same child with one heavy import of its own: the check sees it."""
    assert "torch" in _child("import torch")["heavy"]


# -- probes --list ---------------------------------------------------------------------------------


def test_probes_list_is_the_registry_in_json_and_csv(capsys):
    from analysis import cli
    from analysis.measure.probes import PROBES

    assert cli.main(["probes", "--list"]) == 0
    listed = json.loads(capsys.readouterr().out)["probes"]
    assert [p["name"] for p in listed] == list(PROBES) and len(listed) >= 6
    for p in listed:
        spec = PROBES.declaration(p["name"])
        assert p == dict(name=spec.name, label=spec.label, kinds=list(spec.kinds), help=spec.help, source=spec.source)
    assert {"name": "ioi", "kinds": ["causal-lm", "masked-lm"]}.items() <= listed[0].items()

    assert cli.main(["probes", "--list", "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["name"] for r in rows] == list(PROBES)
    assert list(rows[0]) == ["name", "label", "kinds", "help", "source"]
    assert all(r["kinds"].split() == list(PROBES[r["name"]].kinds) for r in rows)


def test_probes_list_takes_a_registered_probe(capsys):
    from analysis import cli
    from analysis.measure.probes import PROBES, register_probe
    from tests._probekit import PLANTED
    from tests._registry import registered

    with registered(register_probe, PROBES, PLANTED, PLANTED.name):
        assert cli.main(["probes", "--list", "--format", "csv"]) == 0
    rows = {r["name"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    assert rows["planted"]["kinds"] == "causal-lm" and rows["planted"]["label"] == "Planted copy"


# -- the lazy mechanism ----------------------------------------------------------------------------


def _declared_classes():
    """(registry, name, declaration) of every entry declared lazily."""
    from analysis.compress.export.format_registry import FORMATS
    from analysis.score.scorer_registry import SCORERS
    return [(reg, name, decl) for reg in (SCORERS, FORMATS) for name, decl in reg.declarations.items()]


@pytest.mark.parametrize("registry", ["scorer", "export format"])
def test_every_declared_class_loads_and_carries_its_declaration(registry):
    from analysis.core.registry import ref_of
    entries = [(reg, name, decl) for reg, name, decl in _declared_classes() if reg.what == registry]
    assert entries
    for reg, name, decl in entries:
        value = reg[name]
        cls = value if isinstance(value, type) else type(value)
        assert ref_of(cls) == decl.cls and cls.name == name
        for field in ("label", "parameters", "needs_calibration", "help", "rank", "options"):
            if hasattr(decl, field):
                assert getattr(cls, field) is getattr(decl, field), (name, field)


def test_declared_option_choices_are_what_the_implementations_take():
    from analysis.compress.export.format_registry import FORMATS, ONNX_INT8_METHODS
    from analysis.compress.export.gguf.writer import EMBEDDING_TYPES, WEIGHT_TYPES
    from analysis.compress.export.onnx_int8 import ONNX_METHODS
    assert tuple(ONNX_METHODS) == ONNX_INT8_METHODS
    gguf = FORMATS.declaration("gguf").options
    assert gguf["gguf_type"].choices == tuple(WEIGHT_TYPES)
    assert gguf["gguf_embedding_type"].choices == tuple(EMBEDDING_TYPES)


def test_every_probe_and_detector_reference_loads():
    from analysis.measure.detector_registry import DETECTORS
    from analysis.measure.probes import PROBES
    from analysis.measure.probes.items import Probe
    for spec in PROBES.values():
        assert issubclass(spec.probe_class, Probe)
    for name, spec in DETECTORS.items():
        assert hasattr(spec.builder(None, {}), "detect"), name


LAZY_TOY = '''
import numpy as np
from analysis.score.scoring import Scorer


class LazyToy(Scorer):
    name = "toy-lazy-test"

    def _compute(self, target, calibration, cost, progress, should_stop):
        return self.gamma * np.ones((target.n_layers, target.n_heads)), None
'''


def test_a_declared_scorer_is_imported_only_when_used(tmp_path, monkeypatch):
    """A ScorerSpec naming a module nobody imported yet: the CLI's parser, the weight-only set and the
    parameter lists read it without importing the module; scoring imports it, and the class takes its
    label and parameters from the declaration."""
    from analysis import cli
    from analysis.core.params import Param
    from analysis.score import scorer_registry as reg
    (tmp_path / "lazy_toy_scorer.py").write_text(LAZY_TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = reg.ScorerSpec("toy-lazy-test", "Toy (lazy)", "lazy_toy_scorer:LazyToy",
                          {"gamma": Param(2.0, help="toy factor")})
    try:
        reg.register_scorer(spec)
        actions = {a.dest: a for a in next(a for a in cli.build_parser(["score"])._actions
                                           if a.dest == "command").choices["score"]._actions}
        assert "toy-lazy-test" in actions["scorer"].choices and actions["gamma"].type is float
        assert "toy-lazy-test" in reg.weight_only_scorers() and reg.scorer_label("toy-lazy-test") == "Toy (lazy)"
        assert "lazy_toy_scorer" not in sys.modules
        scorer = reg.get_scorer("toy-lazy-test", gamma=3.0)
        assert "lazy_toy_scorer" in sys.modules
        cls = type(scorer)
        assert cls.label == "Toy (lazy)" and cls.parameters is spec.parameters and scorer.params() == {"gamma": 3.0}
        assert reg.SCORERS["toy-lazy-test"] is cls
        reg.register_scorer(cls)                           # the class its declaration names: a no-op
        assert reg.SCORERS.declaration("toy-lazy-test") is spec
    finally:
        reg.SCORERS.pop("toy-lazy-test", None)
        sys.modules.pop("lazy_toy_scorer", None)


def test_a_declared_field_written_twice_is_refused():
    from analysis.score import scorer_registry as reg
    from analysis.score.scoring import Scorer
    spec = reg.ScorerSpec("toy-twice-test", "Toy (twice)", f"{__name__}:Twice")
    try:
        reg.register_scorer(spec)
        with pytest.raises(TypeError, match="label.*one place"):
            type("Twice", (Scorer,), {"name": "toy-twice-test", "label": "again", "__module__": __name__,
                                      "__qualname__": "Twice"})
    finally:
        reg.SCORERS.pop("toy-twice-test", None)


# the child: the light registries first, then every implementation module; nothing new may appear
IMPLEMENTATIONS = textwrap.dedent("""
    import importlib, inspect, json, pkgutil
    from analysis.compress.export.format_registry import FORMATS
    from analysis.measure.detector_registry import DETECTORS
    from analysis.measure.probes import PROBES
    from analysis.score.scorer_registry import SCORERS
    from analysis.core.registry import ref_of
    registries = dict(scorers=SCORERS, detectors=DETECTORS, probes=PROBES, formats=FORMATS)
    before = {k: list(r) for k, r in registries.items()}
    import analysis.measure.probes as probes, analysis.compress.export as export
    modules = [f"analysis.measure.probes.{m.name}" for m in pkgutil.iter_modules(probes.__path__)]
    modules += [m.name for m in pkgutil.walk_packages(export.__path__, "analysis.compress.export.")]
    modules += ["analysis.score.scoring", "analysis.measure.detectors", "analysis.measure.circuits",
                "analysis.measure.dla"]
    for m in modules:
        importlib.import_module(m)
    after = {k: list(r) for k, r in registries.items()}
    from analysis.measure.probes.items import Probe
    named = {spec.cls if isinstance(spec.cls, str) else ref_of(spec.cls) for spec in PROBES.declared().values()}
    classes = {ref_of(c) for m in modules if m.startswith("analysis.measure.probes.")
               for _, c in inspect.getmembers(importlib.import_module(m), inspect.isclass)
               if issubclass(c, Probe) and c is not Probe and c.__module__ == m}
    print(json.dumps(dict(before=before, after=after, undeclared=sorted(classes - named))))
""")


def test_importing_the_implementations_registers_nothing_new():
    """Every probe class of analysis/measure/probes/ is named by a declaration, and no implementation
    module registers anything on import (a record written only beside its class would be invisible to
    the CLI's parser and `probes --list`): move it into the registry's declarations."""
    done = subprocess.run([sys.executable, "-c", IMPLEMENTATIONS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    new = {k: sorted(set(seen["after"][k]) - set(seen["before"][k])) for k in seen["before"]}
    assert not any(new.values()), f"registered on import, not declared (move them to the registry): {new}"
    assert seen["after"] == seen["before"]
    assert seen["undeclared"] == [], f"Probe classes no declaration names: {seen['undeclared']}"
