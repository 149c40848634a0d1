"""`pretrieve report`: the evaluation runs in MLflow as comparison tables and plots.

Rows are checkpoints (a Matryoshka checkpoint once per dimension its vectors were cut to), columns datasets (and stage, when there is more than one), one table per metric; the
last column is the mean over datasets. Writes OUT/<metric>.md, OUT/<metric>.csv and OUT/<metric>.png (grouped
bars; left out when matplotlib, the `plots` extra, is not installed), OUT/report.html (every table and plot on
one self-contained page: the plots are embedded, so the file opens anywhere without a server), and prints the
markdown. When a checkpoint x dataset x stage was evaluated
more than once, the latest run counts. The evaluations of a followed pre-training run's checkpoints (`pretrieve
farm --follow`, tagged `step`) are not rows of these tables: they make OUT/steps.md, .csv and .png, the metric
against training step beside the run's loss (eval.report_steps). The report is also logged to MLflow: a run
named `report` (tag `pretrieve.report`) in the experiment of the latest evaluation run, with OUT's files as
artifacts; its id is written to OUT/mlflow.json. Each report is a new run, so earlier ones stay as they were. Evaluations made
outside the farm join the tables once `pretrieve track` has logged their folders (eval.track).
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.eval.report_html import write_html
from pretrieve.eval.report_steps import STEP_FILES, write_steps
from pretrieve.eval.report_table import write_table
from pretrieve.optional import MATPLOTLIB, available
from pretrieve.utils.metric_names import metric_name
from pretrieve.utils.output_folder import check_own_entries
from pretrieve.utils.run_dir import write_atomic

DEFAULT_METRICS = ("ndcg@10", "mrr@10", "recall@100")


def collect(uri: str, experiments: list[str] | None = None) -> list[dict]:
    """One record per evaluation run: checkpoint, dataset, stage, start time, metrics (MLflow names); and for a
    followed run's checkpoint its step, follow name and pre-training run (`parent`), else step None."""
    from pretrieve.utils.mlflow_store import mlflow_client

    client = mlflow_client(uri)
    found = client.search_experiments()
    ids = [e.experiment_id for e in found if experiments is None or e.name in experiments]
    if experiments and len(ids) < len(experiments):
        missing = sorted(set(experiments) - {e.name for e in found})
        raise ValueError(f"{uri}: no experiment named {', '.join(missing)}")
    runs = client.search_runs(ids, filter_string="tags.`pretrieve.farm` = 'eval'", max_results=50000) if ids else []
    return [{"checkpoint": _checkpoint_label(r.data.tags), "dataset": r.data.tags["dataset"],
             "stage": r.data.tags["stage"], "start": r.info.start_time, "experiment_id": r.info.experiment_id,
             "step": int(r.data.tags["step"]) if r.data.tags.get("step") else None, "follow": r.data.tags.get("follow"),
             "parent": r.data.tags.get("mlflow.parentRunId"), **r.data.metrics} for r in runs]


def _checkpoint_label(tags: dict) -> str:
    """A row's name: the checkpoint, and the dimension its vectors were cut to (`dim`, the farm's `dims:`)."""
    return f"{tags['checkpoint']} (dim {tags['dim']})" if tags.get("dim") else tags["checkpoint"]


def evaluations_of(uri: str, model_dir: str | Path, run_id: str | None = None) -> list[dict]:
    """The evaluations of one model, the latest per (dataset, stage, MTEB or not, dimension), by dataset,
    zero-shot first: the runs tagged with its directory (`model_dir`, the farm's and `track`'s tag) and, when
    `run_id` is its pre-training run, the runs nested under it (the checkpoint zero-shot, and fine-tuned by the
    farm's stages). Each record: dataset, stage, split, mteb (scored by MTEB), mteb_local (a BEIR folder among
    MTEB's tasks: no MTEB dataset of that name), dim (the prefix the vectors were cut to; None: the whole
    vector, a farm's `dims:` entry at the model's width included), this_model (False: a model fine-tuned from
    it), logged_by (`pretrieve farm` or `pretrieve track`), run_id, start (ms), metrics ({MLflow name:
    value})."""
    from pretrieve.utils.mlflow_store import mlflow_client

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return []  # no store there (yet): nothing evaluated, and no empty database made
    client = mlflow_client(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, filter_string="tags.`pretrieve.farm` = 'eval'", max_results=50000) if ids else []
    here = str(Path(model_dir).resolve())
    config = Path(model_dir) / "config.json"
    width = json.loads(config.read_text()).get("hidden_size") if config.is_file() else None
    latest: dict[tuple, dict] = {}
    for r in sorted(runs, key=lambda r: r.info.start_time):
        tags, params = r.data.tags, r.data.params
        if tags.get("step"):  # a checkpoint of the run on its way (farm --follow), not the model it exported
            continue
        dim = int(tags["dim"]) if tags.get("dim") else None
        dim = None if dim is not None and width is not None and dim >= width else dim
        nested = run_id is not None and tags.get("mlflow.parentRunId") == run_id
        zero_shot = tags.get("stage") == "zero-shot"
        # runs logged before the farm tagged model_dir: a nested zero-shot run evaluated the checkpoint itself
        this_model = tags.get("model_dir") == here or ("model_dir" not in tags and nested and zero_shot)
        if this_model or (nested and not zero_shot):
            mteb = params.get("retriever") == "mteb"  # scored by the mteb package (eval --mteb)
            latest[(tags["dataset"], tags["stage"], mteb, dim)] = {
                "dataset": tags["dataset"], "stage": tags["stage"], "split": params.get("split"), "mteb": mteb,
                "mteb_local": params.get("mteb_local") == "True", "dim": dim, "this_model": this_model,
                "logged_by": tags.get("logged_by", "pretrieve farm"), "run_id": r.info.run_id,
                "start": r.info.start_time, "metrics": dict(r.data.metrics)}
    return sorted(latest.values(), key=lambda e: (e["dataset"], e["stage"] != "zero-shot", e["stage"], e["mteb"],
                                                  -(e["dim"] or float("inf"))))


