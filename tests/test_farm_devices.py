"""One GPU per farm job (pretrieve/engine/devices.py, orchestrate/farm.py): the devices of `gpus:` handed to real
`pretrieve eval` processes through CUDA_VISIBLE_DEVICES, read back from each running job's environment
(/proc/PID/environ) while the farm runs; a failed job frees its device; bad `gpus:` values are refused naming
the key and the farm file. On this machine the device ids are names only: no job touches a GPU (BM25 jobs).
Real GPUs: tests/test_farm_gpu.py."""

import json
import subprocess
import sys
import threading
from typing import Any, Callable

import psutil
import pytest
from support import SAMPLES

from pretrieve.engine.devices import DevicePool, node_devices
from pretrieve.orchestrate.farm import load_farm, run_farm

pytestmark = pytest.mark.system

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def visible_devices(job: psutil.Process) -> str | None:
    return job.environ().get("CUDA_VISIBLE_DEVICES")


def watch_jobs(farm: subprocess.Popen, look: Callable[[psutil.Process], Any] = visible_devices) -> list[dict]:
    """Until the farm ends: at each look, {pid: look(job)} of its running `pretrieve eval` children (once they
    have exec'd: before that a child's environment is the farm's)."""
    looks = []
    while farm.poll() is None:
        running = {}
        for child in psutil.Process(farm.pid).children():
            try:
                if "eval" in child.cmdline():
                    seen = look(child)
                    if child.environ():  # else it was exiting, its memory gone: the look may have read nothing
                        running[child.pid] = seen
            except psutil.Error:  # ended between the listing and the look
                continue
        looks.append(running)
    return looks


def test_each_job_gets_a_device_of_its_own_and_hands_it_back(tmp_path, monkeypatch):
    """gpus: [0, 1] and workers: 1: two jobs at once (one per device, whatever `workers` says), never two on one
    device, both devices used; two jobs fail at once and their devices go on to the next jobs (held ones would
    leave the farm waiting forever: the timeout below)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({
        "out": str(tmp_path / "out"), "workers": 1, "gpus": [0, 1], "tracking": {"enabled": False},
        "eval": {"depth": 20}, "checkpoints": [{"name": f"bm25-{i}", "bm25": True} for i in range(2)],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}, {"name": "gone", "beir": str(tmp_path / "gone")}]}))
    proc = subprocess.Popen([sys.executable, "-m", "pretrieve", "farm", str(farm)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        looks = watch_jobs(proc)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, err[-3000:]  # 2 failed jobs
    result = json.loads(out.splitlines()[-1])
    assert result["ran"] == 2 and sorted(result["failed"]) == [f"bm25-{i}/gone/zero-shot" for i in range(2)]
    for running in looks:
        assert len(running) == len(set(running.values())), f"two jobs on one device: {running}"
    device_of = {pid: device for running in looks for pid, device in running.items()}
    assert len(device_of) == 4, looks  # every job seen running
    assert sorted(set(device_of.values())) == ["0", "1"]
    assert max(len(running) for running in looks) == 2  # as many at once as devices, not `workers`


def test_a_pool_hands_a_job_of_two_devices_both_once_they_are_free():
    """A fine-tuning chain of `nproc` 2 waits until a running single-device job ends, then gets both."""
    pool, order = DevicePool(["0", "1"]), []
    first_holds, first_may_end = threading.Event(), threading.Event()

    def single() -> None:
        with pool.held(1) as devices:
            order.append(("single", devices))
            first_holds.set()
            first_may_end.wait()
            order.append(("single ends", devices))

    def pair() -> None:
        with pool.held(2) as devices:
            order.append(("pair", devices))

    one = threading.Thread(target=single)
    one.start()
    first_holds.wait()
    two = threading.Thread(target=pair)
    two.start()
    first_may_end.set()
    one.join()
    two.join()
    assert order == [("single", ["0"]), ("single ends", ["0"]), ("pair", ["0", "1"])]
    with pytest.raises(ValueError, match="a job needs 3 devices at once; 2 are given"):
        with pool.held(3):
            pass


@pytest.mark.parametrize("gpus,message", [
    ("all", "gpus: give a list of device ids such as [0, 1] or a count, not 'all'"),
    (True, "gpus: give a list of device ids such as [0, 1] or a count, not True"),
    (-1, "gpus: a device count must be >= 0, got -1"),
    ([0, "1"], "gpus[1]: a device id is an integer >= 0, got '1'"),
    ([0, 1, 0], "gpus[2]: device 0 listed twice"),
])
def test_bad_gpus_values_name_the_key_and_the_farm_file(tmp_path, monkeypatch, gpus, message):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"gpus": gpus, "checkpoints": [{"name": "bm25", "bm25": True}],
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    with pytest.raises(ValueError) as error:
        load_farm(farm)
    assert str(error.value) == f"{farm}: {message}"


@pytest.mark.parametrize("checkpoint,dataset,message", [
    ({"name": "bm25", "bm52": True}, {"name": "scifact", "beir": str(SCIFACT)},
     "checkpoints[0].bm52: unknown (known: name, model, bm25, pooling, normalize, run_dir, dims)"),
    ({"name": "bm25", "bm25": True}, {"name": "scifact", "bier": str(SCIFACT)},
     "datasets[0].bier: unknown (known: name, beir, msmarco, mteb, split)"),
])
def test_a_typo_in_a_farm_entry_is_named(tmp_path, checkpoint, dataset, message):
    """Not "no 'model'" for a misspelt bm25: the unknown key itself."""
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"checkpoints": [checkpoint], "datasets": [dataset]}))
    with pytest.raises(ValueError) as error:
        load_farm(farm)
    assert str(error.value) == f"{farm}: {message}"


def test_device_ids_count_the_devices_this_process_sees(tmp_path, monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=2,3 (a SLURM allocation, say) id 1 is GPU 3 and id 2 does not exist; a chain
    of more ranks than devices is refused before anything runs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert node_devices([1], "gpus") == ["3"] and node_devices(2, "gpus") == ["2", "3"]
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"gpus": [0, 2], "checkpoints": [{"name": "bm25", "bm25": True}],
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    with pytest.raises(ValueError, match=r"gpus: device 2 is not among the 2 this process sees "
                                         r"\(CUDA_VISIBLE_DEVICES='2,3'; ids count those\)"):
        load_farm(farm)

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    farm.write_text(json.dumps({
        "out": str(tmp_path / "out"), "gpus": 1, "stages": ["zero-shot", "stage1"],
        "finetune": {"config": "configs/finetune/stage1.yaml", "beir": str(SCIFACT), "nproc": 2},
        "checkpoints": [{"name": "a", "model": str(tmp_path / "model")}],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    with pytest.raises(ValueError, match=rf"^{farm}: finetune.nproc: a fine-tuning chain of 2 ranks needs 2 "
                                         r"devices at once; gpus gives 1 \(0\)$"):
        run_farm(farm, progress=False)
    assert not (tmp_path / "out").exists()  # refused before any job started
