"""Many writers to one MLflow store, as farm processes and SLURM array tasks are (docs/evaluation.md, "Tracking
many jobs at once"): writers that all find the experiment missing share the one that gets made, and farms
logging at once to a real `mlflow server` (tests/conftest.py's mlflow_server) keep every run."""

import json
import subprocess
import sys
import threading

import pytest
from support import SAMPLES

from pretrieve.data.retrieval import load_beir, write_msmarco
from pretrieve.engine.tracking import experiment_id_of

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def test_writers_that_all_find_the_experiment_missing_share_one(tmp_path):
    """Eight clients look for the experiment at once (a barrier), find none, and create it: the losers of the
    create take the winner's id instead of failing (before: 'already exists' in up to 7 of them)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # the schema, made once before the race
    ids, errors = [], []
    for name in ("first", "second", "third"):
        barrier = threading.Barrier(8)

        def create(name=name, barrier=barrier) -> None:
            client = MlflowClient(uri)
            barrier.wait()
            try:
                ids.append((name, experiment_id_of(client, name)))
            except Exception as error:  # noqa: BLE001 - collected for the assertion below
                errors.append(repr(error))

        threads = [threading.Thread(target=create) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors[:2]
    made = {e.name: e.experiment_id for e in MlflowClient(uri).search_experiments()}
    assert sorted(ids) == sorted((name, made[name]) for name in ("first", "second", "third") for _ in range(8))


@pytest.mark.integration
def test_farms_logging_at_once_to_one_tracking_server_keep_every_run(tmp_path, mlflow_server):
    """Three `pretrieve farm` processes started together, two jobs each (workers: 2), one server and experiment:
    every job is one run on the server, the run its OUT/mlflow.json names."""
    from mlflow.tracking import MlflowClient

    url, _, _ = mlflow_server
    marco = write_msmarco(load_beir(SCIFACT), tmp_path / "marco", "dev")
    farms = []
    for i in range(3):
        farm = tmp_path / f"farm-{i}.yaml"
        farm.write_text(json.dumps({
            "out": str(tmp_path / f"out-{i}"), "workers": 2, "gpus": 0, "eval": {"depth": 20},
            "tracking": {"uri": url, "experiment": "many-writers"},
            "checkpoints": [{"name": f"bm25-{i}", "bm25": True}],
            "datasets": [{"name": "scifact", "beir": str(SCIFACT)},
                         {"name": "marco", "msmarco": str(marco), "split": "dev"}]}))
        farms.append(subprocess.Popen([sys.executable, "-m", "pretrieve", "farm", str(farm)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        ended = [farm.communicate(timeout=600) for farm in farms]
    finally:
        for farm in farms:
            farm.kill()
            farm.wait()
    for farm, (out, err) in zip(farms, ended):
        assert farm.returncode == 0, err[-3000:]
        assert len(json.loads(out.splitlines()[-1])["logged"]) == 2

    client = MlflowClient(tracking_uri=url)
    runs = client.search_runs([client.get_experiment_by_name("many-writers").experiment_id])
    by_job = {(r.data.tags["checkpoint"], r.data.tags["dataset"]): r for r in runs}
    jobs = {(f"bm25-{i}", dataset) for i in range(3) for dataset in ("scifact", "marco")}
    assert len(runs) == 6 and set(by_job) == jobs
    for checkpoint, dataset in jobs:
        job = tmp_path / f"out-{checkpoint[-1]}" / checkpoint / dataset / "zero-shot"
        run = by_job[checkpoint, dataset]
        assert json.loads((job / "mlflow.json").read_text()) == {"tracking_uri": url, "run_id": run.info.run_id}
        metrics = json.loads((job / "metrics.json").read_text())
        assert run.data.metrics["ndcg_at_10"] == pytest.approx(metrics["ndcg@10"])
