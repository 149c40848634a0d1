"""The run directory's small files: atomic writes, and the `latest` pointer to the newest complete checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "latest"  # checkpoints/latest names the newest complete tag; it moves only after a save finishes


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_checkpoint(run_dir: Path) -> str | None:
    latest = run_dir / "checkpoints" / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def locate(path: Path) -> tuple[Path, Path, str]:
    """(run_dir, checkpoints dir, tag) of a run directory, its checkpoints/ directory or one tag directory."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if (path / LATEST).is_file():
        return path.parent, path, (path / LATEST).read_text().strip()
    if path.is_dir() and path.name.startswith("step"):
        return path.parent.parent, path.parent, path.name
    raise FileNotFoundError(f"{path}: not a run directory, checkpoints directory or checkpoint tag")
