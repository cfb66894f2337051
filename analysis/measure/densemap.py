"""Dense's map: the dense model's score on every long-context task at every length, and the test set it defines.

A plan's verdict means something only where the dense model itself succeeds (DESIGN 2b-bis): the test set is the
(task, length) cells where dense scores at least `PASS` on at least `MIN_ROWS` rows; a task dense fails at every
length is listed as such and never averaged in. The map is measured once (bench/bench_ruler_map.py, the dense
side of each cell kept in analysis.core.store) and kept as JSON (docs/data/ruler_dense_map.json); the Long
context page and docs/results.md draw it as a task x length heatmap.

Shapes: `DenseMap.grid()` is (tasks, lengths, scores [n_tasks, n_lengths] with NaN where a cell is not measured).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from analysis.core.errors import InputError

PASS = 0.8                   # dense's score a cell needs to be in the test set
MIN_ROWS = 25                # rows a cell needs to be in the test set (fewer: too few to separate a loss)


@dataclass(frozen=True)
class DenseCell:
    """Dense's score on one (task, length) cell: mean over rows with its 95 % bootstrap CI, the rows, the split."""
    task: str
    length: int
    score: float
    low: float
    high: float
    n: int
    seconds: float | None = None
    split: str = "test"

    @property
    def passes(self) -> bool:
        return self.score >= PASS and self.n >= MIN_ROWS

    @classmethod
    def of_ruler(cls, cell, split: str, seconds: float | None = None) -> "DenseCell":
        """Dense's side of a RULER report's cell (analysis.measure.ruler.RulerCell) as a map cell."""
        return cls(cell.task, cell.length, cell.dense["score"], cell.dense["low"], cell.dense["high"], cell.n,
                   seconds, split)


@dataclass
class DenseMap:
    """Every measured cell of one model (`model`), keyed by (task, length)."""
    model: str
    cells: dict = field(default_factory=dict)          # (task, length) -> DenseCell
    notes: list = field(default_factory=list)

    def add(self, cell: DenseCell) -> None:
        self.cells[cell.task, int(cell.length)] = cell

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(t for t, _ in self.cells))

    @property
    def lengths(self) -> list[int]:
        return sorted({n for _, n in self.cells})

    def test_set(self) -> list[tuple[str, int]]:
        """The (task, length) cells a verdict reads: dense >= PASS on >= MIN_ROWS rows, in map order."""
        return [key for key, cell in self.cells.items() if cell.passes]

    def failed_tasks(self) -> list[str]:
        """Tasks dense passes at no measured length (listed, never averaged in)."""
        return [t for t in self.tasks if not any(c.passes for (task, _), c in self.cells.items() if task == t)]

    def check_test_cells(self, cells) -> list[tuple[str, int]]:
        """`cells` ((task, length) pairs) when every one is in the test set; InputError (one line) naming the
        first that is not: dense never passes it, or it is not measured."""
        out = []
        for task, length in cells:
            cell = self.cells.get((task, int(length)))
            if cell is None:
                raise InputError(f"Dense's score on {task} at {length:,} tokens is not measured; measure dense's map "
                                 f"first (bench/bench_ruler_map.py) or pick a measured cell.")
            if not cell.passes:
                raise InputError(f"Dense scores {cell.score:.2f} on {task} at {length:,} tokens ({cell.n} rows): below "
                                 f"{PASS} on {MIN_ROWS} rows, so no loss can show there; it is not a test cell.")
            out.append((task, int(length)))
        return out

    def grid(self) -> tuple[list[str], list[int], np.ndarray]:
        """(tasks, lengths, scores [n_tasks, n_lengths]; NaN where a cell is not measured)."""
        tasks, lengths = self.tasks, self.lengths
        scores = np.full((len(tasks), len(lengths)), np.nan)
        for (task, length), cell in self.cells.items():
            scores[tasks.index(task), lengths.index(length)] = cell.score
        return tasks, lengths, scores

    def as_dict(self) -> dict:
        return dict(model=self.model, pass_score=PASS, min_rows=MIN_ROWS, notes=list(self.notes),
                    cells=[vars(c) | dict(passes=c.passes) for c in self.cells.values()])

    @classmethod
    def from_dict(cls, data: dict) -> "DenseMap":
        try:
            out = cls(str(data["model"]), notes=list(data.get("notes", [])))
            for c in data["cells"]:
                out.add(DenseCell(str(c["task"]), int(c["length"]), float(c["score"]), float(c["low"]),
                                  float(c["high"]), int(c["n"]), c.get("seconds"), str(c.get("split", "test"))))
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"Not a dense map (task x length cells): {err}.") from None
        return out

    def write(self, path) -> None:
        """The map as JSON at `path`, written atomically (never half a file)."""
        from analysis.core.atomic import atomic_write
        atomic_write(path, json.dumps(self.as_dict(), indent=1), what="The dense map")

    @classmethod
    def read(cls, path) -> "DenseMap":
        try:
            return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError) as err:
            raise InputError(f"Cannot read the dense map {path}: {err}.") from None

    def markdown(self) -> str:
        """The map as a table: a row per task, a column per length, test cells in bold, unmeasured '-'."""
        tasks, lengths, _ = self.grid()
        head = "| task | " + " | ".join(f"{n:,}" for n in lengths) + " |"
        lines = [head, "|---|" + "---:|" * len(lengths)]
        for t in tasks:
            row = []
            for n in lengths:
                c = self.cells.get((t, n))
                text = "-" if c is None else f"{c.score:.2f} [{c.low:.2f}, {c.high:.2f}] ({c.n})"
                row.append(f"**{text}**" if c is not None and c.passes else text)
            lines.append(f"| {t} | " + " | ".join(row) + " |")
        failed = self.failed_tasks()
        lines += ["", f"Test set (dense >= {PASS} on >= {MIN_ROWS} rows, bold): {len(self.test_set())} of "
                      f"{len(self.cells)} cells. Dense fails at every measured length: "
                      + (", ".join(failed) if failed else "none") + " (listed, never averaged in)."]
        return "\n".join(lines)


__all__ = ["PASS", "MIN_ROWS", "DenseCell", "DenseMap"]
