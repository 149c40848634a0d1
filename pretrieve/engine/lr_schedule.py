"""Learning-rate schedules (`train.lr_schedule`): a factor of the peak lr `train.lr` for every optimizer step.

Step k (0-based: the k-th update) of a run of T = `train.max_steps` steps with W = round(warmup_ratio x T)
warm-up steps gets lr x factor(k):
    warm-up    k < W:  (k + 1) / W                 (the first update is not wasted at lr 0)
    linear:            (T - k) / (T - W)           (to 0 at T; BERT, RetroMAE)
    cosine:            (1 + cos(pi (k - W) / (T - W))) / 2
    constant:          1
    wsd:               1 until T - D, then (T - k) / D, D = round(decay_ratio x T)
                       (warm-up-stable-decay, Hu et al. 2024 "MiniCPM"; OLMo's model ladder branches short
                       decays off one stable run: `init_checkpoint`)
The schedule is a torch LambdaLR handed to DeepSpeed, which saves its position in every checkpoint, so a
resumed run continues it exactly; a branch (`init_checkpoint`) starts it at the step it branched from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch



@dataclass(frozen=True)
class LRSchedule:
    kind: str
    total_steps: int
    warmup_steps: int
    decay_steps: int = 0  # wsd only

    @classmethod
    def of(cls, train) -> "LRSchedule":
        """The schedule of a `train:` section (engine config.TrainOptions)."""
        decay = round(train.decay_ratio * train.max_steps) if train.lr_schedule == "wsd" else 0
        return cls(train.lr_schedule, train.max_steps, round(train.warmup_ratio * train.max_steps), decay)

    def factor(self, k: int) -> float:
        """lr / peak lr of update k (0-based)."""
        total, warmup = self.total_steps, self.warmup_steps
        if k < warmup:
            return (k + 1) / warmup
        if self.kind == "constant":
            return 1.0
        if self.kind == "wsd":
            decay_start = total - self.decay_steps
            return 1.0 if k < decay_start else max(0.0, (total - k) / self.decay_steps)
        progress = min(1.0, (k - warmup) / max(1, total - warmup))
        if self.kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0 - progress  # linear

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """For `deepspeed.initialize(lr_scheduler=...)`: DeepSpeed steps it after every optimizer step."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)


def start_at(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Put a fresh scheduler at `step` updates done (a branch starts its own schedule mid-run)."""
    scheduler.last_epoch = step - 1
    scheduler.step()
