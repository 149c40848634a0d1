"""The world a launch will form, resolved without starting it: `pretrieve launch-info CONFIG`.

Where the ranks come from, first match wins: a DeepSpeed hostfile (`host slots=N` lines, as
launchers/make_hostfile.sh writes); a launcher's environment (WORLD_SIZE, as deepspeed / torchrun / the
launchers set it for each rank); a SLURM allocation (SLURM_JOB_NODELIST expanded by `scontrol show hostnames`,
SLURM_NTASKS ranks); otherwise this machine alone, one rank per GPU, or one CPU rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class World:
    hosts: list[tuple[str, int]]  # (host, ranks on it)
    source: str  # where it came from: hostfile PATH | launcher environment | SLURM job N | this machine

    @property
    def size(self) -> int:
        return sum(slots for _, slots in self.hosts)


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1, for a single-node rendezvous (`--master_port 0` hangs with gloo)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """DeepSpeed hostfile lines `host slots=N` (# comments, blank lines); errors name the line."""
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        words = line.split()
        slots = [w for w in words[1:] if w.startswith("slots=")]
        if len(words) != 2 or len(slots) != 1 or not slots[0][6:].isdigit() or int(slots[0][6:]) < 1:
            raise ValueError(f"{path}:{number}: expected 'HOST slots=N' with N >= 1, got {line!r}")
        if any(host == words[0] for host, _ in hosts):
            raise ValueError(f"{path}:{number}: host {words[0]} listed twice")
        hosts.append((words[0], int(slots[0][6:])))
    if not hosts:
        raise ValueError(f"{path}: no hosts")
    return hosts


def slurm_hostnames(nodelist: str) -> list[str]:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} failed ({e}); is this a SLURM node?") from e
    return out.stdout.split()


def local_devices() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), torch.cuda.get_device_name()
    return 1, "cpu"


def resolve_world(hostfile: str | None = None, env: dict | None = None) -> World:
    env = os.environ if env is None else env
    if hostfile:
        return World(read_hostfile(hostfile), f"hostfile {hostfile}")
    if env.get("WORLD_SIZE"):
        return World([(env.get("MASTER_ADDR", "localhost"), int(env["WORLD_SIZE"]))], "launcher environment")
    if env.get("SLURM_JOB_NODELIST"):
        hosts = slurm_hostnames(env["SLURM_JOB_NODELIST"])
        ranks = int(env.get("SLURM_NTASKS", len(hosts)))
        per_host = [ranks // len(hosts) + (i < ranks % len(hosts)) for i in range(len(hosts))]
        return World(list(zip(hosts, per_host)), f"SLURM job {env.get('SLURM_JOB_ID', '?')}")
    return World([("localhost", local_devices()[0])], "this machine")


def _cpu_allreduce_buffer(rank: int) -> Path:
    return Path("/dev/shm", f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                            f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def unlink_cpu_allreduce_buffer() -> None:
    """Let go of the name of DeepSpeed's CPU all-reduce buffer, once every rank has mapped every buffer.

    With every rank on one machine (LOCAL_SIZE, as the launchers set it, equal to the world size: one rank
    included), DeepSpeed's CPU accelerator maps one POSIX shared-memory buffer per rank,
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> (about 64 MiB), and never
    unlinks it: each such CPU run left its buffers in memory for good (a day of test runs held 12 GB of a 24 GB
    machine), and a later run on the same port would map a stale one. After a barrier (every rank is past
    DeepSpeed's start, so has opened every buffer) each rank unlinks its own name; the mappings live on until
    the processes exit, however they end. Called on every rank alike: the barrier is collective."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    _cpu_allreduce_buffer(dist.get_rank()).unlink(missing_ok=True)


def forget_cpu_allreduce_buffer() -> None:
    """A start that failed (an error, or the start-up deadline's exit) unlinks this rank's buffer at once, with no
    collective: peers still waiting to open it fail their own start (one failed rank fails the job). Only once
    this process's group has formed: before that the name (its port) may be another job's."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        _cpu_allreduce_buffer(dist.get_rank()).unlink(missing_ok=True)
