"""`pretrieve pretrain` subprocesses as the tests start them, and what they print."""
import json
import os
import subprocess
import sys
from pathlib import Path

from .paths import TESTS


def pretrain_env(**extra: str) -> dict:
    """Environment for a `pretrieve pretrain` subprocess: DeepSpeed on CPU, one thread per rank, and none of
    this process's rank variables (the child is its own world, or torchrun sets them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    return {**env, **extra}


def pretrain_stopped_and_resumed(config: Path | str, full: list[str], split: list[str], timeout: int = 900) -> None:
    """`pretrieve pretrain` of `config` with the overrides `full` and `split` (which stops early: train.stop_at)
    in one process (tests/train_many.py), then `split` resumed in a fresh process (resume=auto, its stop removed):
    what the exact-resume tests compare. Each run must exit 0."""
    done = subprocess.run([sys.executable, str(TESTS / "train_many.py"), str(config), json.dumps([full, split])],
                          env=pretrain_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    resume = [override for override in split if not override.startswith("train.stop_at=")]
    done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(config), *resume, "resume=auto"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def assert_resumed_run_repeats(runs: Path, parts: tuple[str, ...], steps: int = 4) -> None:
    """After pretrain_stopped_and_resumed wrote runs/full and runs/split: the resumed run logs the uninterrupted
    run's step, loss, lr and loss `parts` bit for bit at each of its `steps` steps, and exports the same weights,
    the head's (pretrieve_head.safetensors) included."""
    from safetensors.torch import load_file

    def records(name):
        return [{k: v for k, v in json.loads(line).items() if k in ("step", "loss", "lr", *parts)}
                for line in (runs / name / "metrics.jsonl").read_text().splitlines()]

    full, split = records("full"), records("split")
    assert [r["step"] for r in split] == list(range(1, steps + 1)) and split == full
    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        resumed, uninterrupted = (load_file(runs / run / "export" / name) for run in ("split", "full"))
        assert resumed.keys() == uninterrupted.keys()
        assert all(resumed[k].equal(uninterrupted[k]) for k in resumed)


def json_lines(stdout: str) -> list:
    """The JSON objects a subprocess printed, one per line, skipping every other line (DeepSpeed and the
    launchers print per rank: warnings)."""
    found = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # not a whole object: a line of another rank or library that happens to start with {
    return found


def result_line(stdout: str) -> dict:
    """The result of a `pretrieve pretrain|finetune` subprocess: its one JSON result line (rank 0 prints it)."""
    [result] = [r for r in json_lines(stdout) if "step" in r]
    return result


def free_port() -> str:
    """A free TCP port on loopback for a torchrun rendezvous (`--master_port 0` hangs with gloo here)."""
    from pretrieve.engine.world import free_loopback_port

    return str(free_loopback_port())
