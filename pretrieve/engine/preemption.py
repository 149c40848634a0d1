"""Stopping a training process: SIGTERM or SIGUSR1 (SLURM's pre-timeout signal, and its PreemptMode=REQUEUE)
asks for a checkpoint at the next step boundary and exit PREEMPTED_EXIT_CODE, which the SLURM launcher requeues.
SIGINT (Ctrl-C) asks for the same checkpoint, then ends the process as SIGINT does (status 130, never requeued:
a person stopped it); a second Ctrl-C ends it at once.

Such a signal may come at any moment, start-up included (imports, data, DeepSpeed's JIT build of its ops,
the rendezvous, the checkpoint load), and SLURM sends it to every process of the job step. So:
- `hold_stop_signals()`, at process start, records a signal instead of dying of it; StopFlag takes it over
  (`finetune-stages` and its child processes: engine/child_processes.py);
- `prebuild_ops()` JIT-builds the DeepSpeed ops that deepspeed.initialize would build, when missing from this
  environment's extension cache (engine/ops.py), in a child process that ignores the signals: so do the shells and compilers it runs (an ignored signal stays ignored
  across exec; a blocked one does not survive /bin/sh, which clears the mask);
- `shield_children()` around deepspeed.initialize: what it still runs (ninja finding nothing to do) inherits
  the signals blocked, and the training process takes them when the block ends;
- `retryable_startup()` turns a start-up failure that may pass on its own (the network, the rendezvous, a peer
  that died while the process group formed and left this rank waiting past its deadline) into exit
  RETRY_EXIT_CODE, which the launcher requeues a bounded number of times.
"""

from __future__ import annotations  # no torch at import: a training process installs the handlers first thing

import contextlib
import enum
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, NoReturn

from pretrieve.utils.stop_signals import (INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, RETRY_EXIT_CODE,
                                          STOP_SIGNALS)

if TYPE_CHECKING:
    from pathlib import Path

    import torch


# A repeat this soon after the first signal is the same request delivered twice (under PreemptMode=REQUEUE a task
# gets SIGTERM from slurmstepd and again from srun, which forwards its own); a later one is someone insisting.
REPEAT_WINDOW_S = 10.0

# The commands whose process holds the stop signals from its first line: a stop then ends them where their
# work so far is saved (at a step boundary, or before the first step), never in the middle of their start-up.
HOLDING_COMMANDS = ("pretrain", "finetune", "finetune-stages")

_signalled_at: float | None = None  # when this run's first stop signal came (time.monotonic())
_interrupted = False  # one of them was SIGINT


class Stop(enum.IntEnum):
    """Why a run stops. Ranks agree on the largest: a person's Ctrl-C outranks a preemption (no requeue)."""

    NONE = 0
    PREEMPTED = 1  # SIGTERM, SIGUSR1, train.max_runtime
    INTERRUPTED = 2  # SIGINT


class Stopped(SystemExit):
    """A stop signal ended the command where its work so far is saved; `line` says what happened (the command
    line prints it, once: on every rank, or on rank 0 alone where `every_rank` is False)."""

    every_rank = True

    def __init__(self, code: int, line: str):
        super().__init__(code)
        self.line = line


class Preempted(Stopped):
    """Raised once the run's newest checkpoint is its position (saved now, or nothing trained since the last
    one); exits the process with PREEMPTED_EXIT_CODE."""

    def __init__(self, during_start_up: bool = False, line: str | None = None):
        when = "during start-up, before the first step" if during_start_up else "checkpoint saved"
        super().__init__(PREEMPTED_EXIT_CODE, line or f"preempted, {when}; exit {PREEMPTED_EXIT_CODE} (resume=auto "
                                                      "continues)")
        self.during_start_up = during_start_up


class Interrupted(Stopped):
    """SIGINT ended the command, its work saved as `line` says; the process ends by SIGINT (cli.main). Ranks
    share a terminal: rank 0 alone prints the line."""

    every_rank = False

    def __init__(self, line: str):
        super().__init__(INTERRUPTED_EXIT_CODE, line)


def training_stopped(why: Stop, checkpoint: Path | None, step: int | None) -> Stopped:
    """How a training run stopped by `why` ends: `checkpoint` saved at `step` now, or (step None) the run's
    position from before its start-up, when the signal came before the first step."""
    if why == Stop.PREEMPTED:
        if step is None:
            return Preempted(during_start_up=True)
        return Preempted(line=f"preempted: saved step {step} to {checkpoint}; exit {PREEMPTED_EXIT_CODE} "
                              "(resume=auto continues)")
    if step is None:
        since = f"nothing trained since {checkpoint}" if checkpoint else "nothing trained yet"
        return Interrupted(f"interrupted during start-up, before the first step ({since}); rerun with resume=auto")
    return Interrupted(f"interrupted: saved step {step} to {checkpoint}; resume with resume=auto")


