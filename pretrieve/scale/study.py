"""STUDY.yaml: a scaling study. This module holds the keys `pretrieve scale fit` reads; `scale plan` and
`scale run` add theirs (grid, budgets, configs, ...) to the same file, so keys it does not know are left to them.

    name: retromae-ladder                       # the study; its MLflow parent run carries this name
    tracking:
      uri: sqlite:///runs/mlflow.db             # MLflow store of the study (default: sqlite:///runs/mlflow.db)
      experiment: pretrieve-scale               # experiment holding the parent run (default: pretrieve-scale)
      parent_run_id: null                       # optional: the parent run, instead of looking it up by name
    fit:                                        # optional
      metric: ndcg@10                           # downstream metric (MLflow name: ndcg_at_10); none: loss only
      dataset: scifact                          # optional: only this dataset's evaluation runs
      stage: zero-shot                          # optional: only this stage's evaluation runs

The parent run (what `scale run` creates, the contract both sides keep): a run of `tracking.experiment` without
a parent, tagged `pretrieve.scale = study` and `pretrieve.study = <name>`; every point is its child run
(pretrieve/scale/points.py). When several runs match, the latest started wins.
"""

from __future__ import annotations

from pathlib import Path

STUDY_TAG = "pretrieve.study"
KIND_TAG = "pretrieve.scale"
DEFAULT_URI = "sqlite:///runs/mlflow.db"
DEFAULT_EXPERIMENT = "pretrieve-scale"
TRACKING_KEYS = ("uri", "experiment", "parent_run_id")
FIT_KEYS = ("metric", "dataset", "stage")


def load_study(path: str | Path) -> dict:
    """The study with `tracking` and `fit` filled with defaults; errors name the file and key."""
    from omegaconf import OmegaConf

    study = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(study, dict) or not study.get("name"):
        raise ValueError(f"{path}: name: the study needs a name (its MLflow parent run is found by it)")
    for section, known in (("tracking", TRACKING_KEYS), ("fit", FIT_KEYS)):
        value = study.setdefault(section, {}) or {}
        if not isinstance(value, dict):
            raise ValueError(f"{path}: {section}: expected a mapping, got {value!r}")
        for key in value:
            if key not in known:
                raise ValueError(f"{path}: {section}.{key}: unknown (known: {', '.join(known)})")
        study[section] = value
    study["tracking"].setdefault("uri", DEFAULT_URI)
    study["tracking"].setdefault("experiment", DEFAULT_EXPERIMENT)
    return study


def parent_run_id(study: dict) -> str:
    """The study's parent run: `tracking.parent_run_id`, else the latest top-level run tagged with its name."""
    from pretrieve.utils.mlflow_store import mlflow_client

    tracking = study["tracking"]
    if tracking.get("parent_run_id"):
        return tracking["parent_run_id"]
    client = mlflow_client(tracking["uri"])
    experiment = client.get_experiment_by_name(tracking["experiment"])
    if experiment is None:
        raise ValueError(f"{tracking['uri']}: no experiment {tracking['experiment']!r} (tracking.experiment)")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{STUDY_TAG}` = '{study['name']}'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    if not parents:
        raise ValueError(f"{tracking['uri']}: experiment {tracking['experiment']!r} has no top-level run tagged "
                         f"{STUDY_TAG} = {study['name']!r}; run the study first, or set tracking.parent_run_id")
    return parents[0].info.run_id
