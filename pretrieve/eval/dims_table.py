"""NDCG@10 against the vectors' dimension (`pretrieve eval --dim`, a Matryoshka model's prefixes): the table and
the plot the farm writes for its checkpoints with `dims:`.

A row per checkpoint x dataset x stage, a column per dimension (widest first), each cell the NDCG@10 of that
evaluation's metrics.json, and beside the widest the share each narrower one keeps. OUT/dims.md, OUT/dims.csv,
and OUT/dims.png (NDCG@10 over the dimension on a log2 axis, a line per row; left out without matplotlib, the
`plots` extra), each written whole through a temporary name.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from pretrieve.optional import MATPLOTLIB, available
from pretrieve.utils.run_dir import write_atomic

FILES = ("dims.md", "dims.csv", "dims.png")
METRIC = "ndcg@10"


def dims_rows(evaluations: dict[tuple[str, str, str], dict[int, Path]]) -> list[list]:
    """The table: header, then per (checkpoint, dataset, stage) its NDCG@10 at each dimension (None: not
    evaluated yet), read from {row: {dim: the evaluation's folder}}."""
    dims = sorted({d for by_dim in evaluations.values() for d in by_dim}, reverse=True)
    rows = [["checkpoint", "dataset", "stage", *(str(d) for d in dims)]]
    for (checkpoint, dataset, stage), by_dim in sorted(evaluations.items()):
        values = []
        for dim in dims:
            metrics = by_dim[dim] / "metrics.json" if dim in by_dim else None
            values.append(json.loads(metrics.read_text())[METRIC] if metrics and metrics.is_file() else None)
        rows.append([checkpoint, dataset, stage, *values])
    return rows


def write_dims_table(out: str | Path, evaluations: dict[tuple[str, str, str], dict[int, Path]]) -> str:
    """Write OUT/dims.md, .csv and .png; returns the markdown."""
    out = Path(out)
    rows = dims_rows(evaluations)
    header, body = rows[0], rows[1:]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in body:
        widest = row[3]
        cells = [_cell(v, widest if i else None) for i, v in enumerate(row[3:])]
        lines.append("| " + " | ".join([*row[:3], *cells]) + " |")
    markdown = "\n".join(lines) + "\n"
    write_atomic(out / "dims.md", markdown)
    text = io.StringIO()
    csv.writer(text).writerows([["" if v is None else v for v in row] for row in rows])
    write_atomic(out / "dims.csv", text.getvalue())
    if available(MATPLOTLIB, "the dimension plot"):
        _plot(rows, out / "dims.png")
    return markdown


def _cell(value: float | None, widest: float | None) -> str:
    """NDCG@10 to 4 places; after a narrower one, the share of the widest's it keeps."""
    if value is None:
        return "–"
    if widest:
        return f"{value:.4f} ({100 * value / widest:.0f} %)"
    return f"{value:.4f}"


def _plot(rows: list[list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    dims = [int(d) for d in rows[0][3:]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for row in rows[1:]:
        points = [(d, v) for d, v in zip(dims, row[3:]) if v is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=" / ".join(row[:3]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(dims, [str(d) for d in dims])
    ax.set_xlabel("dimension (the vectors' first N coordinates)")
    ax.set_ylabel(METRIC)
    ax.set_title(f"{METRIC} against dimension")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
