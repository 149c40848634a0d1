"""MLflow tracking for training runs (rank 0 only), never in the way of training.

Default store: a local sqlite file beside the run directories (`sqlite:///<runs>/mlflow.db`, no server);
`tracking.uri` points at a tracking server instead. The run id is kept in run_dir/run.json so a resumed run
continues the same MLflow run. If the backend fails, the failure is reported once and tracking stops;
metrics.jsonl in the run directory still has everything.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pretrieve.utils.metric_names import metric_name
from pretrieve.utils.run_dir import write_atomic

if TYPE_CHECKING:
    from pretrieve.config import TrackingOptions

log = logging.getLogger(__name__)


def flatten(tree, prefix: str = "") -> dict[str, str]:
    """{"train.lr": "0.0001", ...} for MLflow params (values cut to MLflow's 6,000 characters)."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): str(tree)[:6000]}


def store_location(uri: str) -> str:
    """What an MLflow tracking URI points at, written one way: "sqlite:///runs/mlflow.db" (relative to the
    working directory), "sqlite:////abs/runs/mlflow.db" and a file store's path or file: URI name the same store
    whichever way they are written; server URIs compare as written, less a trailing slash."""
    from urllib.parse import urlparse

    if uri.startswith("sqlite:///"):
        return "sqlite:" + str(Path(uri[len("sqlite:///"):]).resolve())
    if uri.startswith("file:") or "://" not in uri:
        return "file:" + str(Path(urlparse(uri).path if uri.startswith("file:") else uri).resolve())
    return uri.rstrip("/")


def experiment_id_of(client, name: str, artifact_location: str | None = None) -> str:
    """The id of MLflow experiment `name`, created (with `artifact_location`) when missing. Writers started
    together (farm processes, array tasks on one tracking server) may all find it missing: the one whose
    create loses the race takes the winner's."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Tracker:
    def __init__(self, options: TrackingOptions, run_dir: Path, params: dict, tags: dict, fresh: bool = False):
        """fresh: the run starts from step 0 (no checkpoint): a run.json left by an attempt that died before its
        first checkpoint names a run that is ended as FAILED, and a new one is made, so no step is logged twice."""
        self.client = None
        self.run_id = None
        self.system = None
        if not options.enabled:
            return
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a dead server must not stall training
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        uri = options.uri or f"sqlite:///{run_dir.resolve().parent / 'mlflow.db'}"
        run_file = run_dir / "run.json"
        try:
            from pretrieve.utils.mlflow_store import artifact_root, mlflow_client

            self.client = mlflow_client(uri)
            previous = json.loads(run_file.read_text()) if run_file.is_file() else {}
            resumed = previous.get("tracking_uri") == uri and bool(previous.get("run_id"))
            if resumed and fresh:
                self.client.set_terminated(previous["run_id"], status="FAILED")
                resumed = False
            if resumed:
                self.run_id = previous["run_id"]  # resume: continue the same run
                self.client.update_run(self.run_id, status="RUNNING")
            else:
                experiment_id = experiment_id_of(self.client, options.experiment, artifact_root(uri))
                tags = {**tags, **{k: str(v) for k, v in (options.tags or {}).items()}}
                if options.parent_run_id:
                    tags["mlflow.parentRunId"] = options.parent_run_id
                self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name, tags=tags).info.run_id
                from mlflow.entities import Param

                logged = [Param(key, value) for key, value in params.items()]
                for first in range(0, len(logged), 100):  # MLflow takes at most 100 params a batch
                    self.client.log_batch(self.run_id, params=logged[first:first + 100])
                write_atomic(run_file, json.dumps({"tracking_uri": uri, "run_id": self.run_id,
                                                   "experiment": options.experiment}, indent=1))
            if options.system_metrics_every:
                from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

                logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)  # no start/stop chatter

                self.system = SystemMetricsMonitor(self.run_id, sampling_interval=options.system_metrics_every,
                                                   resume_logging=resumed, tracking_uri=uri)
                self.system.start()
        except Exception as e:  # noqa: BLE001 - any backend failure: report once, train on
            self._fail(e)

    def _fail(self, error: Exception) -> None:
        if self.system is not None:
            self.system.finish()
            self.system = None
        print(f"pretrieve: MLflow tracking disabled ({type(error).__name__}: {str(error)[:300]}); "
              "training continues and metrics.jsonl keeps every logged step", file=sys.stderr)
        self.client = None

    def _stop_system_metrics(self) -> None:
        """Stop the sampler and publish the samples of its last, unfinished period: MLflow's monitor drops them,
        so a run shorter than one sampling interval would otherwise have no system metrics at all."""
        monitor, self.system = self.system, None
        monitor.finish()
        pending = monitor.aggregate_metrics()
        if pending:
            monitor.publish_metrics(pending)
            monitor.mlflow_logger.flush()

    def log_metrics(self, step: int, metrics: dict) -> None:
        if self.client is None:
            return
        try:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(metric_name(k), float(v), now, step)
                                                        for k, v in metrics.items() if k != "step"])
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def set_tag(self, key: str, value: str) -> None:
        if self.client is None:
            return
        try:
            self.client.set_tag(self.run_id, key, value)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def finish(self, status: str = "FINISHED") -> None:
        if self.client is None:
            return
        try:
            if self.system is not None:
                self._stop_system_metrics()
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001
            self._fail(e)


def run_params(config: dict, ds_config: dict) -> dict:
    import importlib.metadata as metadata

    params = flatten(config)
    params.update(flatten(ds_config, "deepspeed."))
    params["git_commit"] = _git_commit()
    for package in ("torch", "deepspeed", "transformers", "pretrieve"):
        try:
            params[f"version.{package}"] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return params


def run_tags(method: str, corpora, encoder_config) -> dict:
    tags = {"method": method, "corpus_mix": ",".join(corpora or []),
            "model_size": f"hidden{encoder_config.hidden_size}-layers{encoder_config.num_hidden_layers}"}
    if os.environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return tags
