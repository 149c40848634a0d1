"""What the cluster and fault tests share: the tiny run of tests/test_launchers.py (6 steps), its uninterrupted
references, made once per pytest run, and the comparison every fault ends with: the same logged steps and
losses, and the same exported weights, bit for bit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from support import free_port
from pretrieve.utils.run_dir import TAG_CONFIG
from test_launchers import BIN, CONFIG, PRETRAIN_SH, _env, _losses, _overrides, _weights

INJECT = Path(__file__).resolve().parent / "inject_fault.py"
TAG = "step{:08d}".format  # the checkpoint tag of a step
_references: dict[str, Path] = {}


def overrides(manifest: Path, *extra: str) -> list[str]:
    """test_launchers' tiny run, tracking off, checkpoints every 2 steps: tags 2, 4, 6 (keep 2 prunes at 6)."""
    return _overrides(manifest, "checkpoint.every=2", "tracking.enabled=false", *extra)


def one_rank(run_dir: Path, manifest: Path, *extra: str) -> list[str]:
    """`python -m pretrieve pretrain ...`: one process, no launcher."""
    return [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIG), f"run_dir={run_dir}",
            *overrides(manifest, *extra)]


def with_fault(command: list[str]) -> list[str]:
    """A `python -m pretrieve` command run by tests/inject_fault.py instead (the fault from FAULT_* variables)."""
    return [command[0], str(INJECT), *command[1:]]


def two_ranks(run_dir: Path, manifest: Path, *extra: str) -> list[str]:
    """`deepspeed --num_accelerators 2 --no_python launchers/pretrain.sh`: two CPU ranks on this node."""
    return [str(BIN / "deepspeed"), "--num_accelerators", "2", "--master_port", free_port(), "--no_python",
            str(PRETRAIN_SH), str(CONFIG), f"run_dir={run_dir}", *overrides(manifest, *extra)]


def reference(kind: str, tmp_path_factory, manifest: Path) -> Path:
    """The uninterrupted run ("one_rank" or "two_ranks"), made once for both test modules."""
    if kind not in _references:
        run_dir = tmp_path_factory.mktemp(f"reference-{kind}") / "run"
        command = {"one_rank": one_rank, "two_ranks": two_ranks}[kind](run_dir, manifest)
        done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        _references[kind] = run_dir
    return _references[kind]


def tags(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step*") if p.is_dir())


def complete(run_dir: Path, tag: str) -> bool:
    """A tag is complete once its config.yaml is written: the engine writes it last."""
    return (run_dir / "checkpoints" / tag / TAG_CONFIG).is_file()


def assert_same_run(run_dir: Path, reference_dir: Path) -> None:
    """Every step logged once with the reference's loss, and the reference's final weights, bit for bit."""
    assert _losses(run_dir) == _losses(reference_dir)
    ours, theirs = _weights(run_dir), _weights(reference_dir)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
