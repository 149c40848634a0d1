"""`pretrieve farm FARM.yaml`: every checkpoint x dataset x stage as one `pretrieve eval` job, run in parallel
on this machine or handed to SLURM, each logged as an MLflow run.

    out: farm-out                      # job outputs: <out>/<checkpoint>/<dataset>/<stage>/
    workers: 2                         # jobs at once on a machine without GPUs
    gpus: [0, 1, 2, 3]                 # or a count (4); default: every GPU torch sees; 0 or []: none
    tracking: {uri: sqlite:///runs/mlflow.db, experiment: pretrieve-eval}
    eval: {max_length: 256, depth: 1000, index: flat, batch_size: 64}  # also contrastive_entropy: K, ce_*,
                                       # and nprobe / ef_search for index ivf / ivfpq / hnsw
    checkpoints:
      - {name: minilm, model: path/to/export, pooling: mean, normalize: true, run_dir: runs/x}
      - {name: mrl, model: path/to/export, dims: [768, 256, 64]}  # each dimension (`eval --dim`): out/.../dim<N>/
      - {name: bm25, bm25: true}       # the BM25 baseline (`pretrieve eval --bm25`), zero-shot only
    datasets:
      - {name: scifact, beir: ../shared/data/beir/scifact, split: test}
      - {name: marco-dev, msmarco: data/msmarco, split: dev}
      - {name: mteb-scifact, mteb: SciFact}   # an MTEB task (`pretrieve eval --mteb`: its own split, offline)
    stages: [zero-shot, stage1, stage2, stage3]
    finetune:                          # needed by stage1-3: `pretrieve finetune-stages` per checkpoint
      config: configs/finetune/stage1.yaml     # base config of every fine-tuning run
      msmarco: data/msmarco            # or beir: DIR, or data: [files]; with split (default train)
      negatives: 15
      depth: 200
      teacher_init: path/to/bert-base  # the cross-encoder's start (default: the checkpoint)
      nproc: 8                         # ranks per fine-tuning run, on this node (default 1)
      overrides: [train.max_steps=20000]
    follow: runs/x                     # or --follow RUN_DIR: each checkpoint of a pre-training run as it comes
                                       # ({run_dir, name, every, poll, keep_exports, pooling, normalize}:
                                       # orchestrate/follow.py); `checkpoints:` may then be left out

Each job is a separate process, so a failing job (reported with its log) stops nothing else. On GPUs, each job
gets one device of `gpus:` to itself (CUDA_VISIBLE_DEVICES in its environment; ids count the devices this process
sees, engine.devices) and as many jobs run at once as there are devices; a fine-tuning chain takes `nproc`
devices at once; a job's devices are free again when it ends, failed or not. Without GPUs (none seen, or `gpus:
0`, which hides them from the jobs), `workers` jobs run at once. A job is done
when its metrics.json exists (written last, atomically); re-running the farm skips done jobs and logs to
MLflow the done jobs not yet logged (OUT/.../mlflow.json records the run). `--slurm JOBS` writes the pending
jobs as a job list for launchers/slurm/eval_farm.sbatch instead of running them; re-run the farm after the
array has finished to log the results. An eval run is nested under its checkpoint's pre-training run when the
checkpoint names its `run_dir` and that run is in the same MLflow store. Stages: `zero-shot` (the checkpoint as
it is) and `stage1` / `stage2` / `stage3`, the checkpoint fine-tuned (pretrieve/orchestrate/finetune_stages.py) with the
checkpoint's pooling and normalisation (left out: what the model's own config says, eval.model_config). After
logging, the model card of an evaluated run export (RUN/export/README.md) is written again with the farm's
evaluations (eval.model_card). A checkpoint's fine-tuning chain runs first, once for all its stages,
as one process (log: <out>/<checkpoint>/finetune/finetune.log, its runs in the farm's MLflow experiment); with
`--slurm`, pending chains are listed first and their evaluation jobs on the next `--slurm` call. A checkpoint
with `dims:` (a Matryoshka model, models/matryoshka.py) is evaluated at each dimension, its vectors cut to their
first N coordinates (`pretrieve eval --dim N`; its run tagged `dim`, eval.track), and the farm writes <out>/dims.md, .csv and
.png: NDCG@10 against dimension (eval.dims_table).
"""