def stop_exit(why: Stop, left: str, then: str) -> Stopped:
    """The end of a command that runs others (farm, scale run) stopped by `why`, with `left` not done yet."""
    if why == Stop.PREEMPTED:
        return Preempted(line=f"preempted: {left}; exit {PREEMPTED_EXIT_CODE} ({then})")
    return Interrupted(f"interrupted: {left}; {then}")


def stop_of_status(code: int | None) -> Stop:
    """What a child `pretrieve` process's exit status says about how it stopped (NONE: it did not)."""
    if code == PREEMPTED_EXIT_CODE:
        return Stop.PREEMPTED
    if code in (-signal.SIGINT, INTERRUPTED_EXIT_CODE):  # ended by SIGINT, itself or through a shell
        return Stop.INTERRUPTED
    return Stop.NONE


def requested() -> Stop:
    """The stop this process was asked for and has not acted on yet."""
    return Stop.INTERRUPTED if _interrupted else Stop.PREEMPTED if _signalled_at is not None else Stop.NONE


class StartupFailed(SystemExit):
    """Start-up failed for a reason that may pass (nothing was trained): exits with RETRY_EXIT_CODE."""

    def __init__(self):
        super().__init__(RETRY_EXIT_CODE)


def _record(signum, frame) -> None:
    """The one handler, from process start (hold_stop_signals) through the run (StopFlag). SIGINT is never
    delivered twice for one request (SLURM repeats SIGTERM only): a second one is a person insisting."""
    global _signalled_at, _interrupted
    now = time.monotonic()
    if signum == signal.SIGINT:
        if _interrupted:  # where a handler was put back after the first (StopFlag.restore)
            end_by_sigint_now()
        _interrupted = True
        # the next Ctrl-C ends the process by the kernel's default action, at once, also while this thread is
        # in C code (a save, a collective), where a Python handler would wait (`latest` stays complete)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    elif _signalled_at is not None and now - _signalled_at > REPEAT_WINDOW_S:  # insisting: exit now
        os._exit(128 + signum)
    if _signalled_at is None:
        _signalled_at = now


def catchable(signals) -> list[int]:
    """The `signals` this process takes over: not SIGINT where it is ignored (inherited from `nohup` or a
    script's background job, which Python respects too), or left at its default by a first Ctrl-C."""
    return [sig for sig in signals if sig != signal.SIGINT
            or (signal.getsignal(sig) is not signal.SIG_IGN and not _interrupted)]


def hold_stop_signals(argv: list[str]) -> None:
    """Record stop signals from now on when `argv` is a training command's (call first thing in the process)."""
    if argv[:1] and argv[0] in HOLDING_COMMANDS:
        for sig in catchable(STOP_SIGNALS):
            signal.signal(sig, _record)


def end_by_sigint_now() -> None:
    """End this process as SIGINT's default action does (status 130 in a shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(INTERRUPTED_EXIT_CODE)  # not reached: the signal ended the process


def end_by_sigint_at_exit() -> NoReturn:
    """End the process by SIGINT once Python has shut down (atexit handlers, buffers): a shell running it in a
    script then stops the script too, as after any interrupted program; after a plain exit 130 it would go on
    (www.cons.org/cracauer/sigint.html). Python itself ends so when a KeyboardInterrupt goes uncaught; the
    traceback is left out: the command has said what happened."""
    hook = sys.excepthook
    sys.excepthook = lambda kind, value, tb: None if kind is KeyboardInterrupt else hook(kind, value, tb)
    raise KeyboardInterrupt


@contextlib.contextmanager
def interruptible():
    """Within, Ctrl-C raises KeyboardInterrupt at once: for a step whose output is written whole or not at all
    (mining, teacher scoring), where holding the signal to the step's end would keep a person waiting for
    nothing. Not where SIGINT is ignored or a first Ctrl-C is held already (the process stops after the step)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler) if main and catchable([signal.SIGINT]) \
        else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def shield_children():
    """Programs started inside (DeepSpeed's compilers) inherit the stop signals blocked; this process gets any
    that came meanwhile when the block ends (or at once, on another of its threads)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _jit_ops(ds_config: dict) -> list[str]:
    """The DeepSpeed op builders that deepspeed.initialize loads for this config on this accelerator."""
    from deepspeed.accelerator import get_accelerator

    names = ["ShareMemCommBuilder"] if get_accelerator().device_name() == "cpu" else []  # CPU collectives
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    # offloaded, DeepSpeed's Adam steps with its C++ CPU Adam, unless "torch_adam" asks for torch's (the ds_configs')
    # or there is no "optimizer" section: a client optimizer steps (train.optimizer torch-fused, engine/optimizer.py)
    optimizer = ds_config.get("optimizer")
    if offload.get("device") == "cpu" and optimizer and not optimizer.get("params", {}).get("torch_adam", False):
        names.append("CPUAdamBuilder")
    return names


def _ignore_stop_signals() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


_BUILD = """import sys
import deepspeed.ops
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME):
        builder.load(verbose=False)
