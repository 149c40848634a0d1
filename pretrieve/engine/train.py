"""The training loop, shared by pre-training (pretrieve/pretrain.py) and fine-tuning (finetune/run.py): one
readable loop around a DeepSpeed engine, calling components (docs/design.md, "Layers").

A recipe builds a TrainingJob (the module, its loader and position, counts, FLOPs, export). The loop: where the
run starts (fresh, resumed from `latest`, or branched from another run's checkpoint, after resume_check has
compared configs) -> deepspeed.initialize (ds_configs/, "auto" filled from `train:`) -> load the checkpoint
(engine/checkpoint.py) -> forward, backward, step; the MetricsWindow (engine/metrics.py) writes metrics.jsonl
every `log_every` steps, where the health alarms (engine/health.py) judge the window; held-out loss
(engine/validation.py); a checkpoint every `checkpoint.every` steps and at the end, never of a non-finite state; a
stop signal or `train.max_runtime` (engine/preemption.py) saves at the next step boundary and exits.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pretrieve.config import ConfigError, RunExperiment
from pretrieve.engine.allocator import keep_freed_memory
from pretrieve.engine.checkpoint import Checkpointer, prune_tags
from pretrieve.engine.cuda_graphs import CapturedStep, check_device, check_module
from pretrieve.engine.deepspeed_import import import_deepspeed
from pretrieve.engine.determinism import deterministic
from pretrieve.engine.ds_config import deepspeed_config
from pretrieve.engine.flops import device_peak
from pretrieve.engine.health import Health
from pretrieve.engine.lr_schedule import LRSchedule
from pretrieve.engine.metrics import MetricsWindow, plain_grad_norm, truncate_metrics
from pretrieve.engine.optimizer import client_optimizer, clip_in_loop
from pretrieve.engine.ops import environment_ops, without_op_load_notice
from pretrieve.engine.preemption import StopFlag, Stopped, prebuild_ops, retryable_startup, shield_children
from pretrieve.engine.resume_check import check_resume, record_changes, saved_config, with_defaults
from pretrieve.engine.rng import seed_everything
from pretrieve.engine.tracking import Tracker, run_params
from pretrieve.engine.universal import is_universal
from pretrieve.engine.validation import Validation
from pretrieve.engine.world import forget_cpu_allreduce_buffer, unlink_cpu_allreduce_buffer
from pretrieve.models.speed_switches import Settings, apply_switches
from pretrieve.progress import Progress
from pretrieve.utils.health_options import health_options
from pretrieve.utils.run_dir import latest_checkpoint, write_atomic
from pretrieve.utils.run_lock import DirectoryLock


def _distributed_env() -> tuple[int, int]:
    """(rank, world size); a plain single process gets the env DeepSpeed needs to skip MPI discovery."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from pretrieve.engine.world import free_loopback_port

        os.environ["MASTER_PORT"] = str(free_loopback_port())
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


@dataclass
class TrainingJob:
    """What the loop trains; everything else (DeepSpeed, checkpoints, resume, logging, preemption) is shared by
    pre-training and fine-tuning."""

    name: str  # progress bar and log label
    module: torch.nn.Module  # forward(batch) -> {"loss": ..., other named loss parts}
    loader: Any  # re-iterable over batches (dicts of tensors)
    position: Any  # where the loader is: state_dict() / load_state_dict(), saved in every checkpoint, and
    #               describe_position() for the line a resumed run prints; optionally `last_batch` (where the
    #               batch just yielded came from, kept on the host) and describe_batch(that) for a health alarm
    count: Callable[[dict], tuple[int, int, int]]  # (samples, non-padding tokens, positions) of a batch
    flops: Callable[[dict], int]  # training FLOPs of a micro-batch (engine.flops)
    export: Callable[[Path], Any]  # rank 0, after the final checkpoint: run_dir -> run_dir/export
    tags: dict  # MLflow run tags
    validation: Validation | None = None  # held-out batches scored every train.eval_every steps
    # called with the optimizer step (0-based) each micro-batch computes, before its forward: a loss schedule
    # over training (a resume gives it the checkpoint's step, so the schedule resumes exactly)
    at_step: Callable[[int], None] | None = None
    # sections as the job runs them (MLflow params, over the config with its defaults): a default the job
    # resolves, as a head's skip_from or fine-tuning's FLOPS weights, with the value used
    resolved: dict = field(default_factory=dict)