from __future__ import annotations

import json
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from pretrieve.engine.child_processes import STOPPED, ChildProcesses
from pretrieve.engine.devices import DevicePool, node_devices, visible_env
from pretrieve.engine.preemption import stop_exit
from pretrieve.engine.tracking import experiment_id_of, store_location
from pretrieve.eval.dims_table import FILES as DIMS_FILES
from pretrieve.eval.dims_table import write_dims_table
from pretrieve.eval.track import STAGES, log_eval_run
from pretrieve.orchestrate.finetune_stages import done as finetuned
from pretrieve.progress import Progress
from pretrieve.utils.output_folder import check_own_entries
from pretrieve.utils.run_dir import write_atomic

FARM_RECORD = ".pretrieve-farm"  # in `out`: the folder is a farm's, which adds to it and removes nothing
EVAL_KEYS = ("max_length", "depth", "index", "nprobe", "ef_search", "batch_size", "contrastive_entropy",
             "ce_temperature", "ce_seed")
ENTRY_KEYS = {"checkpoints": ("name", "model", "bm25", "pooling", "normalize", "run_dir", "dims"),
              "datasets": ("name", "beir", "msmarco", "mteb", "split")}
DATASET_KINDS = ("beir", "msmarco", "mteb")  # a dataset names one: `pretrieve eval --beir / --msmarco / --mteb`
FINETUNE_KEYS = ("config", "data", "msmarco", "beir", "split", "negatives", "depth", "teacher_init", "nproc",
                 "overrides")


@dataclass
class Job:
    checkpoint: dict
    dataset: dict
    stage: str
    out: Path
    dim: int | None = None  # the vectors' first `dim` coordinates (None: all)

    @property
    def name(self) -> str:
        return f"{self.checkpoint['name']}/{self.dataset['name']}/{self.stage}" + (f"/dim{self.dim}" if self.dim else "")

    def done(self) -> bool:
        return (self.out / "metrics.json").is_file()

    @property
    def model(self) -> Path | None:
        """The model this job evaluates: the checkpoint, or its fine-tuned export for a stage (None: BM25)."""
        if self.checkpoint.get("bm25"):
            return None
        if self.stage == "zero-shot":
            return Path(self.checkpoint["model"])
        depth = len(Path(self.checkpoint["name"]).parts) + (2 if self.dim else 1)  # `out` is <out>/<name>/...
        return finetune_dir(self.out.parents[depth], self.checkpoint) / self.stage / "export"

    def eval_args(self, settings: dict) -> list[str]:
        """The `pretrieve eval` arguments of this job; what a job not done left in its folder is the farm's own, which
        --overwrite replaces (a done job is not run again)."""
        if self.model is None:  # BM25 encodes nothing: only the retrieval depth applies
            settings = {k: v for k, v in settings.items() if k == "depth"}
            args = ["eval", "--bm25", "--out", str(self.out), "--overwrite"]
        else:
            args = ["eval", "--model", str(self.model), "--out", str(self.out), "--overwrite",
                    *encoding_args(self.checkpoint)]
        kind = next(k for k in DATASET_KINDS if k in self.dataset)
        args += [f"--{kind}", str(self.dataset[kind])]
        if self.dataset.get("split"):
            args += ["--split", str(self.dataset["split"])]
        for key in EVAL_KEYS:
            if key in settings:
                args += [f"--{key.replace('_', '-')}", str(settings[key])]
        return args + (["--dim", str(self.dim)] if self.dim else [])


def encoding_args(checkpoint: dict) -> list[str]:
    """--pooling / --normalize / --no-normalize as the checkpoint names them; left out, the model's own
    config decides (eval.model_config)."""
    args = ["--pooling", str(checkpoint["pooling"])] if checkpoint.get("pooling") else []
    if "normalize" in checkpoint:
        args.append("--normalize" if checkpoint["normalize"] else "--no-normalize")
    return args


