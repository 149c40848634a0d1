"""The run directory's small files: atomic writes, settings records shared by parallel workers, and the `latest`
pointer to the newest complete checkpoint."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

LATEST = "latest"  # checkpoints/latest names the newest complete tag; it moves only after a save finishes
TAG_CONFIG = "config.yaml"  # the config a tag was written with, saved inside it last: the tag is complete


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_settings(path: Path, settings: dict, what: str) -> None:
    """PATH records the settings of what workers write beside it: the first worker writes it, every other one
    checks that it was started with the same (keys PATH has beyond `settings` are not compared). The record
    appears whole or not at all, even when workers start together: it is written under a name of this
    process's own and hard-linked into place, which fails if another worker got there first."""
    settings = json.loads(json.dumps(settings))  # as read back: tuples become lists
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(settings, indent=1) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    previous = json.loads(path.read_text())
    if {k: previous.get(k) for k in settings} != settings:
        raise ValueError(f"{path}: this place holds {what} made with {previous}, not {settings}; use another "
                         "output, or remove it to start over")


def tag_of(step: int) -> str:
    """The folder name of the checkpoint of `step` (step00000200)."""
    return f"step{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a tag's folder name (step00000200), None for anything else."""
    return int(name[4:]) if name.startswith("step") and name[4:].isdigit() else None


def latest_checkpoint(run_dir: Path) -> str | None:
    """The tag `latest` names; None before the first checkpoint. A `latest` that is empty or names a missing
    tag (edited, or restored from a backup without its tags) falls back, with a warning, to the newest complete
    tag, or is refused naming the file when there is none."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    latest = ckpt_dir / LATEST
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    if tag and (ckpt_dir / tag).is_dir():
        return tag
    complete = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir() and (p / TAG_CONFIG).is_file())
    named = f"names {tag!r}, which is not a checkpoint in {ckpt_dir}" if tag else "is empty"
    if not complete:
        raise FileNotFoundError(f"{latest}: {named}, and no complete checkpoint is there to fall back to")
    print(f"pretrieve: {latest} {named}; using the newest complete one, {complete[-1]}", file=sys.stderr)
    return complete[-1]


def locate(path: Path) -> tuple[Path, Path, str]:
    """(run_dir, checkpoints dir, tag) of a run directory, its checkpoints/ directory or one tag directory. A
    missing path, and a run that has no checkpoint yet, are errors that say so."""
    given = path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run directory, checkpoints directory or checkpoint tag")
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / LATEST).is_file():
        return path.parent, path, (path / LATEST).read_text().strip()
    if path.is_dir() and path.name.startswith("step"):
        return path.parent.parent, path.parent, path.name
    run_dir = path.parent if path.name == "checkpoints" else path
    if (run_dir / TAG_CONFIG).is_file():  # a run's config.yaml, written when it starts
        raise FileNotFoundError(f"{given}: a run with no checkpoint yet (it stopped, or is, before its first: "
                                "checkpoint.every steps); nothing to export until it has one")
    raise FileNotFoundError(f"{given}: not a run directory, checkpoints directory or checkpoint tag")