def tables(records: list[dict], metrics=DEFAULT_METRICS) -> dict[str, list[list]]:
    """{metric: rows}; the first row is the header."""
    latest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r["start"]):
        latest[(r["checkpoint"], r["dataset"], r["stage"])] = r
    stages = sorted({k[2] for k in latest})
    columns = sorted({(k[1], k[2]) for k in latest})
    checkpoints = sorted({k[0] for k in latest})
    out = {}
    for metric in metrics:
        key = metric_name(metric)
        header = ["checkpoint"] + [d if len(stages) == 1 else f"{d} ({s})" for d, s in columns] + ["mean"]
        rows = [header]
        for checkpoint in checkpoints:
            values = [latest.get((checkpoint, d, s), {}).get(key) for d, s in columns]
            present = [v for v in values if v is not None]
            rows.append([checkpoint, *values, sum(present) / len(present) if present else None])
        out[metric] = rows
    return out


def write_report(uri: str, out: str | Path, experiments: list[str] | None = None, metrics=DEFAULT_METRICS,
                 log_to_mlflow: bool = True) -> str:
    """Write the tables, plots and HTML page (and log them to MLflow); returns the markdown of all tables. OUT
    may hold an earlier report, whose files are replaced; a folder holding anything else is refused."""
    out = Path(out)
    names = {"report.html", "mlflow.json", *STEP_FILES,
             *(f"{m}.{ext}" for m in metrics for ext in ("md", "csv", "png"))}
    check_own_entries(out, "pretrieve report", lambda name: name.removeprefix(".").removesuffix(".tmp") in names,
                      earlier=lambda folder: (folder / "report.html").is_file())
    records = collect(uri, experiments)
    if not records:
        raise ValueError(f"{uri}: no evaluation runs (run `pretrieve farm`, or log `pretrieve eval` folders with "
                         "`pretrieve track`)")
    out.mkdir(parents=True, exist_ok=True)
    markdown = []
    checkpoints = [r for r in records if r["step"] is None]
    metric_tables = tables(checkpoints, metrics) if checkpoints else {}
    plots = available(MATPLOTLIB, "the report's plots")
    for metric, rows in metric_tables.items():
        markdown.append(f"### {metric}\n\n{write_table(out, metric, rows)}\n")
        if plots:
            _plot(rows, metric, out / f"{metric}.png")
    steps = None
    if len(checkpoints) < len(records):
        from pretrieve.utils.mlflow_store import mlflow_client

        section, rows, plot = write_steps(mlflow_client(uri), [r for r in records if r["step"] is not None], out,
                                          metrics, plots)
        markdown.append(section)
        steps = (f"{metrics[0]} against step", rows, plot)
    write_html(out / "report.html", metric_tables, {m: out / f"{m}.png" for m in metric_tables if plots},
               source=uri, steps=steps)
    if log_to_mlflow:
        _log_report(uri, out, max(records, key=lambda r: r["start"])["experiment_id"])
    return "\n".join(markdown)


def _log_report(uri: str, out: Path, experiment_id: str) -> str:
    """A new `report` run holding OUT's files as artifacts; its id goes to OUT/mlflow.json."""
    from pretrieve.utils.mlflow_store import mlflow_client

    client = mlflow_client(uri)
    run_id = client.create_run(experiment_id, run_name="report", tags={"pretrieve.report": "1"}).info.run_id
    for path in sorted(out.iterdir()):
        if path.is_file() and path.name != "mlflow.json" and not path.name.startswith("."):
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id)
    write_atomic(out / "mlflow.json", json.dumps({"tracking_uri": uri, "run_id": run_id}))
    return run_id


def _plot(rows: list[list], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    header, body = rows[0][1:-1], rows[1:]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.9 * len(header) * max(1, len(body))), 3.8))
    width = 0.8 / max(1, len(body))
    for i, row in enumerate(body):
        bars = ax.bar([c + i * width for c in range(len(header))], [v or 0.0 for v in row[1:-1]], width,
                      label=row[0])
        # the values on the bars: a reader compares numbers, not bar heights, when they are close
        ax.bar_label(bars, labels=["–" if v is None else f"{v:.3f}" for v in row[1:-1]], fontsize="small",
                     padding=2)
    ax.set_xticks([c + width * (len(body) - 1) / 2 for c in range(len(header))], header,
                  rotation=20 if len(header) > 3 else 0, ha="right" if len(header) > 3 else "center")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by dataset")
    top = max([v for row in body for v in row[1:-1] if v is not None] or [0.0])
    ax.set_ylim(0, max(top * 1.15, 1e-3))  # room for the value labels
    ax.legend(fontsize="small", title="checkpoint", title_fontsize="small", loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the axes: never over a bar
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