def run_training(exp: RunExperiment, build_job: Callable[[Any, int], TrainingJob]) -> dict:
    """Train the job `build_job(exp, rank)` returns under the run settings of `exp` (seed, run_dir, resume,
    train, checkpoint, tracking, raw)."""
    if exp.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision: fp16 needs a CUDA device (DeepSpeed refuses fp16 on CPU); "
                          "use bf16 or fp32")
    if exp.train.cuda_graphs:
        check_device()
    rank, world = _distributed_env()
    # the export a finished run writes to run_dir/export: a folder there that is no export is refused now, not
    # after the last step (the same check as the export's own)
    from pretrieve.models.export import check_export_folder

    check_export_folder(exp.run_dir / "export", overwrite=True)
    # takes over a signal held since the process started (engine/preemption.py); one that comes during the slow
    # start (data, deepspeed.initialize, checkpoint load) stops the run before its first step or at it
    stop = StopFlag(exp.train.max_runtime)
    # rank 0 holds the run directory for the run's life: a second trainer there is refused, naming this one
    lock = DirectoryLock(exp.run_dir, "trainer") if rank == 0 else contextlib.nullcontext()
    created = rank == 0 and not exp.run_dir.exists()
    try:
        with lock, deterministic(exp.train.deterministic):
            return _run_training(exp, build_job, rank, world, stop)
    except BaseException:
        if created:  # a run that ended before its first step leaves no skeleton to mistake for a run
            _remove_untrained(exp.run_dir)
        raise
    finally:
        stop.restore()


def _remove_untrained(run_dir: Path) -> None:
    """Remove `run_dir`, made by this attempt, when no step of it remains: no checkpoint, nothing logged."""
    ckpt_dir, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
    if (ckpt_dir.is_dir() and any(ckpt_dir.iterdir())) or (metrics.is_file() and metrics.stat().st_size):
        return
    shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class _Start:
    """Where a run starts: `tag` of its own checkpoints (resume=auto), or `branch` (checkpoints dir, tag) of
    another run's, or neither (fresh); the config changes since `tag` (resume_check)."""

    tag: str | None
    branch: tuple[Path, str] | None
    changes: dict
    config: dict
    config_yaml: str

    @property
    def fresh(self) -> bool:
        return self.tag is None and self.branch is None


def _start(exp: RunExperiment, rank: int) -> _Start:
    """The resume decision, checked before anything in the run directory is written; then rank 0 writes the
    run's config and tidies what an earlier attempt left."""
    from omegaconf import OmegaConf

    run_dir, ckpt_dir = exp.run_dir, exp.run_dir / "checkpoints"
    if exp.resume != "auto" and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir: {run_dir} already holds checkpoints; pass resume=auto to continue that run, "
                         "or choose another run_dir")
    tag = latest_checkpoint(run_dir) if exp.resume == "auto" else None
    config = OmegaConf.to_container(exp.raw, resolve=True)
    changes = {}
    if tag is not None and (saved := saved_config(ckpt_dir, tag)) is not None:
        changes = check_resume(*saved, config, exp.section_classes, universal=is_universal(ckpt_dir / tag))
    start = _Start(tag, exp.init_checkpoint if tag is None else None, changes, config,
                   OmegaConf.to_yaml(exp.raw, resolve=True))
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", start.config_yaml)
        if tag is not None:  # a kill between moving `latest` and pruning left older tags
            prune_tags(ckpt_dir, tag, exp.checkpoint.keep, exp.checkpoint.every)
        elif start.fresh:  # what an attempt that died before its first checkpoint logged goes (its MLflow run too)
            truncate_metrics(run_dir / "metrics.jsonl", 0)
    return start


def _initialize(exp: RunExperiment, job: TrainingJob, start: _Start):
    """The DeepSpeed engine of `job`. DeepSpeed JIT-builds ops in compilers, which must outlive a preemption
    signal (SLURM signals them too), and joins the rendezvous, whose failure may pass (exit 86: the launcher
    requeues)."""
    import deepspeed

    ds_config = deepspeed_config(exp)
    parameters = [p for p in job.module.parameters() if p.requires_grad]
    optimizer = client_optimizer(exp.train, ds_config, parameters)  # train.optimizer; None: the ds_config's
    clip = clip_in_loop(exp.train, ds_config)  # the loop's max gradient norm; None: DeepSpeed's clipping
    if start.tag is not None and is_universal(exp.run_dir / "checkpoints" / start.tag):  # any world size
        ds_config["checkpoint"] = {"load_universal": True}
    with environment_ops():  # this environment's extension cache and ninja (engine/ops.py)
        prebuild_ops(ds_config)
        with shield_children(), without_op_load_notice(), retryable_startup(
                "joining the job (deepspeed.initialize)", exp.train.startup_timeout,
                on_failure=forget_cpu_allreduce_buffer):
            engine, _, _, _ = deepspeed.initialize(model=job.module, config=ds_config, model_parameters=parameters,
                                                   optimizer=optimizer, lr_scheduler=LRSchedule.of(exp.train).scheduler)
            unlink_cpu_allreduce_buffer()
    if engine.dp_world_size == 1 and not engine.zero_optimization():
        # one rank at ZeRO 0 has nothing to average, but DeepSpeed would still copy each gradient into a bucket,
        # reduce it with itself and copy it back: ops a parameter, each a kernel launch on a GPU
        engine.enable_backward_allreduce = False
    return engine, ds_config, clip