"""


def prebuild_ops(ds_config: dict) -> None:
    """Build the ops deepspeed.initialize needs and the extension cache lacks, out of the signals' way, once no
    build holds their lock (a stale one is removed: engine/ops.py). Call within ops.environment_ops()."""
    import subprocess

    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    from pretrieve.engine.ops import build_directory, clear_build_lock

    missing = []
    for name in _jit_ops(ds_config):
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME):
            continue
        folder = build_directory(builder)
        clear_build_lock(folder)  # deepspeed.initialize's load takes it too, built or not
        if not (folder / f"{builder.name}.so").exists():
            missing.append(name)
    if missing:  # a failed build is left to deepspeed.initialize, which builds again and reports it
        print(f"pretrieve: building DeepSpeed ops {', '.join(missing)} (once, into "
              f"{os.environ.get('TORCH_EXTENSIONS_DIR') or 'torch extension cache'})", file=sys.stderr)
        subprocess.run([sys.executable, "-c", _BUILD, *missing], preexec_fn=_ignore_stop_signals)


def _retryable(error: BaseException) -> bool:
    """Failures of the rendezvous and the network at start-up; not bad configs, data or code."""
    import torch.distributed as dist

    kinds = (ConnectionError, TimeoutError, dist.DistNetworkError, dist.DistStoreError)
    return isinstance(error, kinds) or isinstance(error.__cause__, kinds)


@contextlib.contextmanager
def retryable_startup(what: str, deadline: float | None = None, on_failure=None):
    """Within: a failure that may pass raises StartupFailed; past `deadline` seconds the process exits
    RETRY_EXIT_CODE from a watchdog thread (the main one may be blocked in C, in gloo's or NCCL's set-up).
    `on_failure()` runs on every way out but success, the watchdog's exit included (which skips atexit and
    `finally`): what a failed start must not leave behind (DeepSpeed's shared-memory buffers)."""
    finished = threading.Event()

    def watch():
        if not finished.wait(deadline):
            print(f"pretrieve: {what} did not finish in {deadline:g} s (train.startup_timeout): a rank or node may "
                  f"have died while the job formed; exit {RETRY_EXIT_CODE}", file=sys.stderr, flush=True)
            try:
                if on_failure is not None:
                    on_failure()
            finally:
                os._exit(RETRY_EXIT_CODE)

    if deadline is not None:
        threading.Thread(target=watch, name="startup-deadline", daemon=True).start()
    try:
        yield
    except BaseException as error:
        if on_failure is not None:
            on_failure()
        if not isinstance(error, Exception) or not _retryable(error):
            raise
        taken = (f"MASTER_PORT {os.environ.get('MASTER_PORT')} is taken on {os.environ.get('MASTER_ADDR')} by "
                 "another process; ") if "EADDRINUSE" in str(error) else ""
        print(f"pretrieve: {what} failed, which may pass on a retry ({taken}{type(error).__name__}: {error}); "
              f"exit {RETRY_EXIT_CODE}", file=sys.stderr)
        raise StartupFailed() from error
    finally:
        finished.set()


class StopFlag:
    """A stop signal asks for a checkpoint at the next step boundary; a second SIGTERM / SIGUSR1 more than
    REPEAT_WINDOW_S later, or a second SIGINT, exits at once (the last complete checkpoint is untouched: `latest`
    moves only after a save). With several ranks the ranks agree at log and checkpoint steps only: agreeing is a
    collective and a host sync."""

    def __init__(self, max_runtime: float | None):
        self.deadline = None if max_runtime is None else time.monotonic() + max_runtime
        # a signal held since the process started (hold_stop_signals) counts: it is this run's
        self._previous = {sig: signal.signal(sig, _record) for sig in catchable(STOP_SIGNALS)}

    @property
    def requested(self) -> bool:
        return _signalled_at is not None

    def should_stop(self, world: int, device: torch.device | None = None) -> Stop:
        """All ranks agree: any rank's signal or deadline stops everyone at the same step, for the same reason."""
        stop = requested()
        if not stop and self.deadline is not None and time.monotonic() > self.deadline:
            stop = Stop.PREEMPTED
        if world > 1:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([int(stop)], device=device)  # NCCL reduces device tensors only
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = Stop(int(flag.item()))
        return stop

    def stopped(self, why: Stop, checkpoint: Path | None, step: int | None = None) -> Stopped:
        """The exit of this run, stopped by `why` (training_stopped); the request is spent: a later run in this
        process starts unasked."""
        global _signalled_at, _interrupted
        _signalled_at, _interrupted = None, False
        return training_stopped(why, checkpoint, step)

    def restore(self) -> None:
        """The handlers before this run. A request that came too late for the run to act on (during its export)
        stays held, for what the process does next (finetune-stages: its next step stops before it starts)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