def load_farm(path: str | Path, follow: str | None = None) -> dict:
    """FARM.yaml checked; `follow` (--follow RUN_DIR) sets follow.run_dir, whose block orchestrate/follow.py
    checks."""
    from omegaconf import OmegaConf

    farm = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    known = {"out", "workers", "gpus", "tracking", "eval", "checkpoints", "datasets", "stages", "finetune", "follow"}
    for key in farm:
        if key not in known:
            raise ValueError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    if follow is not None:
        given = farm.get("follow")
        farm["follow"] = {**(given if isinstance(given, dict) else {}), "run_dir": follow}
    if farm.get("follow"):
        farm.setdefault("checkpoints", [])
    for section, required in (("checkpoints", ("name", "model")), ("datasets", ("name",))):
        if not farm.get(section) and not (section == "checkpoints" and farm.get("follow")):
            raise ValueError(f"{path}: {section}: list at least one")
        names = set()
        for i, entry in enumerate(farm[section]):
            if not isinstance(entry, dict):
                raise ValueError(f"{path}: {section}[{i}]: expected a mapping ({{name: ..., ...}}), got {entry!r}")
            for key in entry:  # a typo (bm52: true) named as such, not as the key it left missing
                if key not in ENTRY_KEYS[section]:
                    raise ValueError(f"{path}: {section}[{i}].{key}: unknown (known: "
                                     f"{', '.join(ENTRY_KEYS[section])})")
            for key in required:
                if key not in entry and not (key == "model" and entry.get("bm25")):
                    raise ValueError(f"{path}: {section}[{i}]: no {key!r}")
            if entry["name"] in names:
                raise ValueError(f"{path}: {section}[{i}]: name {entry['name']!r} used twice")
            names.add(entry["name"])
            dims = entry.get("dims")
            if dims is not None and (not isinstance(dims, list) or not dims or len(set(dims)) != len(dims) or any(
                    isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in dims)):
                raise ValueError(f"{path}: {section}[{i}].dims: expected distinct dimensions >= 1 (e.g. [768, 256, "
                                 f"64]), got {dims!r}")
            if dims is not None and entry.get("bm25"):
                raise ValueError(f"{path}: {section}[{i}].dims: BM25 has no vectors to cut")
            if section == "datasets" and sum(kind in entry for kind in DATASET_KINDS) != 1:
                raise ValueError(f"{path}: datasets[{i}]: give one of beir:, msmarco: or mteb:")
    mteb = [d["name"] for d in farm["datasets"] if "mteb" in d]
    bm25 = [c["name"] for c in farm["checkpoints"] if c.get("bm25")]
    if mteb and bm25:
        raise ValueError(f"{path}: datasets {', '.join(mteb)}: MTEB evaluates models, and checkpoints "
                         f"{', '.join(bm25)} are BM25; give the MTEB tasks in a farm without them")
    for i, stage in enumerate(farm.setdefault("stages", ["zero-shot"])):
        if stage not in STAGES:
            raise ValueError(f"{path}: stages[{i}]: {stage!r} is not one of {', '.join(STAGES)}")
    for key in farm.setdefault("eval", {}):
        if key not in EVAL_KEYS:
            raise ValueError(f"{path}: eval.{key}: unknown (known: {', '.join(EVAL_KEYS)})")
    if any(stage != "zero-shot" for stage in farm["stages"]):
        finetune = farm.get("finetune") or {}
        for key in finetune:
            if key not in FINETUNE_KEYS:
                raise ValueError(f"{path}: finetune.{key}: unknown (known: {', '.join(FINETUNE_KEYS)})")
        if "config" not in finetune:
            raise ValueError(f"{path}: finetune.config: the fine-tuning stages need a base config "
                             "(configs/finetune/*.yaml)")
        if sum(key in finetune for key in ("data", "msmarco", "beir")) != 1:
            raise ValueError(f"{path}: finetune: give one of data:, msmarco: or beir: (the training data)")
    if farm.get("gpus") is not None:  # checked here too, so a `--slurm` listing refuses it as well
        node_devices(farm["gpus"], f"{path}: gpus")
    farm.setdefault("out", "farm-out")
    farm.setdefault("workers", 1)
    farm.setdefault("tracking", {})
    return farm