def _run_training(exp: RunExperiment, build_job, rank: int, world: int, stop: StopFlag) -> dict:
    import_deepspeed()  # before any other import of it: without its autotuner's mlflow (engine/deepspeed_import.py)
    if not torch.cuda.is_available():
        keep_freed_memory()  # ~10% of a CPU step went to page faults on re-allocated tensors
    seed_everything(exp.seed + rank)
    run_dir, ckpt_dir = exp.run_dir, exp.run_dir / "checkpoints"
    start = _start(exp, rank)
    job = build_job(exp, rank)
    if exp.train.cuda_graphs:  # what the config cannot say: the module the recipe built, the world
        check_module(job.module, world)
    apply_switches(job.module, Settings(train=exp.train))  # the speed switches' passes, in their one order
    engine, ds_config, clip = _initialize(exp, job, start)
    if why := stop.should_stop(world, engine.device):  # stopped during start-up: nothing trained since `tag`
        raise stop.stopped(why, ckpt_dir / start.tag if start.tag else None)
    tracker = None
    if rank == 0:
        config = {**with_defaults(start.config, exp.section_classes(start.config)), **job.resolved}  # what ran
        config["train"] = {**config["train"], "health": asdict(health_options(exp.train.health))}
        tracker = Tracker(exp.tracking, run_dir, run_params(config, ds_config), job.tags, fresh=start.fresh)
        record_changes(run_dir, start.tag, start.changes, tracker)
    try:
        return _train(exp, job, engine, ds_config, start, tracker, rank, world, stop, clip)
    except BaseException as e:  # a stop has ended its MLflow run as KILLED already
        if tracker is not None and not isinstance(e, Stopped):
            tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        raise


def _train(exp: RunExperiment, job: TrainingJob, engine, ds_config: dict, start: _Start, tracker: Tracker | None,
           rank: int, world: int, stop: StopFlag, clip: float | None) -> dict:
    run_dir, ckpt_dir = exp.run_dir, exp.run_dir / "checkpoints"
    health = Health(health_options(exp.train.health), engine.device, rank, world,
                    LRSchedule.of(exp.train).warmup_steps, engine.fp16_enabled(), run_dir, tracker, job.position)
    window = MetricsWindow(run_dir / "metrics.jsonl" if rank == 0 else None, tracker, engine,
                           device_peak(engine.device, exp.train.precision, exp.train.peak_flops) if rank == 0 else None,
                           health)
    checkpoints = Checkpointer(engine, ckpt_dir, job.position, exp.checkpoint, rank, world, start.config_yaml,
                               metrics=window, health=health)
    counters = {"samples": 0, "tokens": 0}
    if not start.fresh:
        # a branch takes everything of another run's checkpoint but its schedule, which starts at that step
        folder, tag = start.branch or (ckpt_dir, start.tag)
        counters = checkpoints.load(folder, tag, start.branch is not None, exp.seed)
        if rank == 0:
            truncate_metrics(run_dir / "metrics.jsonl", engine.global_steps)  # a crashed attempt's later steps rerun
    try:
        _train_steps(exp, job, engine, window, checkpoints, counters, stop, world, clip, health)
    finally:
        window.close()
    if world > 1:  # the run's totals; this also waits for every rank's last checkpoint shard
        totals = torch.tensor([counters["samples"], counters["tokens"]], dtype=torch.int64, device=engine.device)
        torch.distributed.all_reduce(totals)
        counters = dict(zip(("samples", "tokens"), totals.tolist()))
    finished = engine.global_steps >= exp.train.max_steps  # else stopped at train.stop_at: resume=auto goes on
    if rank == 0 and finished:
        job.export(run_dir)
    if tracker is not None:
        tracker.finish("FINISHED" if finished else "KILLED")
    return {"step": engine.global_steps, **counters, "checkpoint": latest_checkpoint(run_dir),
            "export": str(run_dir / "export") if finished else None, "mlflow_run_id": tracker.run_id if tracker else None}


