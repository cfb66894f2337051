"""The export-format registry: one registration (a class with a name, a label, its options and `write`)
is what the CLI (--export-format choices and the format's own options), the Export page (its format
list, label and option widgets) and the export entry point read. A toy format registered here once
shows up in all of them and writes through the same atomic folder as every format."""
import json

import numpy as np
import pytest

from analysis import cli
from analysis.compress import export as export_mod
from analysis.compress.export import FORMATS, ExportFormat, FormatOption, export_to
from analysis.core.errors import InputError
from tests._apptools import fresh_caches, new_app, no_exception, out_root, tiny_dir  # noqa: F401
from tests._tiny import tiny_model


class ToyFormat(ExportFormat):
    """kept.txt: one line per layer listing its kept heads, with a greeting in front."""
    name = "toy-format-test"
    label = "Toy format (registry test)"
    help = "a text file of the kept heads"
    physical = False
    options = {"greeting": FormatOption("hello", ("hello", "bonjour"), "first word of every line")}

    def write(self, model, pruned, folder, *, kv_policy="auto", rounds=None, greeting="hello", **options):
        kept = [np.flatnonzero(~row).tolist() for row in np.asarray(pruned, bool)]
        (folder / "kept.txt").write_text("".join(f"{greeting} {row}\n" for row in kept))
        return None


@pytest.fixture
def toy():
    export_mod.register_format(ToyFormat)
    try:
        yield ToyFormat
    finally:
        FORMATS.pop(ToyFormat.name)


def _export_actions(parser):
    sub = next(a for a in parser._actions if a.dest == "command").choices["export"]
    return {a.dest: a for a in sub._actions}


def test_a_registered_format_is_a_cli_choice_with_its_option(toy):
    actions = _export_actions(cli.build_parser())
    assert toy.name in actions["export_format"].choices
    assert actions["format_greeting"].option_strings == ["--greeting"]
    assert tuple(actions["format_greeting"].choices) == ("hello", "bonjour")


def test_the_cli_exports_with_a_registered_format(toy, tiny_dir, tmp_path, capsys):
    code = cli.main(["export", "--model", str(tiny_dir), "--sparsity", "0.5", "--export-format", toy.name,
                     "--greeting", "bonjour", "--out-dir", str(tmp_path), "--name", "toy", "--quiet"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["format"] == toy.name
    lines = (tmp_path / "toy" / "kept.txt").read_text().splitlines()
    record = json.loads((tmp_path / "toy" / "mask.json").read_text())
    assert lines == [f"bonjour {row}" for row in record["kept"]]
    assert sum(len(row) for row in record["kept"]) == 8          # 16 heads, half kept


def test_an_option_of_another_format_is_refused(toy, tiny_dir, tmp_path, capsys):
    code = cli.main(["export", "--model", str(tiny_dir), "--sparsity", "0.5", "--export-format", "pruned",
                     "--greeting", "hello", "--out-dir", str(tmp_path), "--name", "x", "--quiet"])
    assert code == 2 and "--greeting is an option of another export format" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_entry_point_checks_options_and_writes_atomically(toy, tmp_path):
    model = tiny_model("llama")
    g = model.config
    pruned = np.zeros((g.num_hidden_layers, g.num_attention_heads), bool)
    pruned[0, :2] = True
    with pytest.raises(InputError, match="greeting must be one of hello, bonjour"):
        export_to(toy.name, model, pruned, tmp_path / "bad", greeting="hi")
    with pytest.raises(InputError, match="has no option 'colour'"):
        export_to(toy.name, model, pruned, tmp_path / "bad", colour="red")
    assert list(tmp_path.iterdir()) == []                       # nothing half-written
    result = export_to(toy.name, model, pruned, tmp_path / "ok")
    assert result.format == toy.name and set(result.files) == {"kept.txt", "mask.json"}
    assert (tmp_path / "ok" / "kept.txt").read_text().splitlines()[0] == f"hello {list(range(2, pruned.shape[1]))}"


@pytest.mark.usefixtures("fresh_caches")
def test_a_registered_format_is_on_the_export_page_with_its_option(toy, tiny_dir, out_root):
    at = new_app(tiny_dir, page="export", sparsity="0.5")
    no_exception(at)
    box = at.selectbox(key="hs.w.export.format")
    assert toy.name in box.options or toy.label in box.options
    box.set_value(toy.name).run()
    at.selectbox(key="hs.w.export.opt.toy-format-test.greeting").set_value("bonjour").run()
    at.text_input(key="hs.w.export.folder").set_value("from-page").run()
    at.button(key="export.run").click().run()
    no_exception(at)
    assert not at.error
    assert (out_root / "from-page" / "kept.txt").read_text().startswith("bonjour ")
