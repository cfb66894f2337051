"""Dense's map (analysis/measure/densemap.py): the test set is the cells dense passes on enough rows, a task dense
fails everywhere is listed and never a test cell, asking a cell dense never passes as a test cell is one line, and
the map survives its JSON."""
import json

import numpy as np
import pytest

from analysis.core.errors import InputError
from analysis.measure.densemap import MIN_ROWS, PASS, DenseCell, DenseMap


def _map() -> DenseMap:
    m = DenseMap("tiny")
    for task, length, score, n in (("a", 1024, 1.0, 25), ("a", 2048, PASS, 25), ("b", 1024, 0.96, MIN_ROWS - 1),
                                   ("b", 2048, 0.5, 25), ("c", 1024, 0.2, 25)):
        m.add(DenseCell(task, length, score, max(score - 0.1, 0.0), min(score + 0.1, 1.0), n))
    return m


def test_the_test_set_is_the_cells_dense_passes_on_enough_rows():
    m = _map()
    assert m.test_set() == [("a", 1024), ("a", 2048)]          # b@1024 passes on too few rows to separate a loss
    assert m.failed_tasks() == ["b", "c"]
    tasks, lengths, scores = m.grid()
    assert tasks == ["a", "b", "c"] and lengths == [1024, 2048] and np.isnan(scores[2, 1]) and scores[1, 1] == 0.5
    text = m.markdown()
    assert "**1.00 [0.90, 1.00] (25)**" in text and "2 of 5 cells" in text and "b, c (listed" in text


def test_a_cell_dense_never_passes_or_never_measured_is_refused_in_one_line():
    m = _map()
    assert m.check_test_cells([("a", 2048)]) == [("a", 2048)]
    for cell, words in ((("c", 1024), "no loss can show"), (("b", 1024), "24 rows"), (("a", 4096), "not measured")):
        with pytest.raises(InputError, match=words) as err:
            m.check_test_cells([cell])
        assert "\n" not in str(err.value)


def test_the_map_survives_its_json(tmp_path):
    m = _map()
    path = tmp_path / "map.json"
    path.write_text(json.dumps(m.as_dict()))
    back = DenseMap.read(path)
    assert back.cells == m.cells and back.test_set() == m.test_set()
    path.write_text('{"model": "x", "cells": [{"task": "a"}]}')
    with pytest.raises(InputError, match="Not a dense map"):
        DenseMap.read(path)
    with pytest.raises(InputError, match="Cannot read"):
        DenseMap.read(tmp_path / "missing.json")