def jobs_of(farm: dict) -> list[Job]:
    out = Path(farm["out"])
    return [Job(c, d, s, out / c["name"] / d["name"] / s / (f"dim{dim}" if dim else ""), dim)
            for c in farm["checkpoints"] for d in farm["datasets"] for s in farm["stages"]
            if s == "zero-shot" or not c.get("bm25")  # BM25 has nothing to fine-tune
            for dim in sorted(c.get("dims") or [None], key=lambda d: -(d or 0))]


def write_dims(farm: dict, jobs: list[Job]) -> str | None:
    """<out>/dims.md, .csv and .png of the checkpoints with `dims:` (None: there are none)."""
    evaluations: dict[tuple[str, str, str], dict] = {}
    for job in jobs:
        if job.dim:
            evaluations.setdefault((job.checkpoint["name"], job.dataset["name"], job.stage), {})[job.dim] = job.out
    return write_dims_table(farm["out"], evaluations) if evaluations else None


def check_out(farm: dict, followed: str | None = None) -> None:
    """The farm's `out`, before anything is written: new, a farm's own (its record, FARM_RECORD), or holding only
    what a farm writes there (a folder per checkpoint or `followed` run, the default MLflow store)."""
    names = {c["name"] for c in farm["checkpoints"]} | {"mlflow.db", "mlartifacts", FARM_RECORD, *DIMS_FILES,
                                                        followed}
    check_own_entries(farm["out"], "pretrieve farm", lambda name: name in names or name.startswith("mlflow.db-"),
                      earlier=lambda folder: (folder / FARM_RECORD).is_file())


