"""components/ in one direction, checked on the source: the app's modules stand on floors, and no import runs back up.

FLOORS lists components/'s modules from the bottom up: the plumbing (errors, the session state and its keys, the
loaded model and its cached calls, the jobs), the drawing helpers several pages share (charts, widgets, figures,
tables), the Long context page's shared state (`longstate`: the model's context, the probes' settings, the
precision, the stored-result lookups), then the sections the pages call (the Long context page's longctx, longscan,
longprobes, ruler and duo; the Heads page's taxonomy; the capability probes; the harness panel). A module imports
modules of its own floor or of floors below, never above; a section never imports another section (what two
sections share goes down a floor); there is no circle among components/'s modules; and components/ never imports
pages/ or app.py. Imports inside functions count as much as top-level ones. Every module stands on exactly one
floor, so a new module says where it belongs.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "components"
FLOORS = (
    ("plumbing", ("errors", "state", "jobs", "shell", "tools", "cache", "weights", "exports")),
    ("drawing", ("charts", "controls", "figures", "explain", "numbers", "views")),
    ("long-context state", ("longstate",)),
    ("sections", ("longctx", "longscan", "longprobes", "ruler", "longmap", "duo", "taxonomy", "probes", "harness")),
)
SECTIONS = "sections"                 # the floor whose modules never import one another
OUTSIDE = ("pages", "app")            # what components/ never imports


def floor_of() -> dict[str, int]:
    return {name: rank for rank, (_, names) in enumerate(FLOORS) for name in names}


def imports_of(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every import in `tree`: a components module's name, or "pages" / "app" for those."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == "components" and rest:
                    out.append((node.lineno, rest.split(".")[0]))
                elif top in OUTSIDE:
                    out.append((node.lineno, top))
        elif isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".") if node.module else []
            if node.level == 1 or (node.level == 0 and parts[:1] == ["components"]):
                inner = parts if node.level else parts[1:]
                out += [(node.lineno, inner[0])] if inner else [(node.lineno, a.name) for a in node.names]
            elif node.level == 0 and parts[:1] and parts[0] in OUTSIDE:
                out.append((node.lineno, parts[0]))
    return out


def graph(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """module -> (line, imported module or "pages" / "app") for every components/*.py but __init__."""
    return {path.stem: imports_of(ast.parse(path.read_text(encoding="utf-8")))
            for path in sorted(root.glob("*.py")) if path.stem != "__init__"}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each circle of the import graph once, as the path that closes it (a -> b -> a)."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            loop = path[path.index(node):]
            turn = loop.index(min(loop))                      # one spelling per circle
            key = tuple(loop[turn:] + loop[:turn])
            if key not in {tuple(c[:-1]) for c in found}:
                found.append(list(key) + [key[0]])
            return
        if node in done:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for start in sorted(edges):
        visit(start, [])
    return found


def violations(root: Path = ROOT) -> list[str]:
    """One line per module without a floor and per import that breaks the rule (empty: components/ is in order)."""
    rank, names = floor_of(), {name: label for label, group in FLOORS for name in group}
    modules = graph(root)
    bad = [f"components/{m}.py stands on no floor: add it to FLOORS" for m in modules if m not in rank]
    bad += [f"FLOORS names {m}, which is not a module of components/" for m in rank if m not in modules]
    for module, found in modules.items():
        for line, target in found:
            where = f"components/{module}.py:{line} imports {target}"
            if target in OUTSIDE:
                bad.append(f"{where}: components/ never imports pages/ or app.py")
            elif module in rank and target in rank and target != module:
                if rank[target] > rank[module]:
                    bad.append(f"{where}: {names[module]} is below {names[target]}")
                elif rank[target] == rank[module] and names[module] == SECTIONS:
                    bad.append(f"{where}: a section never imports another section (move what they share down)")
    edges = {m: {t for _, t in found if t in modules and t != m} for m, found in modules.items()}
    bad += ["circle: " + " -> ".join(c) for c in circles(edges)]
    return bad


def test_every_floor_names_real_modules_once():
    listed = [name for _, names in FLOORS for name in names]
    assert len(listed) == len(set(listed)), "a module stands on two floors"
    assert sorted(listed) == sorted(graph()), "FLOORS and components/*.py differ"


def test_components_run_in_one_direction():
    assert violations() == []


def test_the_check_fails_on_bad_imports(tmp_path):
    """The check can fail: the shared state importing a section inside a function (an arrow back up and a circle),
    one section importing another, a circle inside one floor, an import of pages/ and a module on no floor are
    each caught (on a copy of the tree, the real one untouched)."""
    import shutil
    copy = tmp_path / "components"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def add(name: str, text: str) -> None:
        (copy / f"{name}.py").write_text((copy / f"{name}.py").read_text() + text)

    add("longstate", "\n\ndef _late():\n    from .longprobes import plan_report\n")
    add("ruler", "\nfrom components import longctx\n")
    add("state", "\n\ndef _late():\n    from . import cache\n")
    add("errors", "\nimport pages.heads\n")
    (copy / "loose.py").write_text('"""A module nobody placed."""\n')
    found = violations(copy)
    assert any("longstate.py" in v and "long-context state is below sections" in v for v in found), found
    assert any("ruler.py" in v and "imports longctx: a section never imports another section" in v for v in found)
    assert "circle: longprobes -> longstate -> longprobes" in found
    assert "circle: cache -> state -> cache" in found
    assert any("errors.py" in v and "never imports pages/" in v for v in found)
    assert "components/loose.py stands on no floor: add it to FLOORS" in found
    assert len(found) == 6, found


def test_imports_are_read_in_every_spelling():
    """`from . import a, b`, `from .a import x`, `from components import a`, `from components.a import x`,
    `import components.a` and an import inside a function all name their module; other packages do not."""
    tree = ast.parse("from . import cache, state\nfrom .errors import shown_errors\nfrom components import views\n"
                     "from components.longstate import scan\nimport components.charts\nimport app\n"
                     "from pages import heads\nimport numpy\nfrom analysis.score import masks\n"
                     "def f():\n    from .jobs import board\n")
    assert sorted(name for _, name in imports_of(tree)) == sorted(
        ["cache", "state", "errors", "views", "longstate", "charts", "app", "pages", "jobs"])


def test_the_clear_button_still_reaches_the_sections_caches():
    """longstate's Clear button no longer imports the sections to name their caches: each marks its own
    (`@forgotten_with_store`), and the button empties the same calls it named before the floors."""
    from components import longprobes, longstate, ruler  # noqa: F401 - the page imports them all
    assert sorted(longstate._WITH_STORE) == sorted(
        ["components.longstate.scan", "components.longstate.importance", "components.longstate.long_detection",
         "components.longprobes.plan_report", "components.ruler.dense_side", "components.ruler.plan_report",
         "components.ruler.dense_measured"])
