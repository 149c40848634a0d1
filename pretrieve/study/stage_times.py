"""The cost of a method study's stages: each stage's wall and CPU seconds, added up in WORK/stage_times.json over
invocations, so that a resumed study still has its whole cost."""

from __future__ import annotations

import json
import resource
import time
from contextlib import contextmanager
from pathlib import Path

from pretrieve.study.data import log, write_atomic


@contextmanager
def timed(work: Path, stage: str):
    """Add this stage's wall seconds and CPU seconds (this process and its finished children) to
    WORK/stage_times.json, however the stage ends."""
    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    start, start_cpu = time.time(), cpu()
    try:
        yield
    finally:
        add_time(work, stage, time.time() - start, cpu() - start_cpu)


def add_time(work: Path, stage: str, wall: float, cpu: float) -> None:
    path = work / "stage_times.json"
    times = json.loads(path.read_text()) if path.is_file() else {}
    entry = times.setdefault(stage, {"wall_s": 0.0, "cpu_s": 0.0})
    entry["wall_s"] = round(entry["wall_s"] + wall, 1)
    entry["cpu_s"] = round(entry["cpu_s"] + cpu, 1)
    write_atomic(path, json.dumps(times, indent=1))
    log(f"{stage}: {entry['wall_s']:.0f} s wall, {entry['cpu_s']:.0f} CPU s (all invocations)")


def stage_times(work: Path) -> dict:
    """What WORK/stage_times.json holds so far."""
    return json.loads((work / "stage_times.json").read_text())