def _train_steps(exp: RunExperiment, job: TrainingJob, engine, window: MetricsWindow, checkpoints: Checkpointer,
                 counters: dict, stop: StopFlag, world: int, clip: float | None = None,
                 health: Health | None = None) -> None:
    """The loop: micro-batches until step `train.stop_at` (or `max_steps`), or a stop signal's checkpoint."""
    health = health or Health.off(engine.device)
    last_step = min(exp.train.max_steps, exp.train.stop_at or exp.train.max_steps)  # of this invocation
    eval_every = exp.train.eval_every or exp.train.max_steps  # held-out loss: every N steps, and at the end
    trainable = [p for p in engine.module.parameters() if p.requires_grad] if clip is not None else []
    captured = CapturedStep(engine) if exp.train.cuda_graphs else None
    bar = Progress(exp.train.max_steps, job.name, unit="step", enabled=checkpoints.rank == 0,
                   initial=engine.global_steps)
    health.progress = bar
    try:
        while engine.global_steps < last_step:
            for batch in job.loader:
                origin = getattr(job.position, "last_batch", None)  # host-side: an alarm names its samples
                # counted on the host before the copy: counting device tensors would wait for the GPU each step
                samples, tokens, positions = job.count(batch)
                flops = job.flops(batch)
                if job.at_step is not None:
                    job.at_step(engine.global_steps)
                if captured is not None:  # train.cuda_graphs: forward and backward replayed (engine/cuda_graphs.py)
                    out = captured(batch)
                    health.add_micro(engine.global_steps + 1, out["loss"], origin)
                else:
                    batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
                    out = engine(batch)
                    health.add_micro(engine.global_steps + 1, out["loss"], origin)  # judged on the device
                    engine.backward(out["loss"])
                boundary = engine.is_gradient_accumulation_boundary()  # asked before step(), which advances it
                # the same steps wherever the run stops: a stop between them carries the window (checkpoint.py)
                log_now = boundary and ((engine.global_steps + 1) % exp.train.log_every == 0
                                        or engine.global_steps + 1 == exp.train.max_steps)
                if clip is not None and boundary:  # clip_in_loop: the module's gradients, averaged over ranks
                    norm = torch.nn.utils.clip_grad_norm_(trainable, clip, foreach=True)
                grad_norm = (float(norm) if clip is not None else plain_grad_norm(engine)) if log_now else None
                step_norm = health.norm_before_step(engine, norm if clip is not None else None) if boundary else None
                lr = engine.get_lr()[0]  # the lr of this update: step() moves the schedule on
                engine.step()
                counters["samples"] += samples
                counters["tokens"] += tokens
                window.add(out, samples, tokens, flops, positions)  # summed on the device: read at log steps
                if not boundary:
                    continue
                step = engine.global_steps
                health.add_step(step, lr, step_norm, engine)
                if log_now:  # before the count: the line the count may print shows this step's loss
                    record = window.log(step, lr, grad_norm)
                    bar.postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                **health.figures())
                bar.update(1)
                health.stop_if_alarmed()  # after the progress line shows it, before this step's checkpoint
                if job.validation is not None and (step % eval_every == 0 or step == exp.train.max_steps):
                    window.write({"step": step, **job.validation.evaluate(engine, engine.device)})
                stopping = (world == 1 or log_now or step % exp.checkpoint.every == 0 or step == last_step) \
                    and stop.should_stop(world, engine.device)
                if step % exp.checkpoint.every == 0 or step == last_step or stopping:
                    saved = checkpoints.save(step, counters) if health.may_save(step, log_now) else \
                        latest_checkpoint(exp.run_dir)
                if stopping:  # a Stop: preempted or interrupted
                    if window.tracker is not None:
                        window.tracker.finish("KILLED")  # reopened by resume=auto
                    if world > 1:  # nobody exits before rank 0 has moved `latest`: the deepspeed launcher
                        torch.distributed.barrier()  # and torchrun end every rank once one exits non-zero
                    raise stop.stopped(stopping, checkpoints.ckpt_dir / saved, step)
                if step >= last_step:
                    return
    finally:
        bar.close()
        if captured is not None and checkpoints.rank == 0:
            print(captured.summary(), file=sys.stderr, flush=True)
