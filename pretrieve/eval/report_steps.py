"""The report's retrieval quality against training step: the evaluations of followed pre-training runs (`pretrieve
farm --follow`, runs tagged `step` and `follow`) as a table, and a plot of the first metric against step beside
each run's training loss (the `loss` history of the MLflow run they are nested under).

OUT/steps.md and OUT/steps.csv: one row per run, dataset, stage and step, with each metric and the training loss
last logged at or before that step; OUT/steps.png: the plot (left out without matplotlib). Where a checkpoint
was evaluated more than once, the latest run counts.
"""

from __future__ import annotations

from pathlib import Path

from pretrieve.eval.report_table import write_table
from pretrieve.utils.metric_names import metric_name

STEP_FILES = ("steps.md", "steps.csv", "steps.png")


def step_rows(records: list[dict], metrics, losses: dict[str, list[tuple[int, float]]]) -> list[list]:
    """Header and rows: run, dataset, stage, step, each metric, the training loss at that step. `records`: the
    followed runs' evaluations (report.collect); `losses`: {pre-training run id: [(step, loss)] ascending}."""
    latest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r["start"]):
        latest[(r["follow"], r["dataset"], r["stage"], r["step"])] = r
    rows = [["run", "dataset", "stage", "step", *metrics, "loss"]]
    for (run, dataset, stage, step), r in sorted(latest.items()):
        before = [value for at, value in losses.get(r["parent"], []) if at <= step]
        rows.append([run, dataset, stage, step, *(r.get(metric_name(m)) for m in metrics),
                     before[-1] if before else None])
    return rows


def training_losses(client, records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{run id: [(step, loss)]} of the pre-training runs the records are nested under, as MLflow has them."""
    parents = sorted({r["parent"] for r in records if r["parent"]})
    return {run_id: sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
            for run_id in parents}


def write_steps(client, records: list[dict], out: Path, metrics, plots: bool) -> tuple[str, list[list], Path | None]:
    """OUT/steps.md, .csv and (`plots`) .png; returns (the markdown section, the table's rows, the plot or None)."""
    losses = training_losses(client, records)
    rows = step_rows(records, metrics, losses)
    md = write_table(out, "steps", rows)
    plot = None
    if plots:
        plot = out / "steps.png"
        names = {r["parent"]: r["follow"] for r in records if r["parent"]}
        _plot(rows, metrics[0], {names[run_id]: points for run_id, points in losses.items() if points}, plot)
    return f"### {metrics[0]} against step\n\n{md}\n", rows, plot


def _plot(rows: list[list], metric: str, losses: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """`metric` against step, a line per run, dataset and stage; beside it each run's training loss."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    column = rows[0].index(metric)
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2 if losses else 1, figsize=(11.0 if losses else 6.0, 3.8), squeeze=False,
                             sharex=True)  # the same steps on both: quality and loss read side by side
    axes[0][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    lines: dict[tuple, list[tuple[int, float]]] = {}
    for row in rows[1:]:
        if row[column] is not None:
            lines.setdefault(tuple(row[:3]), []).append((row[3], row[column]))
    for (run, dataset, stage), points in lines.items():
        axes[0][0].plot(*zip(*points), marker="o", label=f"{run}: {dataset} ({stage})")
    axes[0][0].set(xlabel="training step", ylabel=metric, title=f"{metric} against step")
    axes[0][0].legend(fontsize="small", frameon=False)
    for run, points in losses.items():
        axes[0][1].plot(*zip(*points), label=run)
    if losses:
        axes[0][1].set(xlabel="training step", ylabel="loss", title="training loss")
        axes[0][1].legend(fontsize="small", frameon=False)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
