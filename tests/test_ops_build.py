"""DeepSpeed's JIT-built ops (pretrieve/engine/ops.py): a build lock that a killed build left is removed, one a
live build holds is waited for within a bound and then named; `make install`'s build gets past a planted stale
lock; each environment builds into its own extension cache."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrieve.engine.ops import clear_build_lock, environment_cache, environment_ops


def _holder(lock: Path) -> subprocess.Popen:
    """A process holding `lock` open, as torch's FileBaton does while it builds."""
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time\nfd = os.open({str(lock)!r}, os.O_RDONLY)\n"
                               "print('held', flush=True)\ntime.sleep(600)\n"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_lock_no_process_holds_is_removed(tmp_path, capsys):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()  # left by a build killed midway
    clear_build_lock(lock.parent, wait=60)
    assert not lock.exists()
    assert f"removed {lock}" in capsys.readouterr().err
    clear_build_lock(lock.parent, wait=0)  # no lock: nothing to wait for


def test_a_held_lock_is_waited_for_within_a_bound_then_named(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    holder = _holder(lock)
    try:
        with pytest.raises(TimeoutError, match=f"{lock}: a DeepSpeed op build has held this lock for over 2 s "
                                               f"\\(held by process {holder.pid}\\)"):
            clear_build_lock(lock.parent, wait=2)
        assert lock.exists()  # a live build's lock stays
    finally:
        holder.kill()
        holder.wait()
    clear_build_lock(lock.parent, wait=60)  # its holder gone, the lock is stale
    assert not lock.exists()


def test_make_installs_op_build_gets_past_a_stale_lock(tmp_path):
    """`make install` builds DeepSpeed's CPU op with `python -m pretrieve.engine.ops`; a lock planted where a
    killed build would have left it once made it wait forever."""
    cache = tmp_path / "torch_extensions"
    built = Path(environment_cache() or "/nonexistent") / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").is_file():  # `make install` built it: ninja finds nothing to do
        shutil.copytree(built, cache / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    (cache / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    (cache / "deepspeed_shm_comm" / "lock").touch()
    done = subprocess.run([sys.executable, "-m", "pretrieve.engine.ops"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "removed" in done.stderr and "no process holds" in done.stderr
    assert (cache / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    assert not (cache / "deepspeed_shm_comm" / "lock").exists()


def test_each_environment_builds_into_its_own_extension_cache(monkeypatch, tmp_path):
    """Two venvs (or clones with their own) no longer share torch's per-user cache, where each start-up rebuilt
    the op the other had built; TORCH_EXTENSIONS_DIR, when set, still wins."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    (tmp_path / "venv").mkdir()
    assert environment_cache() == str(tmp_path / "venv" / "torch_extensions")
    with environment_ops():
        assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "torch_extensions")
        assert os.environ["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)  # its ninja
    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert environment_cache() == str(tmp_path / "mine")


def test_a_venv_reached_through_a_link_builds_apart_from_its_real_path(monkeypatch, tmp_path):
    """A build's include paths name the prefix as Python was started from it: builds of the real and the linked
    path of one venv, sharing one cache, took each other's for stale and rebuilt at every start-up."""
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    (tmp_path / "venv").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "venv")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    real = environment_cache()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "link"))
    linked = environment_cache()
    assert real == str(tmp_path / "venv" / "torch_extensions")
    assert Path(linked).parent.resolve() == Path(real) and Path(linked).name.startswith("via-")
    (tmp_path / "other").symlink_to(tmp_path / "venv")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other"))
    assert environment_cache() not in (real, linked)
