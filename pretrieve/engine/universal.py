"""`pretrieve universal RUN`: a run's latest checkpoint as a DeepSpeed universal checkpoint.

ZeRO 1-3 checkpoints hold optimizer partitions for one world size. To resume at another, convert once; the
universal copy becomes the run's `latest`, and `resume=auto` at any world size loads it (the engine sees a
universal tag and sets DeepSpeed's `checkpoint.load_universal`). The stream position is shared by all ranks
(they advance in lockstep), so the data continues without losing or repeating a sample; the dropout RNG of
the new ranks is re-seeded, so such a resume is not bit-exact.

    pretrieve universal runs/dupmae          # checkpoints/step00001000 -> checkpoints/step00001000-universal
    torchrun --nproc_per_node 1 -m pretrieve pretrain CONFIG run_dir=runs/dupmae resume=auto
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pretrieve.utils.run_dir import LATEST, locate, write_atomic

UNIVERSAL_SUFFIX = "-universal"


def is_universal(tag_dir: Path) -> bool:
    return tag_dir.name.endswith(UNIVERSAL_SUFFIX) and (tag_dir / "zero").is_dir()


def to_universal(path: str | Path) -> Path:
    """Convert the latest checkpoint of run `path` and point `latest` at the universal copy."""
    _, ckpt_dir, tag = locate(Path(path))
    if tag.endswith(UNIVERSAL_SUFFIX):
        return ckpt_dir / tag
    source = ckpt_dir / tag
    if not any(source.glob("*optim_states.pt")):
        raise ValueError(f"{source}: a ZeRO-0 checkpoint loads at any world size as it is; no conversion needed")
    out = ckpt_dir / f"{tag}{UNIVERSAL_SUFFIX}"
    tmp = ckpt_dir / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(source), "--output_folder", str(tmp), "--inject_missing_state"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{source}: ds_to_universal failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # complete before `latest` names it
    (ckpt_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer, to the temporary name
    write_atomic(ckpt_dir / LATEST, out.name)
    return out
