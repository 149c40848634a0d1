"""`pretrieve scale fit`: read a study's points, fit every method, write what the fit found.

    OUT/fit.json      {"<method>": {"chinchilla": {E, A, B, alpha, beta, ci95, huber_sum, points, ...},
                                    "joint": {...}, "single": {"N": {"fang": .., "kaplan": ..}, "D": ..},
                                    "allocation": {a, b, ci95, source, ...}, "metric": {...}, "holdout": {...}}}
    OUT/fit.md        the parameters, intervals and errors as markdown tables
    OUT/points.csv    every point with the laws' predictions and residuals
    OUT/*.png         pretrieve/scale/plots.py (left out when matplotlib, the `plots` extra, is not installed)

From a STUDY.yaml the outputs are also logged as artifacts (folder `scale_fit`) of the study's parent run.
Non-finite numbers are written as null: fit.json stays strict JSON.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from pretrieve.optional import MATPLOTLIB, available
from pretrieve.scale.fit import MetricFit, MethodFit, fit_method
from pretrieve.scale.plots import write_plots
from pretrieve.scale.points import read_points_csv, read_points_mlflow
from pretrieve.scale.study import load_study, parent_run_id
from pretrieve.utils.run_dir import write_atomic

ARTIFACT_FOLDER = "scale_fit"


def run_fit(out: str | Path, study: str | None = None, points_csv: str | None = None, bootstrap: int = 1000,
            holdout: str | None = None, seed: int = 0) -> dict:
    """Fit STUDY.yaml's runs (or a points CSV) into `out`; returns a short summary per method."""
    if (study is None) == (points_csv is None):
        raise ValueError("give a STUDY.yaml or --csv POINTS.csv (one of them)")
    if bootstrap < 0:
        raise ValueError(f"--bootstrap {bootstrap}: must be >= 0")
    parent, skipped = None, {}
    if study is not None:
        spec = load_study(study)
        parent = parent_run_id(spec)
        fit = spec["fit"]
        by_method, skipped = read_points_mlflow(spec["tracking"]["uri"], parent, fit.get("metric"),
                                                fit.get("dataset"), fit.get("stage"))
    else:
        by_method = read_points_csv(points_csv)
    fits = {method: fit_method(points, bootstrap, holdout, seed) for method, points in by_method.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(fits, out, source=study or points_csv, bootstrap=bootstrap, skipped=skipped)
    if parent is not None:
        from pretrieve.utils.mlflow_store import mlflow_client

        mlflow_client(spec["tracking"]["uri"]).log_artifacts(parent, str(out), ARTIFACT_FOLDER)
    return {"out": str(out), "parent_run_id": parent, "skipped_runs": skipped,
            "methods": {m: _headline(f) for m, f in fits.items()}}


def _headline(fit: MethodFit) -> dict:
    c, alloc = fit.chinchilla.parameters, fit.allocation
    line = {"points": len(fit.points.loss), "alpha": c["alpha"], "beta": c["beta"], "a": alloc["a"],
            "b": alloc["b"], "allocation_from": alloc["source"]}
    if fit.holdout:
        line["holdout_mean_abs_rel_error"] = fit.holdout["chinchilla"]["mean_abs_rel_error"]
    return line


def _strict(value):
    """NaN / inf -> None, numpy scalars -> Python, recursively."""
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def write_outputs(fits: dict[str, MethodFit], out: Path, source: str, bootstrap: int, skipped: dict) -> None:
    write_atomic(out / "fit.json", json.dumps(_strict({m: f.to_json() for m, f in fits.items()}), indent=1) + "\n")
    write_atomic(out / "fit.md", markdown(fits, source, bootstrap, skipped))
    write_atomic(out / "points.csv", points_table(fits))
    if available(MATPLOTLIB, "the fit's plots"):
        for fit in fits.values():
            write_plots(fit, out)


def points_table(fits: dict[str, MethodFit]) -> str:
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["method", "label", "N", "D", "C", "loss", "chinchilla", "joint", "chinchilla_log_residual",
                     "held_out", "metric", "metric_predicted"])
    for method, fit in fits.items():
        p = fit.points
        chinchilla, joint = fit.chinchilla.predict(N=p.N, D=p.D), fit.joint.predict(N=p.N, D=p.D)
        metric = p.metric if p.metric is not None else np.full(len(p.loss), np.nan)
        predicted = fit.metric.predict(chinchilla) if isinstance(fit.metric, MetricFit) else np.full(len(p.loss),
                                                                                                      np.nan)
        held = fit.holdout_mask if fit.holdout_mask is not None else np.zeros(len(p.loss), dtype=bool)
        for i in range(len(p.loss)):
            writer.writerow([method, p.labels[i] if p.labels else "", p.N[i], p.D[i], p.C[i], p.loss[i],
                             chinchilla[i], joint[i], math.log(chinchilla[i] / p.loss[i]), int(held[i]),
                             "" if math.isnan(metric[i]) else metric[i],
                             "" if math.isnan(predicted[i]) else predicted[i]])
    return text.getvalue()


