"""Signals sent to a command under test, and whether it caught them."""
import os
import signal
import subprocess
import time
from pathlib import Path


def signal_in_mask(pid: int, sig: int, *masks: str) -> bool:
    """Whether `sig` is in any of the named masks of /proc/PID/status (SigCgt: caught; ShdPnd, SigPnd: pending)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return any(int(line.split()[1], 16) >> (sig - 1) & 1 for line in lines if line.split(":")[0] in masks)


def ctrl_c_when(proc: subprocess.Popen, ready, timeout: float = 300) -> str:
    """Ctrl-C as a terminal sends it, SIGINT to the process group of `proc` (started in a session of its own),
    once `ready()`; then the end, which must be by SIGINT and without a traceback. Returns the one line of
    stderr that says the command was interrupted."""
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline and not ready():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    said = [line for line in err.splitlines() if "interrupt" in line.lower()]
    assert len(said) == 1 and "Traceback" not in err, err[-3000:]
    return said[0]
