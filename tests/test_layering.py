"""The folder tree is the architecture: analysis/'s packages in import order, checked on the source.

core < arch < measure < score < compress < cli: a module may import from its own package or one before
it, never from one after it (inside compress/, export/ before recover/); nothing under analysis/ imports streamlit, and nothing but the CLI package
and `python -m analysis` imports analysis.cli. A module never imports a private name (one starting with
"_") from another package: what a package offers the others is its public names. Imports inside
functions count as much as top-level ones. The public API table in analysis/__init__.py names only things
that exist.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "analysis"
ORDER = ("core", "arch", "measure", "score", "compress", "cli")
RANK = {name: i for i, name in enumerate(ORDER)}
# inside compress/: the concept folders in import order (surgery, cost and timing at compress/'s top come first)
INNER = {"compress": ("export", "recover")}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `tree` (`from analysis import cli` gives analysis.cli)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "analysis" and node.level == 0:
            out += [(node.lineno, f"analysis.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "." * node.level + (node.module or "")))
    return out


def private_imports(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, dotted module, name) of every `from analysis.x.y import _name` (and `import analysis.x._y`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("analysis"):
            out += [(node.lineno, node.module, alias.name) for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, part) for alias in node.names if alias.name.startswith("analysis.")
                    for part in alias.name.split(".") if part.startswith("_") and not part.startswith("__")]
    return out


def violations(root: Path = ROOT) -> list[str]:
    """One line per import that breaks the layering rule (empty: the tree is in order)."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        own = rel.parts[0] if len(rel.parts) > 1 else None          # None: analysis/__init__ or __main__
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, module in imported_modules(tree):
            where = f"analysis/{rel}:{line} imports {module}"
            if module.startswith("."):
                bad.append(f"{where}: relative import (use the absolute name, so the layer is visible)")
                continue
            top = module.split(".")
            if top[0] == "streamlit":
                bad.append(f"{where}: analysis/ never imports streamlit")
            if top[0] != "analysis" or own is None:
                continue
            if len(top) == 1:
                bad.append(f"{where}: the package's public API is for callers outside analysis/")
                continue
            target = top[1]
            if target not in RANK:
                continue                                          # a name re-exported by analysis/__init__
            if target == "cli" and own != "cli":
                bad.append(f"{where}: only the CLI package imports analysis.cli")
            elif RANK[target] > RANK[own]:
                bad.append(f"{where}: {own} is below {target}")
            elif target == own and own in INNER and len(rel.parts) > 2 and len(top) > 2:
                inner, mine = INNER[own], rel.parts[1]
                rank_of = {name: i + 1 for i, name in enumerate(inner)}       # a module at the top is 0
                if top[2] in rank_of and rank_of[top[2]] > rank_of.get(mine, 0):
                    bad.append(f"{where}: {own}/{mine} is below {own}/{top[2]}")
        for line, module, name in private_imports(tree):
            top = module.split(".")
            if own is not None and len(top) > 1 and top[1] in RANK and top[1] != own:
                bad.append(f"analysis/{rel}:{line} imports {name} from {module}: a private name of another package")
    return bad


def test_every_module_lives_in_a_layer():
    loose = [p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert loose == [], f"modules outside the packages: {loose}"
    assert sorted(p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()) == sorted(ORDER)


def test_no_module_imports_a_package_above_its_own():
    assert violations() == []


def test_the_rule_fails_on_a_bad_import(tmp_path):
    """The check can fail: a core module importing score, a measure module importing the CLI, a relative
    import and a streamlit import are each caught (on a copy of the tree, the real one untouched)."""
    import shutil
    copy = tmp_path / "analysis"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "core" / "errors.py").write_text((copy / "core" / "errors.py").read_text()
                                             + "\n\ndef _late():\n    from analysis.score.masks import plan_mask\n")
    (copy / "measure" / "loss.py").write_text((copy / "measure" / "loss.py").read_text()
                                              + "\nfrom analysis.cli import main\nfrom . import profiles\n"
                                                "import streamlit\n")
    found = violations(copy)
    assert any("core/errors.py" in v and "core is below score" in v for v in found)
    assert any("measure/loss.py" in v and "only the CLI package" in v for v in found)
    assert any("measure/loss.py" in v and "relative import" in v for v in found)
    assert any("measure/loss.py" in v and "streamlit" in v for v in found)
    assert len(found) == 4


def test_export_never_imports_recover(tmp_path):
    """compress/export/ writes a cut model; compress/recover/ (distill, pipeline, report) uses it: an
    import the other way round is caught (on a copy of the tree, the real one untouched)."""
    import shutil
    copy = tmp_path / "analysis"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "compress" / "export" / "gguf" / "deploy.py"
    target.write_text(target.read_text() + "\n\ndef _late():\n    from analysis.compress.recover.report import REPORT_FILES\n")
    found = violations(copy)
    assert len(found) == 1 and "compress/export is below compress/recover" in found[0], found


def test_the_rule_fails_on_a_private_name_from_another_package(tmp_path):
    """A score module importing a private helper of measure is caught (inside a function too); a private
    name of the module's own package is its own business (on a copy of the tree, the real one untouched)."""
    import shutil
    copy = tmp_path / "analysis"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "score" / "curves.py").write_text((copy / "score" / "curves.py").read_text()
                                              + "\n\ndef _scratch():\n    from analysis.measure.ablation import _first\n"
                                                "    from analysis.score.masks import _lowest\n")
    found = violations(copy)
    assert found == [f"analysis/score/curves.py:{len((copy / 'score' / 'curves.py').read_text().splitlines()) - 1} "
                     "imports _first from analysis.measure.ablation: a private name of another package"]


@pytest.mark.parametrize("name", __import__("analysis").__all__)
def test_public_api_names_resolve(name):
    import analysis
    assert getattr(analysis, name) is not None
    assert name in dir(analysis)
