"""Draw the plots of docs/results.md from the tables in it: ``python docs/results/plots.py [OUT_DIR]``.

A table is plotted when the line right above it is a marker comment:

    <!-- plot speedup NAME.png: TITLE -->   a category table (| category | prompts | method ... |, "2.39x"),
                                            each cell the median of per-prompt ratios
    <!-- plot total NAME.png: TITLE -->     the same, each cell a ratio of total tokens/s (a serving run)
    <!-- plot cost NAME.png: TITLE -->      a cost table (| k | 1 | 2 | ... |, one row per machine)

so a plot always shows the numbers printed beside it, in the colours ``freespec bench`` uses for the same
methods (``freespec.bench.report``). Cells that are not numbers ("-") draw nothing; a column whose header
is not a number ("512 (prefill)") is left out of a cost plot.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent.parent / "results.md"
MARKER = re.compile(r"^<!-- plot (speedup|total|cost) (\S+\.png): (.+) -->$")
NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")


def cells(line: str) -> list[str]:
    """``"| a | 1.0 |" -> ["a", "1.0"]``"""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def number(cell: str) -> float | None:
    """The cell's leading number: ``"2.39x" -> 2.39``, ``"1.00 (163.6 ms)" -> 1.0``, ``"-" -> None``."""
    match = NUMBER.match(cell)
    return float(match.group(1)) if match else None


def marked_tables(text: str) -> list[tuple[str, str, str, list[str], list[list[str]]]]:
    """``(kind, file name, title, header, rows)`` for every marked table of ``text``."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        table = []
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                break
            table.append(row)
        if len(table) < 3:
            raise ValueError(f"results.md line {i + 1}: a plot marker must sit right above a table")
        kind, name, title = match.groups()
        found.append((kind, name, title, cells(table[0]), [cells(row) for row in table[2:]]))
    return found


def draw(kind: str, path: Path, title: str, header: list[str], rows: list[list[str]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from freespec.bench.report import plot_category_bars, plot_cost_curves

    if kind in ("speedup", "total"):
        methods = header[2:]
        values = {row[0]: dict(zip(methods, map(number, row[2:]))) for row in rows}
        how = "median per prompt" if kind == "speedup" else "ratio of total tokens/s"
        return plot_category_bars(plt, values, methods, path, f"Speedup over plain decoding by category\n{title}",
                                  f"tokens/s over plain decoding ({how})")
    columns = [(j, int(k)) for j, k in enumerate(header) if k.isdigit()]
    curves = {}
    for row in rows:
        points = [(k, number(row[j])) for j, k in columns if number(row[j]) is not None]
        curves[row[0]] = ([k for k, _ in points], [c for _, c in points])
    return plot_cost_curves(plt, curves, path, title)


def main(out_dir: Path | None = None) -> list[Path]:
    out_dir = out_dir or RESULTS_MD.parent / "results"
    return [draw(kind, out_dir / name, title, header, rows)
            for kind, name, title, header, rows in marked_tables(RESULTS_MD.read_text(encoding="utf-8"))]


if __name__ == "__main__":
    for written in main(Path(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(written)
