"""The farm on real GPUs (skipped without CUDA; `make test-gpu` machines): two `pretrieve eval` jobs of a
tiny encoder, `gpus: N`. Read from each running job: the CUDA_VISIBLE_DEVICES it was given and the GPU device
nodes (/dev/nvidiaK) it opened, which the driver opens for the visible devices alone. With two GPUs the jobs
run at once, each on a GPU of its own; with one, one after the other on it."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from support import SAMPLES
from test_farm_devices import watch_jobs

from pretrieve.engine.devices import node_devices

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def placement(job) -> tuple[str | None, frozenset[str]]:
    """(CUDA_VISIBLE_DEVICES, the /dev/nvidiaK it has open) of a running job."""
    nodes = set()
    for fd in os.listdir(f"/proc/{job.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{job.pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if re.fullmatch(r"/dev/nvidia\d+", target):
            nodes.add(target)
    return job.environ().get("CUDA_VISIBLE_DEVICES"), frozenset(nodes)


@pytest.mark.parametrize("gpus", [1, 2])
def test_each_farm_job_runs_on_its_own_gpu(tmp_path, tiny_encoder, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, {torch.cuda.device_count()} seen")
    second = tmp_path / "second"
    shutil.copytree(tiny_encoder, second)
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({
        "out": str(tmp_path / "out"), "gpus": gpus, "tracking": {"enabled": False}, "eval": {"depth": 20},
        "checkpoints": [{"name": "a", "model": str(tiny_encoder), "pooling": "mean"},
                        {"name": "b", "model": str(second), "pooling": "mean"}],
        "datasets": [{"name": "scifact", "beir": str(SAMPLES / "beir" / "scifact-sample")}]}))
    proc = subprocess.Popen([sys.executable, "-m", "pretrieve", "farm", str(farm)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        looks = watch_jobs(proc, placement)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, err[-3000:]

    given = {pid: visible for running in looks for pid, (visible, _) in running.items()}
    opened = {pid: set() for pid in given}
    for running in looks:
        for pid, (_, nodes) in running.items():
            opened[pid] |= nodes
    assert len(given) == 2 and sorted(given.values()) == sorted(node_devices(gpus, "gpus") * (2 // gpus))
    assert all(len(nodes) == 1 for nodes in opened.values()), opened  # one GPU each, the one it was given
    for running in looks:
        assert len({visible for visible, _ in running.values()}) == len(running), running
    assert max(len(running) for running in looks) == gpus
    assert len(set().union(*opened.values())) == gpus  # two GPUs: two device nodes, one per job
