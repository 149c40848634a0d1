"""The GPUs of this node, handed to child processes one job at a time: `pretrieve farm`'s jobs and fine-tuning
chains, and the device of a `pretrieve encode` worker.

A child is placed by CUDA_VISIBLE_DEVICES in its environment, so it sees its devices as cuda:0.. and nothing
else. Device ids count the devices this process sees: with CUDA_VISIBLE_DEVICES already set here (a SLURM
allocation, say) id i is its i-th entry, passed on as written (an index or a UUID); without it, id i is GPU i.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

VISIBLE = "CUDA_VISIBLE_DEVICES"


def device_count() -> int:
    """The CUDA devices torch sees here (0 on a CPU machine)."""
    import torch

    return torch.cuda.device_count()


def node_devices(spec, where: str) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entries of the devices `spec` names: a list of device ids, a count (the first
    that many), or None (every device torch sees; None on a CPU machine: the children's environment is left
    as it is). An empty list or 0 gives [] (the children see no device). `where` names the key in errors."""
    if spec is None:
        count = device_count()
        return _entries(list(range(count)), where) if count else None
    if isinstance(spec, bool) or not isinstance(spec, (int, list)):
        raise ValueError(f"{where}: give a list of device ids such as [0, 1] or a count, not {spec!r}")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"{where}: a device count must be >= 0, got {spec}")
        return _entries(list(range(spec)), where)
    for i, device in enumerate(spec):
        if isinstance(device, bool) or not isinstance(device, int) or device < 0:
            raise ValueError(f"{where}[{i}]: a device id is an integer >= 0, got {device!r}")
        if device in spec[:i]:
            raise ValueError(f"{where}[{i}]: device {device} listed twice")
    return _entries(spec, where)


def _entries(ids: list[int], where: str) -> list[str]:
    visible = os.environ.get(VISIBLE)
    if visible is None:
        return [str(i) for i in ids]
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    beyond = [i for i in ids if i >= len(entries)]
    if beyond:
        raise ValueError(f"{where}: device {beyond[0]} is not among the {len(entries)} this process sees "
                         f"({VISIBLE}={visible!r}; ids count those)")
    return [entries[i] for i in ids]


def visible_env(devices: list[str] | None, env: dict | None = None) -> dict | None:
    """`env` (None: this process's environment) with CUDA_VISIBLE_DEVICES set to `devices` (None: left as it is)."""
    if devices is None:
        return env
    return {**(os.environ if env is None else env), VISIBLE: ",".join(devices)}


def worker_device(worker: int) -> str | None:
    """The device of worker `worker` of a split job (`pretrieve encode --worker i`): cuda:(i mod the devices this
    process sees), so workers started side by side on one node spread over its GPUs; None on a CPU machine."""
    count = device_count()
    return f"cuda:{worker % count}" if count else None


class DevicePool:
    """Free devices, taken `n` at a time by the threads that start jobs and handed back when the job ends, however
    it ends; a thread that asks for more than are free waits (the pool never has fewer threads than devices'
    worth of jobs, so a wait ends when a running job does)."""

    def __init__(self, devices: list[str]):
        self.devices = list(devices)
        self._free = list(devices)
        self._changed = threading.Condition()

    @contextmanager
    def held(self, n: int) -> Iterator[list[str]]:
        """`n` free devices while the block runs; an empty pool (jobs placed on no device) gives [] at once."""
        if not self.devices:
            yield []
            return
        if n > len(self.devices):
            raise ValueError(f"a job needs {n} devices at once; {len(self.devices)} are given")
        with self._changed:
            self._changed.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
        try:
            yield taken
        finally:
            with self._changed:  # in the pool's order, so the first free devices are always the lowest ids
                self._free = [d for d in self.devices if d in self._free or d in taken]
                self._changed.notify_all()
