"""`pretrieve track EVAL_DIR ...`: log finished `pretrieve eval` output folders as MLflow evaluation runs, the
way the farm logs its jobs, so `pretrieve report` compares them with farm runs without evaluating again.

A folder holds metrics.json, run.trec and per_query.jsonl (docs/design.md, "Evaluation output"); metrics.json also
records what was run (model, pooling, split, depth, ...). Each folder becomes one run with the farm's tags
(`pretrieve.farm: eval`, checkpoint, dataset, stage; `model_dir`, the model evaluated; and `logged_by:
pretrieve track`, which a model card credits), the float values of
metrics.json as metrics under their MLflow names (ndcg@10 -> ndcg_at_10), the other values as params, the
three files as artifacts, and `eval_dir` (the folder, absolute), `run_trec_sha256` and, for an evaluation of
cut vectors (`eval --dim`), `dim` as tags. The run starts
when metrics.json was written, so the report's "latest evaluation counts" compares evaluation times, not
logging times. Re-logging is a no-op: a run of the experiment with the same folder and the same run.trec
digest is kept; a folder evaluated again (another run.trec) gets a new run, which the report then counts.
OUT/bm25/ of `pretrieve eval --model ... --bm25` is logged with OUT, as checkpoint `bm25`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pretrieve.engine.tracking import experiment_id_of
from pretrieve.utils.metric_names import metric_name
from pretrieve.utils.mlflow_store import artifact_root

EVAL_FILES = ("metrics.json", "run.trec", "per_query.jsonl")
STAGES = ("zero-shot", "stage1", "stage2", "stage3")  # what an evaluation comes after (the farm's `stages`)


@dataclass
class EvalFolder:
    """A finished `pretrieve eval` output folder and the names the report shows it under."""
    path: Path  # absolute
    metrics: dict
    checkpoint: str
    dataset: str
    stage: str

    @property
    def run_name(self) -> str:
        return f"{self.checkpoint}-{self.dataset}-{self.stage}"


def read_eval_folder(folder: str | Path) -> dict:
    """metrics.json of a finished evaluation folder; an error naming the folder when it is not one."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such folder (give `pretrieve eval --out` folders)")
    missing = [name for name in EVAL_FILES if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder}: no {', '.join(missing)}: not a finished `pretrieve eval` output folder "
                         "(metrics.json is written last, when the evaluation is done)")
    try:
        metrics = json.loads((folder / "metrics.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / 'metrics.json'}: not JSON ({e})") from e
    if not isinstance(metrics, dict) or "ndcg@10" not in metrics:
        raise ValueError(f"{folder / 'metrics.json'}: no 'ndcg@10': not a `pretrieve eval` metrics file")
    return metrics


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:  # by chunks: a run file to depth 1,000 on MS MARCO is hundreds of MB
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def log_eval_run(client, experiment_id: str, folder: Path, tags: dict, run_name: str, step: int | None = None) -> str:
    """Log the evaluation in `folder` as one finished MLflow run (the farm's and `track`'s format); its id. `step`:
    the training step of the checkpoint evaluated, the step its metrics are logged at (MLflow's charts by step).
    """
    metrics = json.loads((folder / "metrics.json").read_text())
    started_ms = int((folder / "metrics.json").stat().st_mtime * 1000)
    tags = {**tags, "eval_dir": str(folder.resolve()), "run_trec_sha256": sha256_of(folder / "run.trec")}
    if metrics.get("dim"):  # the vectors' prefix searched (`eval --dim`): the report's rows and cards tell them apart
        tags["dim"] = str(metrics["dim"])
    run_id = client.create_run(experiment_id, start_time=started_ms, run_name=run_name, tags=tags).info.run_id
    for key, value in metrics.items():
        if isinstance(value, float):
            client.log_metric(run_id, metric_name(key), value, step=step or 0)
        elif value is not None and not isinstance(value, dict):
            client.log_param(run_id, key, str(value)[:6000])
    for artifact in EVAL_FILES:
        client.log_artifact(run_id, str(folder / artifact))
    client.set_terminated(run_id)
    return run_id


def logged_run(client, experiment_id: str, folder: Path) -> str | None:
    """The id of a run of the experiment that logged this folder with this run.trec, if any."""
    sha = sha256_of(folder / "run.trec")
    runs = client.search_runs([experiment_id], filter_string=f"tags.run_trec_sha256 = '{sha}'", max_results=1000)
    here = str(folder.resolve())
    return next((r.info.run_id for r in runs if r.data.tags.get("eval_dir") == here), None)


def eval_folders(folders: list[str], checkpoint: str | None = None, dataset: str | None = None,
                 stage: str = "zero-shot") -> list[EvalFolder]:
    """Every folder checked before anything is logged (and OUT/bm25 beside OUT): the report's names of each."""
    if checkpoint is not None and len(folders) > 1:
        raise ValueError(f"--checkpoint names one folder; {len(folders)} given (the default is each folder's name)")
    found = []
    for given in folders:
        paths = [Path(given)] + ([Path(given) / "bm25"] if (Path(given) / "bm25" / "metrics.json").is_file() else [])
        for path in paths:
            metrics = read_eval_folder(path)
            name = dataset or metrics.get("dataset")
            if not name:
                raise ValueError(f"{path / 'metrics.json'}: no 'dataset'; name it with --dataset")
            own = checkpoint if checkpoint is not None and path == Path(given) else path.resolve().name
            found.append(EvalFolder(path.resolve(), metrics, own, str(name), stage))
    return found


def track(folders: list[str], uri: str, experiment: str = "pretrieve-eval", checkpoint: str | None = None,
          dataset: str | None = None, stage: str = "zero-shot") -> list[dict]:
    """Log each folder not logged yet; one record per folder: eval_dir, checkpoint, dataset, stage, run_id,
    logged (False: the run that logged it before)."""
    from pretrieve.utils.mlflow_store import mlflow_client

    found = eval_folders(folders, checkpoint, dataset, stage)
    client = mlflow_client(uri)
    experiment_id = experiment_id_of(client, experiment, artifact_root(uri))
    records = []
    for folder in found:
        run_id = logged_run(client, experiment_id, folder.path)
        logged = run_id is None
        if logged:
            tags = {"pretrieve.farm": "eval", "checkpoint": folder.checkpoint, "dataset": folder.dataset,
                    "stage": folder.stage, "logged_by": "pretrieve track"}  # the farm's runs have no such tag
            if folder.metrics.get("model"):
                tags["model_dir"] = str(folder.metrics["model"])
            run_id = log_eval_run(client, experiment_id, folder.path, tags, folder.run_name)
        records.append({"eval_dir": str(folder.path), "checkpoint": folder.checkpoint, "dataset": folder.dataset,
                        "stage": folder.stage, "run_id": run_id, "logged": logged})
    return records
