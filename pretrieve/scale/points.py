"""A scaling study's points, per method: from a CSV file or from the study's MLflow runs.

CSV: a header with `N`, `D`, `loss` and optionally `C` (training FLOPs; default 6 N D), `method` (default: one
method named `all`) and `metric` (a downstream metric such as NDCG@10; empty cells allowed).

MLflow (docs/design.md, "Validation and study metrics"): a point is a child run of the study's parent run, tagged
`N` (non-embedding parameters), `N_total`, `D` (training tokens seen), `C` (training FLOPs), `method`, `seed`,
`size`, with the final `val_loss` as a metric. The downstream metric (MLflow name, e.g. `ndcg_at_10`: MLflow
rejects '@', tracking.metric_name) is the point run's own metric when it has one, else the mean over the
evaluation runs `pretrieve farm` nested under it (tag `pretrieve.farm = eval`, optionally one dataset / stage).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pretrieve.utils.metric_names import metric_name

DEFAULT_METHOD = "all"
FLOPS_PER_PARAMETER_TOKEN = 6.0  # C = 6 N D (Kaplan et al. 2020, sec. 2.1) when a point has no C


@dataclass
class Points:
    method: str
    N: np.ndarray
    D: np.ndarray
    C: np.ndarray
    loss: np.ndarray
    metric: np.ndarray | None = None  # NaN where a point has none
    metric_name: str | None = None
    labels: list[str] = field(default_factory=list)  # where each point came from (CSV line, MLflow run)

    def subset(self, keep: np.ndarray) -> "Points":
        keep = np.asarray(keep)
        indices = np.flatnonzero(keep) if keep.dtype == bool else keep
        return Points(self.method, self.N[keep], self.D[keep], self.C[keep], self.loss[keep],
                      None if self.metric is None else self.metric[keep], self.metric_name,
                      [self.labels[i] for i in indices] if self.labels else [])


def _points(method: str, rows: list[dict], metric: str | None) -> Points:
    column = lambda key: np.array([r[key] for r in rows], dtype=float)  # noqa: E731
    values = column("metric") if metric and any(not math.isnan(r["metric"]) for r in rows) else None
    return Points(method, column("N"), column("D"), column("C"), column("loss"), values,
                  metric if values is not None else None, [r["label"] for r in rows])


def _positive(value: str, where: str, key: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{where}: {key} = {value!r} is not a number") from None
    if not (number > 0 and math.isfinite(number)):
        raise ValueError(f"{where}: {key} = {value!r}; it must be a positive number")
    return number


def read_points_csv(path: str | Path) -> dict[str, Points]:
    """{method: Points} from a CSV with columns N, D, loss [, C, method, metric]."""
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in reader.fieldnames or []]
        missing = [c for c in ("N", "D", "loss") if c not in columns]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} (columns: {', '.join(columns)}); "
                             "a points CSV needs N, D, loss and may add C, method, metric")
        by_method: dict[str, list[dict]] = {}
        for line, raw in enumerate(reader, start=2):
            row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
            if not any(row.values()):
                continue
            where = f"{path}:{line}"
            point = {key: _positive(row[key], where, key) for key in ("N", "D", "loss")}
            point["C"] = _positive(row["C"], where, "C") if row.get("C") else \
                FLOPS_PER_PARAMETER_TOKEN * point["N"] * point["D"]
            point["metric"] = float(row["metric"]) if row.get("metric") else math.nan
            point["label"] = where
            by_method.setdefault(row.get("method") or DEFAULT_METHOD, []).append(point)
    if not by_method:
        raise ValueError(f"{path}: no points (a header and no rows)")
    metric = "metric" if "metric" in columns else None
    return {method: _points(method, rows, metric) for method, rows in sorted(by_method.items())}


def read_points_mlflow(uri: str, parent_run_id: str, metric: str | None = None, dataset: str | None = None,
                       stage: str | None = None) -> tuple[dict[str, Points], dict[str, int]]:
    """({method: Points}, {reason: count of child runs skipped}) from the child runs of `parent_run_id`."""
    from pretrieve.utils.mlflow_store import mlflow_client

    client = mlflow_client(uri)
    parent = client.get_run(parent_run_id)
    experiment = parent.info.experiment_id
    metric_key = metric_name(metric) if metric else None
    children = _children(client, experiment, parent_run_id)
    by_method: dict[str, list[dict]] = {}
    skipped: dict[str, int] = {}
    for run in children:
        tags, metrics = run.data.tags, run.data.metrics
        if tags.get("pretrieve.farm") == "eval":
            continue  # an evaluation nested directly under the study, not a point
        reason = _unusable(run)
        if reason:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        where = f"{uri}: run {run.info.run_id} ({run.info.run_name})"
        N, D = _positive(tags["N"], where, "tag N"), _positive(tags["D"], where, "tag D")
        point = {"N": N, "D": D, "loss": _positive(str(metrics["val_loss"]), where, "val_loss"),
                 "C": _positive(tags["C"], where, "tag C") if tags.get("C") else FLOPS_PER_PARAMETER_TOKEN * N * D,
                 "metric": math.nan, "label": run.info.run_name or run.info.run_id}
        if metric_key:
            point["metric"] = metrics.get(metric_key, math.nan)
            if math.isnan(point["metric"]):
                point["metric"] = _evaluated(client, experiment, run.info.run_id, metric_key, dataset, stage)
        by_method.setdefault(tags.get("method") or DEFAULT_METHOD, []).append(point)
    if not by_method:
        raise ValueError(f"{uri}: run {parent_run_id} has no usable child runs (skipped: {skipped or 'none'}); a "
                         "point is a FINISHED child run tagged N, D with a val_loss metric")
    return {m: _points(m, rows, metric_key) for m, rows in sorted(by_method.items())}, skipped


def _children(client, experiment: str, parent_run_id: str) -> list:
    return client.search_runs([experiment], filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              max_results=50000)


def _unusable(run) -> str | None:
    if run.info.status != "FINISHED":
        return f"status {run.info.status}"
    if "val_loss" not in run.data.metrics:
        return "no val_loss"
    missing = [t for t in ("N", "D") if not run.data.tags.get(t)]
    return f"no tag {', '.join(missing)}" if missing else None


def _evaluated(client, experiment, run_id, key, dataset, stage) -> float:
    """The mean of `key` over the farm's evaluation runs under `run_id` (latest per dataset x stage)."""
    latest: dict[tuple, tuple] = {}
    for run in _children(client, experiment, run_id):
        tags = run.data.tags
        if tags.get("pretrieve.farm") != "eval" or key not in run.data.metrics:
            continue
        if (dataset and tags.get("dataset") != dataset) or (stage and tags.get("stage") != stage):
            continue
        slot = (tags.get("dataset"), tags.get("stage"))
        if slot not in latest or run.info.start_time > latest[slot][0]:
            latest[slot] = (run.info.start_time, run.data.metrics[key])
    return float(np.mean([v for _, v in latest.values()])) if latest else math.nan