def _value(summary: dict, name: str) -> str:
    value, interval = summary.get(name), summary.get("ci95", {}).get(name)
    text = "–" if value is None else f"{value:.4g}"
    if not interval or None in interval:  # no interval, or resamples that gave no value (a degenerate profile)
        return text
    return f"{text} [{interval[0]:.4g}, {interval[1]:.4g}]"


def _r2(summary: dict) -> str:
    return "–" if summary.get("r2") is None else f"{summary['r2']:.4f}"


def markdown(fits: dict[str, MethodFit], source: str, bootstrap: int, skipped: dict) -> str:
    lines = [f"# Scaling-law fit of {source}", "",
             f"Huber loss (delta 1e-3) on log-loss residuals, L-BFGS-B from a grid of starts; 95 % intervals from "
             f"{bootstrap} bootstrap resamples of the points."]
    if skipped:
        lines += ["", "Runs skipped: " + ", ".join(f"{k}: {v}" for k, v in skipped.items())]
    for method, fit in fits.items():
        summary = _strict(fit.to_json())
        c, j, alloc = summary["chinchilla"], summary["joint"], summary["allocation"]
        lines += ["", f"## {method} ({c['points']} points)", "",
                  "| law | parameters (95 % interval) | Huber sum | RMSE log L | R^2 |", "|---|---|---|---|---|",
                  "| Chinchilla: E + A/N^alpha + B/D^beta | "
                  + ", ".join(f"{n} = {_value(c, n)}" for n in ("E", "A", "B", "alpha", "beta"))
                  + f" | {c['huber_sum']:.3g} | {c['rmse_log']:.3g} | {_r2(c)} |",
                  "| joint: [(A/N)^(alpha/beta) + B/D]^beta + delta | "
                  + ", ".join(f"{n} = {_value(j, n)}" for n in ("A", "B", "alpha", "beta", "delta"))
                  + f" | {j['huber_sum']:.3g} | {j['rmse_log']:.3g} | {_r2(j)} |"]
        for variable, forms in summary["single"].items():
            for form, law in forms.items():
                if "skipped" in law:
                    lines.append(f"| {form} in {variable} | skipped: {law['skipped']} | | | |")
                else:
                    names = [n for n in ("A", "B", "alpha", "delta") if n in law]
                    lines.append(f"| {form} in {variable} (frontier) | "
                                 + ", ".join(f"{n} = {_value(law, n)}" for n in names)
                                 + f" | {law['huber_sum']:.3g} | {law['rmse_log']:.3g} | |")
        implied = alloc["chinchilla"]
        lines += ["", f"Compute-optimal allocation N_opt ~ C^a, D_opt ~ C^b from {alloc['source']} "
                      f"({alloc['budgets']} IsoFLOP budget(s)): a = {_value(alloc, 'a')}, b = {_value(alloc, 'b')}; "
                      f"the Chinchilla law implies a = {_value(implied, 'a')}, b = {_value(implied, 'b')}."]
        metric = summary.get("metric")
        if metric and "skipped" not in metric:
            lines += ["", f"{metric['name']} = s / (1 + exp(-k (L - L0))) + m: s = {metric['s']:.4g}, "
                          f"k = {metric['k']:.4g}, L0 = {metric['L0']:.4g}, m = {metric['m']:.4g}; "
                          f"RMSE {metric['rmse']:.3g} over {metric['points']} points."]
        elif metric:
            lines += ["", f"Metric: skipped: {metric['skipped']}"]
        holdout = summary.get("holdout")
        if holdout:
            lines += ["", f"Held out: the {holdout['held_out']} point(s) of the largest budget (C = "
                          f"{holdout['C']:.3g}), fitted on {holdout['fitted_on']}: mean |relative error| "
                          f"Chinchilla {100 * holdout['chinchilla']['mean_abs_rel_error']:.2f} %, joint "
                          f"{100 * holdout['joint']['mean_abs_rel_error']:.2f} %."]
            if "mean_abs_error" in holdout.get("metric", {}):
                lines[-1] += f" {holdout['metric']['name']}: mean |error| {holdout['metric']['mean_abs_error']:.4f}."
    return "\n".join(lines) + "\n"
