"""Preemption of a training process: SIGTERM or SIGUSR1 (SLURM's pre-timeout signal, and its PreemptMode=REQUEUE)
asks for a checkpoint at the next step boundary and exit PREEMPTED_EXIT_CODE, which the SLURM launcher requeues.

Such a signal may come at any moment, start-up included (imports, data, DeepSpeed's JIT build of its ops,
the rendezvous, the checkpoint load), and SLURM sends it to every process of the job step. So:
- `hold_stop_signals()`, at process start, records a signal instead of dying of it; StopFlag takes it over;
- `prebuild_ops()` JIT-builds the DeepSpeed ops that deepspeed.initialize would build, when missing, in a child
  process that ignores the signals: so do the shells and compilers it runs (an ignored signal stays ignored
  across exec; a blocked one does not survive /bin/sh, which clears the mask);
- `shield_children()` around deepspeed.initialize: what it still runs (ninja finding nothing to do) inherits
  the signals blocked, and the training process takes them when the block ends;
- `retryable_startup()` turns a start-up failure that may pass on its own (the network, the rendezvous, a peer
  that died while the process group formed and left this rank waiting past its deadline) into exit
  RETRY_EXIT_CODE, which the launcher requeues a bounded number of times.
"""

from __future__ import annotations  # no torch at import: a training process installs the handlers first thing

import contextlib
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 85  # the SLURM launcher requeues on this code
RETRY_EXIT_CODE = 86  # start-up failed for a reason that may pass: the launcher requeues, a bounded number of times

# A repeat this soon after the first signal is the same request delivered twice (under PreemptMode=REQUEUE a task
# gets SIGTERM from slurmstepd and again from srun, which forwards its own); a later one is someone insisting.
REPEAT_WINDOW_S = 10.0

_signalled_at: float | None = None  # when this run's first stop signal came (time.monotonic())


class Preempted(SystemExit):
    """Raised once the run's newest checkpoint is its position (saved now, or nothing trained since the last
    one); exits the process with PREEMPTED_EXIT_CODE."""

    def __init__(self, during_start_up: bool = False):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.during_start_up = during_start_up


class StartupFailed(SystemExit):
    """Start-up failed for a reason that may pass (nothing was trained): exits with RETRY_EXIT_CODE."""

    def __init__(self):
        super().__init__(RETRY_EXIT_CODE)


def _record(signum, frame) -> None:
    """The one handler, from process start (hold_stop_signals) through the run (StopFlag)."""
    global _signalled_at
    if _signalled_at is None:
        _signalled_at = time.monotonic()
    elif time.monotonic() - _signalled_at > REPEAT_WINDOW_S:  # insisting: exit now (`latest` stays complete)
        os._exit(128 + signum)


def hold_stop_signals() -> None:
    """Record stop signals from now on (call first thing in a training process)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


@contextlib.contextmanager
def shield_children():
    """Programs started inside (DeepSpeed's compilers) inherit SIGTERM / SIGUSR1 blocked; this process gets any
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
    if offload.get("device") == "cpu":
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
    """Build the ops deepspeed.initialize needs and torch's extension cache lacks, out of the signals' way."""
    import subprocess

    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    missing = []
    for name in _jit_ops(ds_config):
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME):
            continue
        built = os.path.join(_get_build_directory(builder.name, verbose=False), f"{builder.name}.so")
        if not os.path.exists(built):
            missing.append(name)
    if missing:  # a failed build is left to deepspeed.initialize, which builds again and reports it
        print(f"pretrieve: building DeepSpeed ops {', '.join(missing)} (once, into torch's extension cache)",
              file=sys.stderr)
        subprocess.run([sys.executable, "-c", _BUILD, *missing], preexec_fn=_ignore_stop_signals)


def _retryable(error: BaseException) -> bool:
    """Failures of the rendezvous and the network at start-up; not bad configs, data or code."""
    import torch.distributed as dist

    kinds = (ConnectionError, TimeoutError, dist.DistNetworkError, dist.DistStoreError)
    return isinstance(error, kinds) or isinstance(error.__cause__, kinds)


@contextlib.contextmanager
def retryable_startup(what: str, deadline: float | None = None):
    """Within: a failure that may pass raises StartupFailed; past `deadline` seconds the process exits
    RETRY_EXIT_CODE from a watchdog thread (the main one may be blocked in C, in gloo's or NCCL's set-up)."""
    finished = threading.Event()

    def watch():
        if not finished.wait(deadline):
            print(f"pretrieve: {what} did not finish in {deadline:g} s (train.startup_timeout): a rank or node may "
                  f"have died while the job formed; exit {RETRY_EXIT_CODE}", file=sys.stderr, flush=True)
            os._exit(RETRY_EXIT_CODE)

    if deadline is not None:
        threading.Thread(target=watch, name="startup-deadline", daemon=True).start()
    try:
        yield
    except Exception as error:
        if not _retryable(error):
            raise
        print(f"pretrieve: {what} failed, which may pass on a retry ({type(error).__name__}: {error}); "
              f"exit {RETRY_EXIT_CODE}", file=sys.stderr)
        raise StartupFailed() from error
    finally:
        finished.set()


class StopFlag:
    """A stop signal asks for a checkpoint at the next step boundary; a second one more than REPEAT_WINDOW_S later
    exits at once (the last complete checkpoint is untouched: `latest` moves only after a save). With several
    ranks the ranks agree at log and checkpoint steps only: agreeing is a collective and a host sync."""

    def __init__(self, max_runtime: float | None):
        self.deadline = None if max_runtime is None else time.monotonic() + max_runtime
        # a signal held since the process started (hold_stop_signals) counts: it is this run's
        self._previous = {sig: signal.signal(sig, _record) for sig in STOP_SIGNALS}

    @property
    def requested(self) -> bool:
        return _signalled_at is not None

    def should_stop(self, world: int, device: torch.device | None = None) -> bool:
        """All ranks agree: any rank's signal or deadline stops everyone at the same step."""
        stop = self.requested or (self.deadline is not None and time.monotonic() > self.deadline)
        if world > 1:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([int(stop)], device=device)  # NCCL reduces device tensors only
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def restore(self) -> None:
        """The handlers before this run; a later run in this process starts unasked."""
        global _signalled_at
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _signalled_at = None
