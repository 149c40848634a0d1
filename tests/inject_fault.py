"""Stands in for python: `inject_fault.py -m pretrieve ARGS` runs `python -m pretrieve ARGS` with one fault
injected at an exact point of the training loop, so a test kills or pauses a rank where it means to, not where
a timer happens to land. launchers/pretrain.sh runs it as PRETRIEVE_PYTHON through `python_with_fault`.

The fault, from the environment (nothing is injected without FAULT_AT):
  FAULT_AT    step    after step FAULT_STEP is logged (train.log_every=1), before its checkpoint
              save    while this rank's optimizer-state file of tag FAULT_STEP is written: half of it on disk
              tag     after tag FAULT_STEP is complete (its config.yaml written), before `latest` names it
              prune   after `latest` names tag FAULT_STEP, before older tags are pruned
            and the faults a health alarm finds (engine/health.py), in the pre-training recipe's job:
              nan     the loss of step FAULT_STEP is NaN, as a bad batch's would be
              leak    from step FAULT_STEP on, the masked tokens are left in the input: the model sees its targets
              frozen  from step FAULT_STEP on, no gradient reaches the weights (the loss cut off from the graph)
              lr      from step FAULT_STEP on, the schedule's lr is 0: it ends before train.max_steps
  FAULT_STEP  the step (tag step<N>)
  FAULT_DO    kill (SIGKILL itself, the default) | pause (wait until FAULT_MARK.go exists; a test that never
              creates it kills the paused process)
  FAULT_MARK  a file written (this process id) when the fault acts: a test waits for it, and its time is the
              moment of a kill
  FAULT_RANK  the rank that acts (default 0); the other ranks run unchanged
"""

import io
import os
import runpy
import shlex
import signal
import sys
import time
from pathlib import Path


def python_with_fault(folder: Path) -> Path:
    """An executable FOLDER/python that runs this file with this interpreter (PRETRIEVE_PYTHON takes one path)."""
    script = folder / "python"
    command = " ".join(shlex.quote(str(part)) for part in (sys.executable, Path(__file__).resolve()))
    script.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    script.chmod(0o755)
    return script


def _go(mark: Path) -> Path:
    return mark.with_name(mark.name + ".go")


def release(mark: Path) -> None:
    """Lets the run paused at FAULT_MARK go on (FAULT_DO=pause)."""
    _go(mark).touch()


def _act() -> None:
    mark = Path(os.environ["FAULT_MARK"]) if os.environ.get("FAULT_MARK") else None
    if mark is not None:
        mark.write_text(str(os.getpid()))
    if os.environ.get("FAULT_DO", "kill") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while not _go(mark).exists():
        time.sleep(0.05)


def _nan(step: int, now: int, batch: dict, forward) -> dict:
    out = forward(batch)
    return {**out, "loss": out["loss"] * float("nan")} if now == step else out


def _leak(step: int, now: int, batch: dict, forward) -> dict:
    import torch

    if now >= step:
        labels = batch["mlm_labels"]
        batch = {**batch, "input_ids": torch.where(labels != -100, labels, batch["input_ids"])}
    return forward(batch)


def _frozen(step: int, now: int, batch: dict, forward) -> dict:
    out = forward(batch)
    return {**out, "loss": out["loss"].detach() + 0 * out["loss"]} if now >= step else out  # its value, no gradient


def _in_forward(fault, step: int) -> None:
    """The pre-training job's module runs `fault(step, now, batch, forward)` instead of forward(batch), `now`
    being the optimizer step (1-based) the micro-batch computes."""
    from pretrieve import pretrain

    real_job = pretrain.pretraining_job

    def job(exp, rank):
        built = real_job(exp, rank)
        forward, schedule, now = built.module.forward, built.at_step, [0]

        def at_step(step_now):
            now[0] = step_now + 1
            if schedule is not None:
                schedule(step_now)

        built.module.forward = lambda batch: fault(step, now[0], batch, forward)
        built.at_step = at_step
        return built

    pretrain.pretraining_job = job


def _install(at: str, step: int) -> None:
    import torch

    from pretrieve.engine import checkpoint
    from pretrieve.engine.metrics import MetricsWindow

    tag = f"step{step:08d}"
    if at == "step":
        real_log = MetricsWindow.log

        def log(window, step_now, *args, **kwargs):
            record = real_log(window, step_now, *args, **kwargs)
            if step_now == step:
                _act()
            return record

        MetricsWindow.log = log
    elif at == "save":
        real_save = torch.save

        def save(obj, path, *args, **kwargs):
            if tag in str(path) and str(path).endswith("optim_states.pt"):
                whole = io.BytesIO()
                real_save(obj, whole, *args, **kwargs)
                with open(path, "wb") as half:
                    half.write(whole.getvalue()[:len(whole.getvalue()) // 2])
                    half.flush()
                    os.fsync(half.fileno())
                _act()
            return real_save(obj, path, *args, **kwargs)

        torch.save = save
    elif at == "tag":
        real_write = checkpoint.write_atomic

        def write_atomic(path, text):
            if Path(path).name == checkpoint.LATEST and text == tag:
                _act()
            return real_write(path, text)

        checkpoint.write_atomic = write_atomic
    elif at == "prune":
        real_prune = checkpoint.prune_tags

        def prune_tags(ckpt_dir, latest, keep, every):
            if latest == tag:
                _act()
            return real_prune(ckpt_dir, latest, keep, every)

        checkpoint.prune_tags = prune_tags
    elif at in ("nan", "leak", "frozen"):
        _in_forward({"nan": _nan, "leak": _leak, "frozen": _frozen}[at], step)
    elif at == "lr":
        from pretrieve.engine.lr_schedule import LRSchedule

        real_factor = LRSchedule.factor
        LRSchedule.factor = lambda schedule, k: 0.0 if k + 1 >= step else real_factor(schedule, k)
    else:
        raise SystemExit(f"inject_fault.py: FAULT_AT={at!r}: expected step, save, tag, prune, nan, leak, frozen or lr")


if __name__ == "__main__":
    if sys.argv[1:3] != ["-m", "pretrieve"]:
        raise SystemExit("usage: inject_fault.py -m pretrieve ARGS")
    if os.environ.get("FAULT_AT") and os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0"):
        _install(os.environ["FAULT_AT"], int(os.environ["FAULT_STEP"]))
    sys.argv = [sys.argv[0], *sys.argv[3:]]
    runpy.run_module("pretrieve", run_name="__main__", alter_sys=True)
