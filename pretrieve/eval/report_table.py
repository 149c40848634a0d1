"""A report table as the report writes it: markdown (the page printed and OUT/<name>.md) and OUT/<name>.csv."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from pretrieve.eval.report_html import cell_text
from pretrieve.utils.run_dir import write_atomic


def write_table(out: Path, name: str, rows: list[list]) -> str:
    """OUT/NAME.md and OUT/NAME.csv of `rows` (the first the header); returns the markdown."""
    md = "\n".join(["| " + " | ".join(map(cell_text, row)) + " |" for row in rows[:1]]
                   + ["|" + "---|" * len(rows[0])]
                   + ["| " + " | ".join(map(cell_text, row)) + " |" for row in rows[1:]])
    write_atomic(out / f"{name}.md", md + "\n")
    text = io.StringIO()
    csv.writer(text).writerows([["" if v is None else v for v in row] for row in rows])
    write_atomic(out / f"{name}.csv", text.getvalue())
    return md
