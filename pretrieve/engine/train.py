"""`pretrieve pretrain` (and `pretrieve finetune`): one readable training loop around a DeepSpeed engine.

config -> head (registry) -> stream + collator -> deepspeed.initialize (ds_configs/, "auto" filled from
`train:`) -> loop: forward, backward, step; metrics.jsonl every `log_every` steps; a checkpoint every
`checkpoint.every` steps and at the end (model, optimizer, scheduler, stream position, RNG states,
counters); `resume: auto` continues from the latest complete checkpoint.

Checkpoints are DeepSpeed tags under run_dir/checkpoints/. The `latest` file is written (atomically) only
after a tag is complete, so a crash while saving leaves the previous checkpoint in charge.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pretrieve.config import ConfigError, Experiment, deepspeed_config
from pretrieve.engine.allocator import keep_freed_memory
from pretrieve.engine.determinism import deterministic
from pretrieve.engine.export_checkpoint import ENCODER_CONFIG, export_checkpoint
from pretrieve.engine.flops import device_peak, train_flops
from pretrieve.engine.lr_schedule import LRSchedule, start_at
from pretrieve.engine.preemption import StopFlag, prebuild_ops, retryable_startup, shield_children
from pretrieve.engine.rng import rng_state, seed_everything, set_rng_state
from pretrieve.engine.resume_check import check_resume, record_changes, saved_config
from pretrieve.utils.run_dir import LATEST, TAG_CONFIG, latest_checkpoint, prune_tags, write_atomic
from pretrieve.utils.run_lock import DirectoryLock
from pretrieve.engine.tracking import Tracker, run_params, run_tags
from pretrieve.engine.universal import is_universal
from pretrieve.engine.validation import VALIDATION_SEED, Validation
from pretrieve.progress import Progress

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
    #               describe_position() for the line a resumed run prints
    count: Callable[[dict], tuple[int, int]]  # (samples, non-padding tokens) of a batch
    flops: Callable[[dict], int]  # training FLOPs of a micro-batch (engine.flops)
    export: Callable[[Path], Any]  # rank 0, after the final checkpoint: run_dir -> run_dir/export
    tags: dict  # MLflow run tags
    validation: Validation | None = None  # held-out batches scored every train.eval_every steps


def train(exp: Experiment) -> dict:
    """Pre-train exp.method on exp.data."""
    return run_training(exp, _pretraining_job)


def _pretraining_job(exp: Experiment, rank: int) -> TrainingJob:
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.remote import ReadOptions
    from pretrieve.data.stream import ShardStream, StreamLoader
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    head = exp.method.build(exp.options, exp.model, seed=exp.seed)
    if rank == 0:  # the architecture, also when it came from model.init_from: `pretrieve export` rebuilds from it
        head.encoder.config.to_json_file(exp.run_dir / ENCODER_CONFIG)
    if exp.train.activation_checkpointing:
        head.encoder.enable_activation_checkpointing()
    collate = exp.method.collator.from_options(exp.options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)),
                                               seed=exp.seed)
    read = ReadOptions.from_options(exp.data)  # URLs: retries, timeout, prefetch, storage options
    stream = ShardStream(exp.data.manifests, weights=exp.data.weights, seed=exp.seed,
                         shuffle_buffer=exp.data.shuffle_buffer, read=read)
    # The loader's own generator: starting an iteration must not draw from the global RNG (dropout), or a
    # resumed run, which starts its iteration at another step, would drift from an uninterrupted one.
    loader = StreamLoader(stream, batch_size=exp.train.micro_batch_size, num_workers=exp.data.num_workers,
                          collate_fn=collate, generator=torch.Generator().manual_seed(exp.seed),
                          pin_memory=torch.cuda.is_available())  # page-locked batches: asynchronous copies
    validation = None
    if exp.data.validation:
        validation = Validation.build(exp.data.validation, exp.method.collator.from_options(
            exp.options, collate.vocab, seed=VALIDATION_SEED), exp.train.micro_batch_size, exp.data.validation_batches,
            read)
    return TrainingJob(
        name=f"pretrain {exp.method.name}", module=head, loader=loader, position=stream,
        count=lambda batch: (len(batch["input_ids"]), int(batch["attention_mask"].sum())),
        flops=lambda batch: train_flops(exp.method.name, exp.options, head.encoder.config, batch),
        # from the final checkpoint: ZeRO partitions consolidated, fp32 master weights under bf16/fp16
        export=lambda run_dir: export_checkpoint(run_dir, run_dir / "export"),
        tags=run_tags(exp.method.name, exp.data.corpora, head.encoder.config), validation=validation)


def run_training(exp, build_job: Callable[[Any, int], TrainingJob]) -> dict:
    """Train the job `build_job(exp, rank)` returns under the run settings of `exp` (seed, run_dir, resume,
    train, checkpoint, tracking, raw)."""
    if exp.train.precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("train.precision: fp16 needs a CUDA device (DeepSpeed refuses fp16 on CPU); "
                          "use bf16 or fp32")
    rank, world = _distributed_env()
    # takes over a signal held since the process started (engine/preemption.py); one that comes during the slow
    # start (data, deepspeed.initialize, checkpoint load) stops the run before its first step or at it
    stop = StopFlag(exp.train.max_runtime)
    # rank 0 holds the run directory for the run's life: a second trainer there is refused, naming this one
    lock = DirectoryLock(exp.run_dir, "trainer") if rank == 0 else contextlib.nullcontext()
    try:
        with lock, deterministic(exp.train.deterministic):
            return _run_training(exp, build_job, rank, world, stop)
    finally:
        stop.restore()


def _run_training(exp, build_job, rank: int, world: int, stop: StopFlag) -> dict:
    import deepspeed
    from omegaconf import OmegaConf

    if not torch.cuda.is_available():
        keep_freed_memory()  # ~10% of a CPU step went to page faults on re-allocated tensors
    seed_everything(exp.seed + rank)
    run_dir, ckpt_dir = exp.run_dir, exp.run_dir / "checkpoints"
    if exp.resume != "auto" and latest_checkpoint(run_dir) is not None:
        raise ValueError(f"run_dir: {run_dir} already holds checkpoints; pass resume=auto to continue that run, "
                         "or choose another run_dir")
    tag = latest_checkpoint(run_dir) if exp.resume == "auto" else None
    branch = exp.init_checkpoint if tag is None else None
    fresh = tag is None and branch is None
    config = OmegaConf.to_container(exp.raw, resolve=True)
    changes = {}
    if tag is not None and (saved := saved_config(ckpt_dir, tag)) is not None:  # before anything is written
        changes = check_resume(*saved, config, exp.section_classes, universal=is_universal(ckpt_dir / tag))
    config_yaml = OmegaConf.to_yaml(exp.raw, resolve=True)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / "config.yaml", config_yaml)
        if tag is not None:  # a kill between moving `latest` and pruning left older tags
            prune_tags(ckpt_dir, tag, exp.checkpoint.keep)
        elif fresh:  # what an attempt that died before its first checkpoint logged goes (its MLflow run too)
            _truncate_metrics(run_dir / "metrics.jsonl", 0)

    job = build_job(exp, rank)
    stream, loader = job.position, job.loader
    ds_config = deepspeed_config(exp)
    if tag is not None and is_universal(ckpt_dir / tag):  # written by `pretrieve universal`: any world size
        ds_config["checkpoint"] = {"load_universal": True}
    # DeepSpeed JIT-builds ops in compilers, which must outlive a preemption signal (SLURM signals them too), and
    # joins the rendezvous, whose failure may pass (exit 86: the launcher requeues)
    prebuild_ops(ds_config)
    with shield_children(), retryable_startup("joining the job (deepspeed.initialize)", exp.train.startup_timeout):
        engine, _, _, _ = deepspeed.initialize(model=job.module, config=ds_config, model_parameters=[
            p for p in job.module.parameters() if p.requires_grad], lr_scheduler=LRSchedule.of(exp.train).scheduler)
    if why := stop.should_stop(world, engine.device):  # stopped during start-up: nothing trained since `tag`
        raise stop.stopped(why, ckpt_dir / tag if tag else None)
    tracker = None
    if rank == 0:
        tracker = Tracker(exp.tracking, run_dir, run_params(config, ds_config), job.tags, fresh=fresh)
        record_changes(run_dir, tag, changes, tracker)

    counters = {"samples": 0, "tokens": 0}
    if not fresh:
        # a branch takes everything of another run's checkpoint but its schedule, which starts at that step
        counters = _load_checkpoint(engine, stream, (ckpt_dir, tag) if branch is None else branch,
                                    branch is not None, exp.seed, rank, world)

    if rank == 0 and not fresh:
        _truncate_metrics(run_dir / "metrics.jsonl", engine.global_steps)  # a crashed attempt's later steps rerun
    metrics = open(run_dir / "metrics.jsonl", "a") if rank == 0 else None
    peak = device_peak(engine.device, exp.train.precision, exp.train.peak_flops) if rank == 0 else None
    window = {"loss": 0.0, "parts": {}, "micro": 0, "tokens": 0, "samples": 0, "flops": 0,
              "started": time.perf_counter()}
    last_step = min(exp.train.max_steps, exp.train.stop_at or exp.train.max_steps)  # of this invocation
    eval_every = exp.train.eval_every or exp.train.max_steps  # held-out loss: every N steps, and at the end
    bar = Progress(exp.train.max_steps, job.name, unit="step", enabled=rank == 0, initial=engine.global_steps)
    try:
        while engine.global_steps < last_step:
            for batch in loader:
                # counted on the host before the copy: counting device tensors would wait for the GPU each step
                samples, tokens = job.count(batch)
                window["flops"] += job.flops(batch)
                batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
                out = engine(batch)
                engine.backward(out["loss"])
                boundary = engine.is_gradient_accumulation_boundary()  # asked before step(), which advances it
                log_now = boundary and ((engine.global_steps + 1) % exp.train.log_every == 0
                                        or engine.global_steps + 1 == last_step)
                plain_norm = _plain_grad_norm(engine) if log_now else None
                lr = engine.get_lr()[0]  # the lr of this update: step() moves the schedule on
                engine.step()
                counters["samples"] += samples
                counters["tokens"] += tokens
                window["micro"] += 1
                window["tokens"] += tokens
                window["samples"] += samples
                for name, value in out.items():  # summed on the device: read back at log steps only
                    sums = window if name == "loss" else window["parts"]
                    sums[name] = sums.get(name, 0.0) + value.detach().double()
                if not boundary:
                    continue
                step = engine.global_steps
                bar.update(1)
                if log_now:
                    record = _log(metrics, tracker, step, window, engine, peak, plain_norm, lr)
                    bar.postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
                if job.validation is not None and (step % eval_every == 0 or step == exp.train.max_steps):
                    _write(metrics, tracker, {"step": step, **job.validation.evaluate(engine, engine.device)})
                stopping = (world == 1 or log_now or step % exp.checkpoint.every == 0 or step == last_step) \
                    and stop.should_stop(world, engine.device)
                if step % exp.checkpoint.every == 0 or step == last_step or stopping:
                    saved = save_checkpoint(engine, ckpt_dir, step, stream, counters, exp.checkpoint.keep, rank,
                                            world, config_yaml)
                if stopping:  # a Stop: preempted or interrupted
                    if tracker is not None:
                        tracker.finish("KILLED")  # reopened by resume=auto
                    if world > 1:  # nobody exits before rank 0 has moved `latest`: the deepspeed launcher
                        torch.distributed.barrier()  # and torchrun end every rank once one exits non-zero
                    raise stop.stopped(stopping, ckpt_dir / saved, step)
                if step >= last_step:
                    break
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
    if world > 1:  # the run's totals; this also waits for every rank's last checkpoint shard
        import torch.distributed as dist

        totals = torch.tensor([counters["samples"], counters["tokens"]], dtype=torch.int64, device=engine.device)
        dist.all_reduce(totals)
        counters = dict(zip(("samples", "tokens"), totals.tolist()))
    finished = engine.global_steps >= exp.train.max_steps  # else stopped at train.stop_at: resume=auto goes on
    if rank == 0 and finished:
        job.export(run_dir)
    if tracker is not None:
        tracker.finish("FINISHED" if finished else "KILLED")
    return {"step": engine.global_steps, **counters, "checkpoint": latest_checkpoint(run_dir),
            "export": str(run_dir / "export") if finished else None, "mlflow_run_id": tracker.run_id if tracker else None}


def _load_checkpoint(engine, position, source: tuple[Path, str], branch: bool, seed: int, rank: int,
                     world: int) -> dict:
    """Restores the engine, the data position and the RNGs from checkpoint `source` (folder, tag); returns the
    sample and token counters this rank continues from. Rank 0 says where the run goes on."""
    folder, tag = source
    _, client = engine.load_checkpoint(str(folder), tag=tag, load_lr_scheduler_states=not branch)
    if client is None:
        raise RuntimeError(f"{folder / tag}: DeepSpeed could not load this checkpoint (see its log above)")
    if branch:
        start_at(engine.lr_scheduler, engine.global_steps)
    if len(client["stream"]) == world:
        position.load_state_dict(client["stream"][rank])
        set_rng_state(client["rng"][rank], f"{folder / tag}")
        counters = client["counters"][rank]
    else:  # another world size (universal checkpoint): ranks ran in lockstep, any rank's position is all's
        position.load_state_dict(client["stream"][0])
        seed_everything(seed + engine.global_steps + rank)
        counters = {key: sum(c[key] for c in client["counters"]) if rank == 0 else 0  # the run's totals so far
                    for key in ("samples", "tokens")}
    if rank == 0:
        start = f"resuming from {tag}" if not branch else f"branching from {folder / tag}"
        print(f"pretrieve: {start} (data position: {position.describe_position()})", file=sys.stderr, flush=True)
    return counters


def _truncate_metrics(path: Path, step: int) -> None:
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        write_atomic(path, "".join(line for line in lines if json.loads(line)["step"] <= step))


def _plain_grad_norm(engine) -> float | None:
    """The gradient norm where DeepSpeed does not keep it (ZeRO 0 in fp32 clips with it and drops it); the
    gradients are already averaged over ranks at the accumulation boundary."""
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def _log(metrics, tracker, step: int, window: dict, engine, peak: float | None, grad_norm: float | None,
         lr: float) -> dict:
    """One metrics record on rank 0: losses averaged over ranks and micro-batches, throughput summed over all
    ranks (tokens: non-padding), TFLOP/s and MFU per device (engine.flops), the last step's gradient norm
    (before clipping) and, with fp16, the loss scale."""
    import torch.distributed as dist

    names = sorted(window["parts"])
    losses = torch.stack([window["loss"], *(window["parts"][n] for n in names)])  # on the device: one sync here
    counts = torch.tensor([window["micro"], window["tokens"], window["samples"], window["flops"]],
                          dtype=torch.float64, device=losses.device)
    sums = torch.cat([losses, counts])
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        dist.all_reduce(sums)
    loss, *parts, micro, tokens, samples, flops = sums.tolist()
    seconds = time.perf_counter() - window["started"]  # after the sync: the GPU has finished the window's work
    micro = max(micro, 1)
    device_flops = flops / world / seconds
    record = {"step": step, "loss": loss / micro, **{n: v / micro for n, v in zip(names, parts)},
              "lr": lr, "tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds,
              "tflops_per_device": device_flops / 1e12}
    if peak:
        record["mfu"] = device_flops / peak
    if grad_norm is None:
        grad_norm = engine.get_global_grad_norm()
    if grad_norm is not None:
        record["grad_norm"] = float(grad_norm)
    if engine.fp16_enabled():
        record["loss_scale"] = float(engine.optimizer.cur_scale)
    _write(metrics, tracker, record)
    window.update(loss=0.0, parts={}, micro=0, tokens=0, samples=0, flops=0, started=time.perf_counter())
    return record


def _write(metrics, tracker, record: dict) -> None:
    """One record (with its "step") to metrics.jsonl and MLflow, on rank 0 (the others hold None)."""
    if metrics is not None:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
    if tracker is not None:
        tracker.log_metrics(record["step"], record)


def save_checkpoint(engine, ckpt_dir: Path, step: int, stream, counters: dict, keep: int, rank: int,
                    world: int, config_yaml: str) -> str:
    """Save tag `step<N>` (its config last, the mark of a complete tag), then point `latest` at it, then drop
    all but the newest `keep` tags. A failed save (a full disk) names the tag and leaves `latest` as it was."""
    import torch.distributed as dist

    tag = f"step{step:08d}"
    if rank == 0:  # what a crashed attempt left of this tag (never `latest`: that moves only after a save);
        shutil.rmtree(ckpt_dir / tag, ignore_errors=True)  # the all_gather below holds the other ranks back
    mine = {"stream": stream.state_dict(), "rng": rng_state(), "counters": dict(counters)}
    every = [mine] if world == 1 else [None] * world  # DeepSpeed saves client state from rank 0 only
    if world > 1:
        dist.all_gather_object(every, mine)
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False,
                               client_state={key: [s[key] for s in every] for key in mine})
        if world > 1:
            dist.barrier()
        if rank == 0:
            write_atomic(ckpt_dir / tag / TAG_CONFIG, config_yaml)
    except (OSError, RuntimeError) as e:
        raise _save_failed(ckpt_dir, tag, e) from e
    if rank == 0:
        write_atomic(ckpt_dir / LATEST, tag)
        prune_tags(ckpt_dir, tag, keep)
    return tag


def _save_failed(ckpt_dir: Path, tag: str, error: Exception) -> OSError:
    """The save's error in words: torch reports a full disk as "unexpected pos" from its zip writer. The half
    tag is removed (it frees the space it took; `latest` still names the previous one: resume=auto works)."""
    shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
    latest = latest_checkpoint(ckpt_dir.parent)
    full = getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in str(error) or \
        "No space left" in str(error) or shutil.disk_usage(ckpt_dir).free < 16 * 2**20
    # a save is a collective (ZeRO partitions, the barrier before `latest` moves): a rank that died breaks it
    peer = not full and (isinstance(error, (ConnectionError, torch.distributed.DistError))
                         or "by peer" in str(error) or "Connection closed" in str(error))
    why = ("no space left on device: " if full else "another rank failed or died during the save: " if peer
           else "") + f"{type(error).__name__}: {str(error)[:300]}"
    fix = "free space" if full else "see the other ranks' logs" if peer else "fix the cause"
    return OSError(errno.ENOSPC if full else errno.EIO,
                   f"{ckpt_dir / tag}: saving the checkpoint failed: {why}. `latest` still names "
                   f"{latest or 'nothing'}: {fix} and rerun with resume=auto")
