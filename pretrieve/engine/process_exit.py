"""How a rank's process ends once its command is done: out of its process group, and without Python's teardown.

Threads of torch's communication backends (gloo's work loops, NCCL's watchdog) live as long as their process
group, and DeepSpeed holds its own references to the groups, so they outlive `destroy_process_group`. A thread
inside torch's C++ that takes the GIL while Python finalizes (a collective's tensor freed on a gloo thread, a
daemon thread finishing a torch op) is ended by Python in the middle of C++, and the process aborts: SIGABRT,
"terminate called without an active exception", after a run that succeeded. So a rank does Python's exit by
hand up to the teardown and ends there: its non-daemon threads joined, its atexit handlers run (logging,
MLflow, multiprocessing's children, temporary files), its streams flushed.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import NoReturn


def leave_process_group() -> bool:
    """A rank whose command ended well (or stopped where every rank agreed to) leaves its process group, as
    torch.distributed asks; whether it was in one. Not after a failure: a rank still inside a collective would
    never let go (torchtitan does the same)."""
    dist = sys.modules.get("torch.distributed")  # no torch import for the commands that never loaded it
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True


def exit_before_teardown(code: int, by_sigint: bool = False) -> NoReturn:
    """End the process with `code` as Python's own exit would, short of finalizing the interpreter (see the
    module docstring); `by_sigint`: by SIGINT, as an interrupted Python program ends (preemption.py)."""
    threading._shutdown()  # what Python's exit does first: joins the non-daemon threads, ends executors
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader went away
            pass
    if by_sigint:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)
