"""A method study's results file: the statistics of each part with its plots beside the file, the paths in it
written relative to the working directory (so that it reads the same on every machine), the job's record."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from pretrieve.study.data import log, write_atomic
from pretrieve.study.plan import REFERENCES
from pretrieve.study.stats import plot_arms, plot_curve, summarize


def relative_paths(value, root: Path | None = None):
    """`value` with every absolute path inside `root` (default: the working directory) or beside it (the shared
    data) written relative to `root`."""
    root = Path.cwd() if root is None else root
    if isinstance(value, dict):
        return {key: relative_paths(item, root) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_paths(item, root) for item in value]
    if isinstance(value, str) and value.startswith(str(root.parent) + os.sep):
        return os.path.relpath(value, root)
    return value


def write_results(path: Path, results: dict) -> None:
    write_atomic(path, json.dumps(relative_paths(results), indent=1) + "\n")
    log(f"wrote {path}")


def git_commit() -> str | None:
    """The commit of the working directory's checkout, if it is one."""
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def summarized(plan: dict, scores: dict) -> dict:
    boot = plan["bootstrap"]
    return summarize(scores, REFERENCES, boot["resamples"], boot["seed"])


def scale_name(plan: dict) -> str:
    return f"{plan['scale']} scale{', smoke' if plan['smoke'] else ''}"


def general_results(plan: dict, part: dict, results_path: Path) -> dict:
    """The general part's statistics, its plot and the steps curve's, beside the results file."""
    summary = summarized(plan, part.pop("scores"))
    stem = results_path.with_suffix("")
    scale = scale_name(plan)
    plot = plot_arms(summary, Path(f"{stem}-general.png"),
                     f"General pre-training, then the same fine-tuning: NDCG@10 ({scale})")
    curve = part["curve"] and plot_curve(
        part["curve"], Path(f"{stem}-steps.png"),
        f"{plan['curve']['arm']}: NDCG@10 after the same fine-tuning, by pre-training steps ({scale})")
    return {**part, "arms": summary, "plot": plot and str(plot), "curve_plot": curve and str(curve)}


def domain_results(plan: dict, part: dict, results_path: Path) -> dict:
    """Each base's statistics of the domain part, and its plot beside the results file."""
    out = {}
    for base_name, entry in part.items():
        summary = summarized(plan, entry.pop("scores"))
        plot = plot_arms(summary, Path(f"{results_path.with_suffix('')}-domain-{base_name}.png"),
                         f"Domain adaptation from {base_name}: NDCG@10 on each target ({scale_name(plan)})")
        out[base_name] = {**entry, "arms": summary, "plot": plot and str(plot)}
    return out
