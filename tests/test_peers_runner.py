"""The kvpress peer runner's own logic (bench/peers/kvpress_ruler.py), without kvpress: the runner imports only
the standard library at its top, so its scoring, stop strings, row checks and settings are tested here; the
presses themselves run in the peers environment (docs/PEERS.md).

- RULER's string_match_all, row by row: the share of references contained, case-insensitive, after kvpress's
  strip of control characters;
- an answer is cut at the first stop string;
- a malformed row, an unknown press or a ratio out of (0, 1) is one line (exit 2), nothing written.
"""
from __future__ import annotations

import json

import pytest

from bench.peers import kvpress_ruler as runner

ROW = dict(task="niah_single_1", length=512, index=0, context_ids=[1, 2, 3], question_ids=[4, 5],
           references=["7463343"], max_new_tokens=8, until=["\n"])


def test_string_match_all_is_rulers_rule():
    assert runner.string_match_all(" 7463343.", ["7463343"]) == 1.0
    assert runner.string_match_all("The Numbers: ABC and 12", ["abc", "13"]) == 0.5
    assert runner.string_match_all("none here", ["x", "y", "z"]) == 0.0
    assert runner.string_match_all("74633\x0043", ["7463343"]) == 1.0            # control characters dropped


def test_answers_stop_at_the_first_stop_string():
    assert runner.cut_at("12, 13\nmore. end", ["\n", "."]) == ("12, 13", True)
    assert runner.cut_at("no stop", ["\n", ""]) == ("no stop", False)


def _rows_file(tmp_path, *rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


BAD_ROWS = {
    "no references": ({**ROW, "references": []}, "at least one reference"),
    "ids as text": ({**ROW, "context_ids": "1 2 3"}, "context_ids must be a list"),
    "a negative id": ({**ROW, "question_ids": [4, -1]}, "question_ids must be a non-empty list of token ids"),
    "a bool for a count": ({**ROW, "max_new_tokens": True}, "max_new_tokens must be a whole number"),
    "stop strings as numbers": ({**ROW, "until": [1]}, "until must be a list of strings"),
    "no task": ({k: v for k, v in ROW.items() if k != "task"}, "task must be a string"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_malformed_rows_are_one_line(tmp_path, case, capsys):
    row, words = BAD_ROWS[case]
    out = tmp_path / "out.json"
    code = runner.main(["--rows", _rows_file(tmp_path, ROW, row), "--model-dir", str(tmp_path), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "line 2" in err[0] and words in err[0]
    assert not out.exists()


def test_rows_read_back_and_stop_at_the_limit(tmp_path):
    rows = runner.read_rows(_rows_file(tmp_path, ROW, {**ROW, "index": 1}, {**ROW, "index": 2}), limit=2)
    assert [r.index for r in rows] == [0, 1] and rows[0].references == ["7463343"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(runner.Refused, match="line 1: not a JSON object"):
        runner.read_rows(str(tmp_path / "bad.jsonl"), None)


def test_settings_are_checked_before_any_work(tmp_path):
    def settings(*argv):
        return runner.settings_of(runner.parse(["--rows", "r", "--model-dir", "m", "--out", "o", *argv]))
    names = [s.name for s in settings("--ratios", "0.25,0.5", "--duo", str(tmp_path / "plan"))]
    assert names == ["none", "streaming@0.25", "streaming@0.5", "snapkv@0.25", "snapkv@0.5", "expected@0.25",
                     "expected@0.5", "duo:plan"]
    with pytest.raises(runner.Refused, match="unknown tova"):
        settings("--presses", "none,tova")
    aware = settings("--presses", "snapkv+q,knorm", "--ratios", "0.5")
    assert [(s.name, s.press, s.query_aware) for s in aware] == [("snapkv+q@0.5", "snapkv", True),
                                                                 ("knorm@0.5", "knorm", False)]
    with pytest.raises(runner.Refused, match="above 0 and below 1"):
        settings("--ratios", "0.5,1")
