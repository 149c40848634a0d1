"""MLflow tracking of training runs: contents read back with MlflowClient, a resumed run continues the same
MLflow run, and a dead tracking server is reported once without stopping training."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from support import mlflow_job_stores, pretrain_env, running_mlflow_server

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _pretrain(run_dir, wiki_shards, *overrides, config="tiny-mlm.yaml"):
    env = pretrain_env(SLURM_JOB_ID="4242")
    cmd = [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / config), f"run_dir={run_dir}",
           f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
           "train.log_every=1", "checkpoint.every=2", "tracking.system_metrics_every=600", *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_mlflow_run_contents_and_resume(tmp_path, wiki_shards):
    run_dir = tmp_path / "runs" / "tracked"
    assert _pretrain(run_dir, wiki_shards, "train.max_steps=2").returncode == 0
    first = json.loads((run_dir / "run.json").read_text())
    assert first["tracking_uri"] == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    done = _pretrain(run_dir, wiki_shards, "train.max_steps=4", "resume=auto")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == first["run_id"]  # the same MLflow run

    client = MlflowClient(tracking_uri=first["tracking_uri"])
    run = client.get_run(first["run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["method.name"] == "mlm" and params["train.lr"] == "0.0001"
    assert params["deepspeed.zero_optimization.stage"] == "0" and params["version.torch"].startswith("2.")
    assert len(params["git_commit"]) in (40, 7) or params["git_commit"] == "unknown"
    assert run.data.tags["method"] == "mlm" and run.data.tags["model_size"] == "hidden64-layers2"
    assert run.data.tags["slurm_job_id"] == "4242"
    history = client.get_metric_history(first["run_id"], "loss")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m.step, m.value) for m in history) == [(r["step"], r["loss"]) for r in logged]
    assert {"mlm", "lr", "tokens_per_s", "samples_per_s", "tflops_per_device", "mfu", "grad_norm",
            "padding_fraction"} <= set(run.data.metrics)
    assert 0 < run.data.metrics["mfu"] < 1 and run.data.metrics["grad_norm"] > 0
    # MLflow's system metrics: each run is shorter than one sampling interval, so what it has is the sample of
    # its last, unfinished period, published when the run ends
    system = client.get_metric_history(first["run_id"], "system/cpu_utilization_percentage")
    assert [m.step for m in system] == [0, 1]  # one a run; the resumed run continues the steps
    # the experiment keeps its artifacts beside the store (farm evaluations nest under this run), not in ./mlruns
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.artifact_location == (tmp_path / "runs" / "mlartifacts").as_uri()


def test_mlflow_params_are_the_resolved_config(tmp_path, wiki_shards):
    """What ran, in a sqlite store: the defaults a config leaves out, and a method's default that the model
    resolves (condenser's skip_from null: half of 2 layers), with the value used."""
    run_dir = tmp_path / "runs" / "condenser"
    done = _pretrain(run_dir, wiki_shards, "train.max_steps=1", "tracking.system_metrics_every=null",
                     config="tiny-condenser.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((run_dir / "run.json").read_text())
    params = MlflowClient(tracking_uri=run["tracking_uri"]).get_run(run["run_id"]).data.params
    assert params["method.skip_from"] == "1" and params["method.head_layers"] == "2"
    assert params["method.name"] == "condenser"
    assert params["train.grad_accum"] == "1" and params["data.shuffle_buffer"] == "1000"  # not in the config
    assert params["train.lr"] == "0.0001"


def test_dead_tracking_server_does_not_stop_training(tmp_path, wiki_shards):
    run_dir = tmp_path / "untracked"
    done = _pretrain(run_dir, wiki_shards, "train.max_steps=3", "tracking.uri=http://127.0.0.1:9")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("MLflow tracking disabled") == 1
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_tracking_server_the_tests_start_leaves_nothing_in_dev_shm(tmp_path):
    """`mlflow server` makes its job store in /dev/shm and never removes it (38 of them built up in a day of test
    runs): the tests' servers take theirs with them when they stop."""
    with running_mlflow_server(tmp_path) as (_, server, _):
        stores = mlflow_job_stores(server)
        assert all(Path(path).is_dir() for path in stores)
    assert not [path for path in stores if Path(path).exists()]
