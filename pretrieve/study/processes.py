"""The `pretrieve` child processes of a method study outside its pre-training runs (`export`, `eval`), and the
environment every child of the study gets: `threads` torch threads (the study's settings), none of a rank's
variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def child_env(threads: int) -> dict:
    """This process's environment for a `pretrieve` child: `threads` torch threads, no tokenizer threads, none of
    our rank variables (DeepSpeed's accelerator: the study sets DS_ACCELERATOR=cpu where there is no GPU)."""
    out = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        out.pop(key, None)
    return out


def pretrieve(args: list, log_file: Path, threads: int) -> None:
    """`pretrieve ARGS` in its own process, output appended to `log_file`; an error names the log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as stream:
        code = subprocess.call([sys.executable, "-m", "pretrieve", *map(str, args)], stdout=stream,
                               stderr=subprocess.STDOUT, env=child_env(threads))
    if code != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"pretrieve {args[0]} failed (exit {code}); log {log_file}:\n" + "\n".join(tail))
