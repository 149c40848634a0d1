"""The report as one HTML page: every metric's table and plot together, readable without a server.

The PNGs are embedded (base64 data URIs), so the page stays whole when it is copied, mailed or opened from an
MLflow artifact view.
"""

from __future__ import annotations

import base64
import html
import time
from pathlib import Path

from pretrieve.utils.run_dir import write_atomic

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1em}th,td{border:1px solid #ccc;padding:4px 10px}
td.num{text-align:right;font-variant-numeric:tabular-nums}th{background:#f3f3f3}
tr td:last-child{font-weight:bold}img{max-width:100%}small{color:#666}"""


def cell_text(value) -> str:
    """A table cell as the markdown and HTML tables show it."""
    return "–" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)


def _table(rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in rows[0])
    body = "".join("<tr>" + "".join(
        f'<td class="num">{cell_text(v)}</td>' if i and not isinstance(v, str)
        else f"<td>{html.escape(cell_text(v))}</td>"
        for i, v in enumerate(row)) + "</tr>\n" for row in rows[1:])
    return f"<table>\n<tr>{head}</tr>\n{body}</table>"


def _image(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def write_html(path: Path, metric_tables: dict[str, list[list]], plots: dict[str, Path], source: str,
               steps: tuple[str, list[list], Path | None] | None = None) -> None:
    """`metric_tables`: {metric: rows, the first the header}; `plots`: {metric: PNG path}; `steps`: (title, rows,
    PNG path or None) of the followed runs' evaluations against step, or None."""
    sections = [f"<h2>{html.escape(metric)}</h2>\n{_table(rows)}\n"
                + (_image(plots[metric], f"{metric} by dataset") if metric in plots else "")
                for metric, rows in metric_tables.items()]
    if steps is not None:
        title, rows, plot = steps
        sections.append(f"<h2>{html.escape(title)}</h2>\n" + (_image(plot, title) + "\n" if plot else "")
                        + _table(rows) + "\n")
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>pretrieve report</title>"
            f"<style>{STYLE}</style></head><body>\n<h1>pretrieve report</h1>\n"
            f"<p><small>evaluation runs in {html.escape(source)}; rows: checkpoints, columns: datasets, "
            f"last column: the mean; written {time.strftime('%Y-%m-%d %H:%M:%S')}</small></p>\n"
            + "\n".join(sections) + "\n</body></html>\n")
    write_atomic(path, page)
