"""What a followed pre-training run shows, and the follower's decisions on it: which checkpoints are complete, which
are new to export, which the run deleted before they could be (checkpoint.keep), and whether the run has ended.
It only reads the run directory.

A tag is complete once its own config.yaml is written (last, engine/checkpoint.py) and `latest` has reached it:
`latest` moves only after a save has finished, so a tag beyond it is being written, or is what a crashed save
left, which the run writes again. The run has ended when its newest complete checkpoint is at `train.max_steps`
(the loop always saves its last step); a run stopped before (`train.stop_at`, a crash, a preemption waiting to be
requeued) is followed on once it resumes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pretrieve.config import CheckpointOptions, TrainOptions
from pretrieve.utils.run_dir import LATEST, TAG_CONFIG, step_of


@dataclass(frozen=True)
class RunView:
    """A run directory as the follower sees it at one look."""

    complete: tuple[int, ...]  # the steps of the complete checkpoints, ascending
    present: frozenset[int]  # the steps of every tag folder there, complete or not
    every: int  # checkpoint.every: the regular checkpoints' spacing
    keep: int  # checkpoint.keep
    max_steps: int  # train.max_steps: the run's last step
    first_step: int | None  # the first step the run logged (after a branch's start), None before any

    @property
    def latest(self) -> int | None:
        return self.complete[-1] if self.complete else None

    @property
    def ended(self) -> bool:
        return self.latest is not None and self.latest >= self.max_steps


def look(run_dir: Path) -> RunView:
    """The run directory `run_dir` now: its config.yaml (written when the run starts: none yet is a run to come),
    its tags and `latest`."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")) if (run_dir / "config.yaml").is_file() \
        else {}
    train, checkpoint = config.get("train") or {}, config.get("checkpoint") or {}
    ckpt_dir = run_dir / "checkpoints"
    steps = {step: path for path in (ckpt_dir.iterdir() if ckpt_dir.is_dir() else ())
             if path.is_dir() and (step := step_of(path.name)) is not None}
    latest = ckpt_dir / LATEST
    named = step_of(latest.read_text().strip()) if latest.is_file() else None
    if named not in steps:  # an edited or restored `latest`: the newest complete tag (None before the first)
        named = max((s for s, path in steps.items() if (path / TAG_CONFIG).is_file()), default=None)
    complete = tuple(sorted(s for s, path in steps.items() if named is not None and s <= named
                            and (path / TAG_CONFIG).is_file()))
    return RunView(complete, frozenset(steps), int(checkpoint.get("every", CheckpointOptions.every)),
                   int(checkpoint.get("keep", CheckpointOptions.keep)),
                   int(train.get("max_steps", TrainOptions.max_steps)), _first_step(run_dir / "metrics.jsonl"))


def _first_step(metrics: Path) -> int | None:
    try:
        with open(metrics) as stream:
            return json.loads(stream.readline())["step"]
    except (OSError, ValueError, KeyError, TypeError):  # no step logged yet
        return None


def wanted(step: int, view: RunView, every: int) -> bool:
    """Whether the follower evaluates checkpoint `step`: with `every` 1 each one; else every `every`-th of the
    regular ones (steps that are multiples of every x checkpoint.every) and the run's last."""
    return every == 1 or step % (every * view.every) == 0 or step == view.max_steps


@dataclass(frozen=True)
class Next:
    """What the follower does after a look: export these steps, skip those (step: why)."""

    export: tuple[int, ...]
    skip: dict[int, str]


def next_steps(view: RunView, every: int, handled: set[int], seen: set[int]) -> Next:
    """The follower's decision at a look. `handled`: the steps exported, evaluated or skipped already; `seen`: the
    complete steps earlier looks found. A wanted step not handled is exported when complete; one that earlier looks
    saw, or a regular checkpoint since the run's first step up to its latest, is skipped once its folder is gone."""
    export = tuple(s for s in view.complete if s not in handled and wanted(s, view, every))
    expected = set(seen)
    if view.latest is not None and view.first_step is not None:
        spacing = every * view.every
        expected.update(range(-(-view.first_step // spacing) * spacing, view.latest + 1, spacing))
    gone = sorted(s for s in expected if s not in view.present and s not in handled and wanted(s, view, every))
    why = f"deleted by the run (checkpoint.keep: {view.keep}) before being exported"
    return Next(export, {s: why for s in gone})
