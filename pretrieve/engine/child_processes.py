"""Child processes that stop with the process that started them: the ranks of `finetune-stages --nproc N`, the
jobs of `pretrieve farm`, the points of `pretrieve scale run`.

Each child starts in a session of its own and gets the stop signals (SIGINT, SIGTERM, SIGUSR1) from here, each
once: a terminal sends its Ctrl-C to every process of its foreground process group, so a child in this
process's group would get it twice, from the terminal and passed on from here, and a training process takes a
second SIGINT for a person insisting and ends at once (engine/preemption.py). torchrun starts its workers so
too. Once a stop signal has come no child starts. Signals are passed on by a thread: a handler runs between
two bytecodes of the main thread, which may be starting a child at that moment, holding the lock.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

from pretrieve.engine.preemption import STOP_SIGNALS, Stop, catchable, requested

STOPPED = "stopped"  # what a child job was when a stop signal cut it off or kept it from starting: not done


class ChildProcesses:
    """`with ChildProcesses() as children:` start children with `start` / `run`; `stopped` says whether (and
    why) a stop signal came, to this process or held since it started (preemption.hold_stop_signals)."""

    def __init__(self):
        self._held = requested()
        self._received: list[int] = []  # the stop signals, in order (appended by the handler)
        self._sent: dict[subprocess.Popen, int] = {}  # running child -> how many of them it was sent
        self._lock = threading.Lock()  # the children; taken by the forwarder and starting threads, not the handler
        self._wake = threading.Event()
        self._closing = False
        self._previous: dict = {}
        self._forwarder = threading.Thread(target=self._forward, name="stop-signal-forwarder", daemon=True)

    def __enter__(self) -> ChildProcesses:
        if threading.current_thread() is threading.main_thread():  # where Python allows signal handlers
            self._previous = {sig: signal.signal(sig, self._receive) for sig in catchable(STOP_SIGNALS)}
        self._forwarder.start()
        return self

    def __exit__(self, *error) -> None:
        for sig, handler in self._previous.items():  # first: the handler must not run inside _wake.set() below
            signal.signal(sig, handler)
        self._closing = True
        self._wake.set()
        self._forwarder.join()

    @property
    def stopped(self) -> Stop:
        if signal.SIGINT in self._received or self._held == Stop.INTERRUPTED:
            return Stop.INTERRUPTED
        return Stop.PREEMPTED if self._received or self._held else Stop.NONE

    def start(self, *children: dict) -> list[subprocess.Popen] | None:
        """Start one child per dict of Popen arguments, all or (a stop signal came) none."""
        with self._lock:
            if self.stopped:
                return None
            # in their own sessions where this process passes the signals on (main thread), else in its group
            started = [subprocess.Popen(**child, start_new_session=bool(self._previous)) for child in children]
            self._sent.update((child, 0) for child in started)
        return started

    def run(self, **popen) -> int | None:
        """Run one child to its end: its exit status, or None when a stop signal came first (not started)."""
        started = self.start(popen)
        if started is None:
            return None
        [child] = started
        try:
            return child.wait()
        finally:
            self.forget(child)

    def run_job(self, args: list[str], log: Path, append: bool = False, env: dict | None = None) -> int | str:
        """Run `args` to its end, its output to `log`, in environment `env` (None: this process's): its exit status,
        or STOPPED where a stop signal kept it from starting or cut it off (one that failed as the signal came
        counts as cut off)."""
        if self.stopped:
            return STOPPED
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a" if append else "w") as stream:
            code = self.run(args=args, stdout=stream, stderr=subprocess.STDOUT, env=env)
        return STOPPED if code is None or (self.stopped and code != 0) else code

    def forget(self, child: subprocess.Popen) -> None:
        """A child that has ended: nothing more is sent to it (its pid may be reused)."""
        with self._lock:
            self._sent.pop(child, None)

    def _receive(self, signum, frame) -> None:
        self._received.append(signum)
        self._wake.set()

    def _forward(self) -> None:
        while not self._closing:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                for child, sent in self._sent.items():
                    pending = self._received[sent:]
                    for sig in pending:
                        child.send_signal(sig)  # nothing once it has ended and been waited for
                    self._sent[child] = sent + len(pending)
