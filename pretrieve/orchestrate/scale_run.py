"""`pretrieve scale run STUDY.yaml [--slurm JOBS]`: every point of the plan pre-trained, then evaluated.

One MLflow parent run per study (tagged `pretrieve.study = <name>`, `pretrieve.scale = study`; found again by
that tag, so a re-run continues it). Each point is `pretrieve pretrain` of its plan entry (pretrieve/scale/plan.py)
with `resume=auto`, in its own process, logged as a child run of the parent tagged N, N_total, D, C, method,
seed and size, with `val_loss` (and, once finished, `val_loss_final` and `val_loss_best`) when the study has
validation data. The points run through orchestrate/pretrain_runs.py, as a method study's arms do: a point is
done when its export exists; a re-run skips it, and one that stopped (killed, preempted, `train.stop_at`)
continues from its checkpoint. A failing point is reported with its log and stops nothing else. `workers` points
run at a time (`run.workers`, default 1). Then the finished points go to `pretrieve farm` (`<out>/farm.yaml`: the
study's `evaluation` datasets, stages and eval settings), whose runs nest under each point's run and which skips
done jobs.

With `--slurm JOBS` nothing runs here: the pending points' `pretrain` lines are written to JOBS for
`launchers/slurm/eval_farm.sbatch` (one array task each, one rank); once they have run, the same command
writes the pending evaluation jobs, then logs the finished ones.

    evaluation:                                   # in STUDY.yaml
      datasets: [{name: scifact, beir: ../shared/data/beir/scifact, split: test}]
      stages: [zero-shot]
      eval: {max_length: 128, batch_size: 64, contrastive_entropy: 256}
    run: {out: runs/scale/micro, workers: 2}
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.orchestrate import pretrain_runs as runner
from pretrieve.scale.plan import Point, base_config, plan, study_out, study_workers, write_plan
from pretrieve.scale.study import KIND_TAG, STUDY_TAG
from pretrieve.utils.run_dir import write_atomic


def point_done(point: Point, out: Path) -> bool:
    return (out / "points" / point.id / "export" / "model.safetensors").is_file()


def pretrain_args(study: dict, point: Point, parent: str | None) -> list[str]:
    """`pretrieve pretrain` arguments of a point: its plan overrides, resume=auto, the study's store and tags."""
    tracking = study["tracking"]
    tags = {"N": point.N, "N_total": point.N_total, "D": point.D, "C": point.C, "method": point.method,
            "seed": point.seed, "size": point.size}
    record = ["tracking.enabled=true", f"tracking.uri={tracking['uri']}",
              f"tracking.experiment={tracking['experiment']}", *(f"tracking.tags.{k}={v}" for k, v in tags.items())]
    if parent:
        record.append(f"tracking.parent_run_id={parent}")
    return ["pretrain", base_config(study, point.method), *point.overrides, "resume=auto", *record]


def pretrain_run(study: dict, point: Point, parent: str | None, out: Path) -> runner.PretrainRun:
    """A point as a run of orchestrate/pretrain_runs.py: done once its export's weights are written."""
    folder = out / "points" / point.id
    return runner.PretrainRun(point.id, pretrain_args(study, point, parent),
                              folder / "export" / "model.safetensors", folder / "pretrain.log")


def log_validation_summary(run_dir: Path) -> None:
    """`val_loss_final` and `val_loss_best` of a finished point, on its MLflow run (from metrics.jsonl)."""
    from pretrieve.utils.mlflow_store import mlflow_client

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in records if "val_loss" in r]
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    if losses and run.get("run_id"):
        client = mlflow_client(run["tracking_uri"])
        client.log_metric(run["run_id"], "val_loss_final", losses[-1])
        client.log_metric(run["run_id"], "val_loss_best", min(losses))


def study_parent(study: dict) -> str:
    """The study's parent run id: the latest top-level run tagged with its name, created when there is none."""
    from pretrieve.engine.tracking import experiment_id_of
    from pretrieve.scale.study import parent_run_id
    from pretrieve.utils.mlflow_store import artifact_root, mlflow_client

    try:
        return parent_run_id(study)
    except ValueError:
        uri = study["tracking"]["uri"]
        client = mlflow_client(uri)
        experiment = experiment_id_of(client, study["tracking"]["experiment"], artifact_root(uri))
        run = client.create_run(experiment, run_name=study["name"],
                                tags={STUDY_TAG: study["name"], KIND_TAG: "study"})
        return run.info.run_id


def farm_config(study: dict, points: list[Point], out: Path) -> dict:
    """The farm of the finished points: each export zero-shot (or the study's stages) on its datasets."""
    evaluation = study.get("evaluation") or {}
    if not evaluation.get("datasets"):
        raise ValueError("evaluation.datasets: list the datasets to score each point on (farm format)")
    tracking = study["tracking"]
    return {"out": str(out / "eval"), "workers": study_workers(study),
            "tracking": {"uri": tracking["uri"], "experiment": tracking["experiment"]},
            "eval": evaluation.get("eval", {}), "datasets": evaluation["datasets"],
            "stages": evaluation.get("stages", ["zero-shot"]),
            "checkpoints": [{"name": p.id, "model": str(out / "points" / p.id / "export"), "pooling": "cls",
                             "run_dir": str(out / "points" / p.id)} for p in points]}


def run_study(path: str | Path, slurm_jobs: str | None = None, progress: bool = True) -> dict:
    study, points = plan(path)
    write_plan(study, points)
    out = study_out(study)
    parent = study_parent(study)
    write_atomic(out / "study.json", json.dumps({"study": study["name"], "parent_run_id": parent,
                                                 "tracking_uri": study["tracking"]["uri"]}, indent=1))
    runs = [pretrain_run(study, point, parent, out) for point in points]
    pending = [run for run in runs if not run.done()]
    if slurm_jobs is not None and pending:
        return {"points": len(points), "pending_for_slurm": runner.list_for_slurm(runs, slurm_jobs),
                "parent_run_id": parent}
    failed = runner.pretrain_runs(runs, study_workers(study), unit="point", label="scale", progress=progress,
                                  after=lambda run: log_validation_summary(run.log.parent))
    finished = [p for p in points if point_done(p, out)]
    evaluated = {}
    if finished and (study.get("evaluation") or {}).get("datasets"):
        evaluated = runner.evaluate(farm_config(study, finished, out), out / "farm.yaml", slurm_jobs=slurm_jobs,
                                    progress=progress)
        failed.update(evaluated.get("failed", {}))
    return {"points": len(points), "pretrained": len(finished), "skipped": len(points) - len(pending),
            "failed": failed, "evaluation": evaluated, "parent_run_id": parent}
