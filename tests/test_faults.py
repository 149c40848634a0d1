"""Fault injection: the run of tests/test_launchers.py (6 steps, checkpoints at 2, 4, 6, keep 2) killed -9 at
chosen points, saving included; one of two ranks killed mid-save; a full disk; the MLflow tracking server
stopped. Each fault acts at an exact point (tests/inject_fault.py), never after a timer, and each ends the way
the engine documents: `latest` names a complete checkpoint, and resume=auto finishes with the losses and weights
of the uninterrupted run, bit for bit; a tracking failure is one warning, never a failed run."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from support import stop_server
from fault_runs import TAG, assert_same_run, complete, one_rank, reference, tags, two_ranks, with_fault
from inject_fault import python_with_fault, release
from pretrieve.utils.run_dir import latest_checkpoint
from test_launchers import _env, _losses

pytestmark = pytest.mark.cluster


def _run(command: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=_env(**env), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("at,step,latest,left", [
    ("step", 3, 2, [2]),  # between checkpoints: step 3 is logged, and logged again after the resume
    ("save", 4, 2, [2, 4]),  # mid-save: step 4's optimizer states half on disk, its config.yaml never written
    ("tag", 4, 2, [2, 4]),  # step 4 complete, `latest` not yet moved: the resume starts from step 2 all the same
    ("prune", 6, 6, [2, 4, 6]),  # the last save done, step 2 not yet pruned, nothing exported
], ids=["between-steps", "mid-save", "before-latest", "before-prune"])
def test_kill_9_leaves_latest_complete_and_resume_is_exact(tmp_path, tmp_path_factory, wiki_shards, at, step, latest,
                                                           left):
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("one_rank", tmp_path_factory, manifest)
    run = tmp_path / "run"
    killed = _run(with_fault(one_rank(run, manifest)), FAULT_AT=at, FAULT_STEP=str(step))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert latest_checkpoint(run) == TAG(latest) and complete(run, TAG(latest))
    assert tags(run) == [TAG(s) for s in left]
    if at == "save":
        half = run / "checkpoints" / TAG(4)
        assert not complete(run, TAG(4)) and any(f.name.endswith("optim_states.pt") for f in half.iterdir())
    assert [s for s, _ in _losses(run)] == list(range(1, step + 1)) and not (run / "export").exists()

    resumed = _run(one_rank(run, manifest, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, uninterrupted)
    assert tags(run) == [TAG(4), TAG(6)] and complete(run, TAG(4)) and complete(run, TAG(6))


def test_a_rank_killed_mid_save_ends_the_other_and_resume_is_exact(tmp_path, tmp_path_factory, wiki_shards):
    """Two ranks under the deepspeed launcher; rank 1 is killed -9 while writing its part of step 4. The launcher
    ends rank 0 (SIGTERM, SIGKILL 30 s later; rank 0's collective with the dead rank fails first) and exits
    non-zero: a bounded end, not a hang. `latest` stays on step 2; resume=auto on both ranks is exact."""
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("two_ranks", tmp_path_factory, manifest)
    run, mark = tmp_path / "run", tmp_path / "killed"
    fault = {"PRETRIEVE_PYTHON": str(python_with_fault(tmp_path)), "FAULT_AT": "save", "FAULT_STEP": "4",
             "FAULT_RANK": "1", "FAULT_MARK": str(mark)}
    job = _run(two_ranks(run, manifest), **fault)
    ended = time.time()
    assert job.returncode != 0 and mark.is_file(), job.stderr[-3000:]
    took = ended - mark.stat().st_mtime
    print(f"rank 1 killed: the launcher and rank 0 ended {took:.1f} s later")
    assert took < 60, f"the job took {took:.0f} s to end after rank 1 was killed"
    assert "another rank failed or died during the save" in job.stdout + job.stderr, job.stderr[-3000:]
    assert latest_checkpoint(run) == TAG(2) and complete(run, TAG(2))

    resumed = _run(two_ranks(run, manifest, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, uninterrupted)
    assert len(list((run / "checkpoints" / TAG(6)).glob("*zero_pp_rank_*_optim_states.pt"))) == 2


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs of 160 MiB at tmp_path/disk: room for four checkpoints of the tiny run."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs failed: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_fails_one_save_and_after_freeing_space_resume_is_exact(tmpfs, tmp_path_factory, wiki_shards):
    """Other data leaves room for one and a half checkpoints: step 2 is saved, step 4 fails naming its tag and
    `latest` (step 2); once that data is deleted, resume=auto finishes as if nothing happened.
    (tests/test_run_safety.py: a disk too small for the first checkpoint.)"""
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("one_rank", tmp_path_factory, manifest)
    checkpoint = sum(f.stat().st_size for f in (uninterrupted / "checkpoints" / TAG(6)).iterdir())
    filler = tmpfs / "other-data"
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(tmpfs).free - int(1.5 * checkpoint))
    run = tmpfs / "run"
    full = _run(one_rank(run, manifest))
    assert full.returncode == 1
    assert f"{run / 'checkpoints' / TAG(4)}: saving the checkpoint failed: no space left on device" in full.stderr, \
        full.stderr[-3000:]
    assert f"`latest` still names {TAG(2)}: free space" in full.stderr
    assert latest_checkpoint(run) == TAG(2) and complete(run, TAG(2)) and tags(run) == [TAG(2)]

    filler.unlink()
    resumed = _run(one_rank(run, manifest, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run, uninterrupted)


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_tracking_server_stopped_mid_run_is_one_warning(tmp_path, tmp_path_factory, wiki_shards, mlflow_server, how):
    """The server goes away after step 2 is logged to it: killed (connections refused) or frozen by SIGSTOP
    (connections hang: the request timeout ends them). Training goes on and finishes as the uninterrupted run
    does, the failure is one warning, and metrics.jsonl holds every step."""
    from mlflow import MlflowClient

    url, server, store = mlflow_server
    manifest = wiki_shards / "manifest.json"
    uninterrupted = reference("one_rank", tmp_path_factory, manifest)
    run, mark, err = tmp_path / "run", tmp_path / "paused", tmp_path / "err.log"
    with open(err, "w") as stderr:
        job = subprocess.Popen(with_fault(one_rank(run, manifest, "tracking.enabled=true", f"tracking.uri={url}")),
                               env=_env(FAULT_AT="step", FAULT_STEP="2", FAULT_DO="pause", FAULT_MARK=str(mark)),
                               stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.time() + 600
        while not mark.exists():
            assert job.poll() is None and time.time() < deadline, err.read_text()[-3000:]
            time.sleep(0.05)
        run_id = json.loads((run / "run.json").read_text())["run_id"]
        assert [m.step for m in MlflowClient(url).get_metric_history(run_id, "loss")] == [1, 2]
        if how == "killed":
            stop_server(server)
        else:
            os.killpg(server.pid, signal.SIGSTOP)
        stopped = time.time()
        release(mark)
        job.wait(timeout=600)
        took = time.time() - stopped
    finally:
        job.kill()
        job.wait()
    print(f"tracking server {how}: the run finished {took:.1f} s later")
    errors = err.read_text()
    assert job.returncode == 0, errors[-3000:]
    assert errors.count("pretrieve: MLflow tracking disabled (") == 1, errors[-3000:]
    assert url in errors  # the warning names the server
    assert "training continues and metrics.jsonl keeps every logged step" in errors
    assert took < 120, f"the run took {took:.0f} s to finish after the tracking server stopped"
    assert latest_checkpoint(run) == TAG(6) and complete(run, TAG(6))
    assert_same_run(run, uninterrupted)  # every step in metrics.jsonl, as if tracking had never failed

    stop_server(server)
    stored = MlflowClient(f"sqlite:///{store}")  # what the server kept: the steps logged before it stopped
    assert [m.step for m in stored.get_metric_history(run_id, "loss")] == [1, 2]
