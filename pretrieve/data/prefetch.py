"""Load the next shards of a reader in the background while it consumes the current one.

`prefetched(loads, ahead)` yields `load(cancel)` for each load in order; while the consumer uses one result,
the following `ahead` loads run in daemon threads, so network latency and hashing overlap parsing and
training (they start once the current load is in, so the first shard has the bandwidth to itself). Order and
content are those of the plain sequence: only the timing changes. A load's error is raised when its turn
comes (earlier shards are delivered first). Closing the generator cancels the loads still running (they stop
at their next request, and a daemon thread never holds up the process's exit) and drops their results.
Memory: at most `ahead` + 1 loaded shards per reader beside what the consumer still holds.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")


class _Load(threading.Thread):
    def __init__(self, load: Callable[[threading.Event], T]):
        super().__init__(name="pretrieve-prefetch", daemon=True)
        self.load, self.cancel = load, threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.load(self.cancel)
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            self.error = e

    def get(self) -> T:
        self.join()
        if self.error is not None:
            raise self.error
        return self.result


def prefetched(loads: Sequence[Callable[[threading.Event], T]], ahead: int) -> Iterator[T]:
    if ahead <= 0:
        for load in loads:
            yield load(threading.Event())
        return
    running: deque[_Load] = deque()
    started = 0

    def start_next() -> None:
        nonlocal started
        running.append(_Load(loads[started]))
        running[-1].start()
        started += 1

    try:
        for _ in range(len(loads)):
            if not running:
                start_next()
            current = running.popleft()
            result = current.get()
            current.result = None  # the consumer holds the only reference from here on
            # the next loads start once the current one is in: they overlap its use, not its own load
            while len(running) < ahead and started < len(loads):
                start_next()
            yield result
    finally:
        for load in running:
            load.cancel.set()