def mark_out(farm: dict) -> None:
    """`out` made the farm's, when its first jobs start: a later farm with other checkpoints may add to it."""
    out = Path(farm["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / FARM_RECORD).touch()


def finetune_dir(out: Path, checkpoint: dict) -> Path:
    return out / checkpoint["name"] / "finetune"


def chains_of(farm: dict, jobs: list[Job]) -> dict[str, list[str]]:
    """{checkpoint name: `pretrieve finetune-stages` arguments} for the checkpoints whose pending jobs need a
    fine-tuned model that is not there yet."""
    chains = {}
    for checkpoint in farm["checkpoints"]:
        stages = [job.stage for job in jobs if job.checkpoint is checkpoint and job.stage != "zero-shot"
                  and not job.done() and not finetuned(job.model)]
        if stages:
            chains[checkpoint["name"]] = _chain_args(farm, checkpoint, max(stages))
    return chains


def _chain_args(farm: dict, checkpoint: dict, up_to: str) -> list[str]:
    finetune = farm["finetune"]
    args = ["finetune-stages", "--model", str(checkpoint["model"]), "--out",
            str(finetune_dir(Path(farm["out"]), checkpoint)), "--config", str(finetune["config"]), "--up-to", up_to,
            *encoding_args(checkpoint)]
    if "data" in finetune:
        args += ["--data", *map(str, finetune["data"])]
    else:
        kind = "msmarco" if "msmarco" in finetune else "beir"
        args += [f"--{kind}", str(finetune[kind])]
    for key in ("split", "negatives", "depth", "teacher_init", "nproc"):
        if key in finetune:
            args += [f"--{key.replace('_', '-')}", str(finetune[key])]
    tracking = farm["tracking"]
    overrides = list(finetune.get("overrides", []))
    if tracking.get("enabled", True) is False:
        overrides.append("tracking.enabled=false")
    else:  # the fine-tuning runs in the farm's store and experiment
        overrides += ["tracking.enabled=true", f"tracking.uri={_tracking_uri(farm)}",
                      f"tracking.experiment={tracking.get('experiment', 'pretrieve-eval')}"]
    return args + [f"--set={item}" for item in overrides]


def _tracking_uri(farm: dict) -> str:
    return farm["tracking"].get("uri") or f"sqlite:///{Path(farm['out']).resolve() / 'mlflow.db'}"


def run_farm(path: str | Path, slurm_jobs: str | None = None, progress: bool = True, env: dict | None = None) -> dict:
    """Run (or, with `slurm_jobs`, list) the pending fine-tuning chains, then the pending evaluation jobs; log
    every done job to MLflow once. `env`: the jobs' environment (None: this process's)."""
    farm = load_farm(path)
    check_out(farm)
    jobs = jobs_of(farm)
    pending = [job for job in jobs if not job.done()]
    if slurm_jobs is not None:  # chains first: their evaluation jobs wait for the next call
        chains = chains_of(farm, pending)
        lines = [args for args in chains.values()] or [job.eval_args(farm["eval"]) for job in pending]
        write_atomic(Path(slurm_jobs), "".join(shlex.join(args) + "\n" for args in lines))
        logged = log_done(jobs, farm, progress)
        return {"jobs": len(jobs), "ran": 0, "failed": {}, "pending_for_slurm": len(lines),
                "pending_chains": len(chains), "logged": logged}
    with ChildProcesses() as children:
        ran, failed, stopped = run_pending(farm, path, pending, children, progress, env)
    if children.stopped:  # what finished is done (and logged by the next run); the rest is not
        raise stop_exit(children.stopped, f"{stopped} of {ran} jobs stopped or not started (none of them is "
                                          "done)", "run the same command again to finish them")
    logged = log_done(jobs, farm, progress)
    if write_dims(farm, jobs) and progress:
        print(f"farm: NDCG@10 against dimension in {Path(farm['out']) / 'dims.md'}", file=sys.stderr)
    return {"jobs": len(jobs), "ran": ran - len(failed), "failed": failed, "pending_for_slurm": 0, "logged": logged}


def run_pending(farm: dict, path: str | Path, pending: list[Job], children: ChildProcesses, progress: bool,
                env: dict | None = None) -> tuple[int, dict[str, str], int]:
    """Run the fine-tuning chains the `pending` jobs need, then the jobs, under `children` (whose stop signals
    cut them off), in environment `env` (None: this process's). Returns (chains + jobs, {name: why} of those that
    failed, how many a stop signal cut off or kept from starting)."""
    chains = chains_of(farm, pending)
    failed: dict[str, str] = {}
    ranks = int(farm.get("finetune", {}).get("nproc", 1))  # a fine-tuning chain's devices
    devices, at_once = _placement(farm, path, ranks if chains else 1)
    mark_out(farm)
    bar = Progress(len(chains) + len(pending), "farm", unit="job", enabled=progress)
    stopped: list[str] = []  # cut off by a stop signal, or not started after it: not done

    def report(name: str, error: str | None) -> None:
        if error is STOPPED:
            stopped.append(name)
            return
        if error:
            failed[name] = error
        if progress:
            bar.note(f"farm: {name} {'failed: ' + error if error else 'done'}")
        bar.update()

    with bar, ThreadPoolExecutor(max_workers=at_once) as pool:
        names = list(chains)
        logs = [finetune_dir(Path(farm["out"]), {"name": n}) / "finetune.log" for n in names]
        for name, error in zip(names, pool.map(lambda a: _run(children, a[0], a[1], None, devices, env, ranks),
                                               zip(chains.values(), logs))):
            report(f"{name}/finetune", error)
        runnable = [job for job in pending if job.stage == "zero-shot" or finetuned(job.model)]
        for job in pending:
            if job not in runnable:
                report(job.name, STOPPED if children.stopped else
                       f"no fine-tuned model at {job.model} (its fine-tuning chain failed)")
        for job, error in zip(runnable, pool.map(lambda j: _run(children, j.eval_args(farm["eval"]),
                                                                j.out / "eval.log", j, devices, env), runnable)):
            report(job.name, error)
    return len(chains) + len(pending), failed, len(stopped)


def _placement(farm: dict, path: str | Path, ranks: int) -> tuple[DevicePool | None, int]:
    """The devices the jobs share (None: no GPU seen and none named; the jobs' environment is left as it is) and
    how many jobs run at once: one per device, else `workers`. `ranks`: the most devices one job takes."""
    devices = node_devices(farm.get("gpus"), f"{path}: gpus")
    if not devices:
        return (None if devices is None else DevicePool([])), max(1, int(farm["workers"]))
    if ranks > len(devices):
        raise ValueError(f"{path}: finetune.nproc: a fine-tuning chain of {ranks} ranks needs {ranks} devices at "
                         f"once; gpus gives {len(devices)} ({','.join(devices)})")
    return DevicePool(devices), len(devices)


def _run(children: ChildProcesses, args: list[str], log: Path, job: Job | None, devices: DevicePool | None,
         env: dict | None, needs: int = 1) -> str | None:
    """Run `pretrieve ARGS` in its own process, in environment `env` (None: this process's), on `needs` devices of
    `devices` (waiting for them to be free), output to `log`; None on success, STOPPED, or where to read why it
    failed."""
    with nullcontext() if devices is None else devices.held(needs) as held:
        code = children.run_job([sys.executable, "-m", "pretrieve", *args], log, env=visible_env(held, env))
    if code is STOPPED:
        return STOPPED
    if code != 0 or (job is not None and not job.done()):
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        return f"exit {code}: {last[0] if last else ''} (log: {log})"
    return None


def log_done(jobs: list[Job], farm: dict, progress: bool) -> list[str]:
    """Log the done jobs not logged yet; then write again the model cards of the run exports they evaluated
    (eval.model_card), now with these evaluations. Returns the names of the jobs logged."""
    from pretrieve.eval.model_card import has_generated_card, write_model_card

    logged = [job for job in jobs if job.done() and _log_job(job, farm)]
    for model in sorted({job.model for job in logged if job.model is not None}):
        if model.name == "export" and (model.parent / "config.yaml").is_file() and has_generated_card(model):
            try:
                write_model_card(model, model.parent, tracking_uri=_tracking_uri(farm))
            except (OSError, ValueError, KeyError) as e:  # the evaluations are logged; the card can wait
                print(f"farm: model card of {model} not updated ({e}); `pretrieve card {model.parent}` retries",
                      file=sys.stderr)
                continue
            if progress:
                print(f"farm: model card {model / 'README.md'} updated", file=sys.stderr)
    return [job.name for job in logged]


def _parent_run(job: Job, uri: str) -> tuple[str, str] | None:
    """(run id, experiment id) of the checkpoint's pre-training run, when it is in this MLflow store."""
    run_dir = job.checkpoint.get("run_dir")
    record = Path(run_dir) / "run.json" if run_dir else None
    if record is None or not record.is_file():
        return None
    info = json.loads(record.read_text())
    if not info.get("tracking_uri") or store_location(info["tracking_uri"]) != store_location(uri) \
            or not info.get("run_id"):
        return None
    from pretrieve.utils.mlflow_store import mlflow_client

    return info["run_id"], mlflow_client(uri).get_run(info["run_id"]).info.experiment_id


def _log_job(job: Job, farm: dict) -> bool:
    """Log a done job as an MLflow run, once (OUT/mlflow.json); True when it was logged now."""
    from pretrieve.utils.mlflow_store import mlflow_client

    record = job.out / "mlflow.json"
    tracking = farm["tracking"]
    if record.is_file() or tracking.get("enabled", True) is False:
        return False
    uri = _tracking_uri(farm)
    client = mlflow_client(uri)
    parent = _parent_run(job, uri)
    # artifacts beside the farm's outputs, not in ./mlruns under the caller's cwd
    experiment_id = parent[1] if parent else experiment_id_of(
        client, tracking.get("experiment", "pretrieve-eval"), (Path(farm["out"]).resolve() / "mlartifacts").as_uri())
    tags = {"pretrieve.farm": "eval", "checkpoint": job.checkpoint["name"], "dataset": job.dataset["name"],
            "stage": job.stage}
    if job.model is not None:
        tags["model_dir"] = str(job.model.resolve())  # how a model card finds its evaluations
    if parent:
        tags["mlflow.parentRunId"] = parent[0]
    step = job.checkpoint.get("step")  # a followed run's checkpoint (orchestrate/follow.py): its training step
    if step is not None:
        tags.update({"step": str(step), "follow": job.checkpoint["follow"]})
    run_id = log_eval_run(client, experiment_id, job.out, tags, run_name=job.name.replace("/", "-"), step=step)
    write_atomic(record, json.dumps({"tracking_uri": uri, "run_id": run_id}))
    return True
