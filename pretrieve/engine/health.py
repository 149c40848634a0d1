"""A broken run says so: the training loop's health alarms (docs/training.md, "Health alarms").

  nonfinite       a NaN or inf loss, or gradient norm                                   exit 87
  collapse        a log window's loss below `collapse_fraction` of the run's first one  exit 88
  zero_grad_norm  the gradient norm 0 at every step of a log window                     exit 89
  zero_lr         the learning rate 0 at a step after the warm-up                       exit 90

Each is warn, stop or off (`train.health`, utils/health_options.py): a line in the log, the progress line's
`alarm` figure and an MLflow tag `pretrieve.health.<alarm>`, then, for stop, the run's end with the alarm's exit
code (its MLflow run FAILED).

No alarm reads the device at a step that does not log. Each micro-batch's loss and each step's gradient norm are
judged on the device (the window's first micro-batch whose loss is not finite, its first step whose norm is not,
the count of steps whose norm is 0), and those three numbers come back with the metrics window's one read at the
log step (engine/metrics.py), reduced over ranks (by their minimum) so that every rank stops at the same step. The
learning rate is the host's already. Where each micro-batch came from (the position's `last_batch`: a stream's
slot and offset, the examples of a fine-tuning batch) is kept on the host, and named (its shard and samples) only
once a loss is found not finite.

A checkpoint never holds a non-finite step's state: a save checks the window first (at a log step, the window just
judged; at a save step that does not log, one read of those numbers), and a bad window is not saved, so `latest`
stays the last good checkpoint.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

from pretrieve.engine.preemption import Stopped
from pretrieve.utils.health_options import HealthOptions
from pretrieve.utils.run_dir import latest_checkpoint
from pretrieve.utils.stop_signals import HEALTH_EXIT_CODES

CAUSES = {
    "nonfinite": "too high a learning rate, fp16 without loss scaling, a bad batch (an empty text, a label out of "
                 "range)",
    "collapse": "a leak: a model that sees its own targets (a decoder shown the tokens it predicts), or data "
                "repeated until it is learned by heart",
    "zero_grad_norm": "no gradient reaches the trained weights: a frozen model, an optimizer group left out, a "
                      "loss cut off from the graph",
    "zero_lr": "a schedule that ends before train.max_steps, or an optimizer lr of 0",
}


class HealthStopped(Stopped):
    """An alarm set to stop ended the run; exits with the alarm's code (HEALTH_EXIT_CODES). Every rank stops at
    the same step; rank 0 prints the line."""

    every_rank = False

    def __init__(self, alarm: str, line: str):
        super().__init__(HEALTH_EXIT_CODES[alarm], line)
        self.alarm = alarm


class Health:
    """The alarms of one run on one rank. The loop calls `add_micro` after each forward, `norm_before_step` and
    `add_step` at each optimizer step, `stop_if_alarmed` after each step's progress line and `may_save` before a
    checkpoint; the metrics window calls `values` and `read` at a log step."""

    def __init__(self, options: HealthOptions, device, rank: int, world: int, warmup_steps: int, fp16: bool,
                 run_dir: Path, tracker=None, position=None):
        self.options, self.device, self.rank, self.world = options, device, rank, world
        self.warmup_steps, self.fp16, self.run_dir = warmup_steps, fp16, run_dir
        self.tracker, self.position = tracker, position
        self.progress = None  # the loop's progress bar: its line shows the alarms, its notes the messages
        self.early: list | None = None  # [step, loss] of the run's first logged window: collapse's reference
        self.raised: dict[str, int] = {}  # alarm -> the step it was first raised at
        self.stop: HealthStopped | None = None
        self.window_bad = False  # the window judged last held a non-finite step
        self._reset()

    @classmethod
    def off(cls, device) -> Health:
        """Every alarm off: the loop's own checks skipped, nothing judged."""
        return cls(HealthOptions(**dict.fromkeys(HEALTH_EXIT_CODES, "off")), device, 0, 1, 0, False, Path("."))

    def on(self, alarm: str) -> bool:
        return getattr(self.options, alarm) != "off"

    def _reset(self) -> None:
        self.micro: list[tuple[int, object]] = []  # (step, origin) of each micro-batch of the window
        self.steps: list[int] = []
        self.bad_loss = self.bad_norm = self.zero_norms = None  # device: first bad micro-batch, first bad step, count
        self.host_bad_norm, self.host_zero_norms, self.known_norms = math.inf, 0, 0  # norms DeepSpeed gave as floats
        self.zero_lr_step: int | None = None

    # --- on the device, no read -------------------------------------------------------------------------------
    def add_micro(self, step: int, loss: torch.Tensor, origin) -> None:
        """A micro-batch of optimizer step `step` (1-based) and where it came from (host-side)."""
        self.micro.append((step, origin))
        if self.on("nonfinite"):
            at = torch.where(torch.isfinite(loss), math.inf, float(len(self.micro) - 1))
            self.bad_loss = at if self.bad_loss is None else torch.minimum(self.bad_loss, at)

    def norm_before_step(self, engine, clipped: torch.Tensor | None):
        """This step's gradient norm where only the loop has it: the norm it clipped with, or (ZeRO 0, no
        wrapper, DeepSpeed clipping) the module's own gradients'; None where DeepSpeed's wrapper keeps it."""
        if not (self.on("nonfinite") or self.on("zero_grad_norm")):
            return None
        if clipped is not None:
            return clipped
        if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
            return None  # engine.get_global_grad_norm() after the step
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else None

    def add_step(self, step: int, lr: float, norm, engine) -> None:
        """Optimizer step `step` done, at `lr`, with gradient norm `norm` (norm_before_step's, or None)."""
        self.steps.append(step)
        if self.on("zero_lr") and step > self.warmup_steps and lr == 0 and self.zero_lr_step is None:
            self.zero_lr_step = step
        if not (self.on("nonfinite") or self.on("zero_grad_norm")):
            return
        norm = engine.get_global_grad_norm() if norm is None else norm
        if norm is None:  # ZeRO 1/2 with compute_grad_norm off: the norm is not known
            return
        self.known_norms += 1
        index = len(self.steps) - 1
        check_finite = self.on("nonfinite") and not self.fp16  # fp16: the loss scaler skips overflowing steps
        if not torch.is_tensor(norm):  # DeepSpeed read it already (a skipped step's inf)
            if check_finite and not math.isfinite(norm):
                self.host_bad_norm = min(self.host_bad_norm, index)
            self.host_zero_norms += norm == 0
            return
        if check_finite:
            at = torch.where(torch.isfinite(norm), math.inf, float(index))
            self.bad_norm = at if self.bad_norm is None else torch.minimum(self.bad_norm, at)
        zero = norm.detach() == 0
        self.zero_norms = zero.double() if self.zero_norms is None else self.zero_norms + zero

    def values(self) -> torch.Tensor | None:
        """The window's device numbers, for the metrics window's one read: the first bad micro-batch and step and
        the count of zero norms, reduced over ranks by their minimum, then this rank's own first bad micro-batch.
        None when there are none (every device check off)."""
        kept = (self.bad_loss, self.bad_norm, self.zero_norms)
        if all(value is None for value in kept):
            return None
        flags = torch.stack([torch.full((), default, dtype=torch.float64, device=self.device) if value is None
                             else value.to(self.device, torch.float64)  # an offloaded optimizer's norm: on the CPU
                             for value, default in zip(kept, (math.inf, math.inf, 0.0))])
        if self.world == 1:
            return flags
        import torch.distributed as dist

        own = flags[:1].clone()
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # all ranks the same verdict, at the same step
        return torch.cat([flags, own])

    # --- on the host, after the read ---------------------------------------------------------------------------
    def read(self, step: int, values: list[float], loss: float) -> None:
        """Judge the window that ends at log step `step` (its mean loss `loss`, `values` as read) and start a new
        one; an alarm set to stop is raised by the next stop_if_alarmed."""
        nonfinite = self._nonfinite(values)
        self.window_bad = nonfinite is not None
        alarms = {"nonfinite": nonfinite, "collapse": self._collapse(step, loss),
                  "zero_grad_norm": self._zero_grad_norm(values), "zero_lr": self._zero_lr()}
        self._reset()
        for alarm, text in alarms.items():
            if text is not None and self.on(alarm):
                self._raise(alarm, step, text)

    def _nonfinite(self, values: list[float]) -> str | None:
        bad_loss, bad_norm, _, own = (values + [math.inf])[:4] if values else (math.inf, math.inf, 0, math.inf)
        own = bad_loss if self.world == 1 else own
        bad_norm = min(bad_norm, self.host_bad_norm)
        if not self.on("nonfinite") or (bad_loss == math.inf and bad_norm == math.inf):
            return None
        loss_step = self.micro[int(bad_loss)][0] if bad_loss < math.inf else math.inf
        norm_step = self.steps[int(bad_norm)] if bad_norm < math.inf else math.inf
        if loss_step > norm_step:
            batches = "; ".join(self._describe(origin) for at, origin in self.micro if at == norm_step)
            return f"the gradient norm is not finite at step {norm_step} (its losses are); its batches: {batches}"
        also = " (and so is the gradient norm)" if norm_step == loss_step else ""
        if own == bad_loss:
            fed = f"fed by rank {self.rank}'s micro-batch: {self._describe(self.micro[int(own)][1])}"
        else:
            fed = "fed by another rank's micro-batch (that rank's line names it)"
        if own < math.inf and self.rank != 0:
            self.note(f"pretrieve: rank {self.rank}: the non-finite loss of step {self.micro[int(own)][0]} came "
                      f"from {self._describe(self.micro[int(own)][1])}")
        return f"the loss is not finite (NaN or inf) at step {loss_step}{also}, {fed}"

    def note(self, line: str) -> None:
        if self.progress is not None:
            self.progress.note(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _describe(self, origin) -> str:
        describe = getattr(self.position, "describe_batch", None)
        if origin is None or describe is None:
            return "its samples are not known to this loader"
        try:
            return describe(origin)
        except Exception as e:  # noqa: BLE001 - naming the data must not hide the alarm
            return f"its samples could not be named ({type(e).__name__}: {e})"

    def _collapse(self, step: int, loss: float) -> str | None:
        if not math.isfinite(loss):
            return None
        if self.early is None:  # the first window of the run (of a resume from a checkpoint without it)
            self.early = [step, loss] if loss > 0 else None
            return None
        fraction = self.options.collapse_fraction
        if loss >= fraction * self.early[1]:
            return None
        return (f"the loss fell to {loss:.4g}, below {fraction:g} of its first logged value {self.early[1]:.4g} "
                f"(step {self.early[0]})")

    def _zero_grad_norm(self, values: list[float]) -> str | None:
        zeros = (values[2] if values else 0) + self.host_zero_norms
        if not self.steps or self.known_norms < len(self.steps) or zeros < len(self.steps):
            return None
        span = f"step {self.steps[0]}" if len(self.steps) == 1 else f"steps {self.steps[0]}-{self.steps[-1]}"
        return f"the gradient norm was 0 at every step of the window ({span})"

    def _zero_lr(self) -> str | None:
        if self.zero_lr_step is None:
            return None
        return (f"the learning rate is 0 at step {self.zero_lr_step}, after the warm-up's {self.warmup_steps} "
                f"step{'s' * (self.warmup_steps != 1)}")

    def _raise(self, alarm: str, step: int, text: str) -> None:
        action, code = getattr(self.options, alarm), HEALTH_EXIT_CODES[alarm]
        first = alarm not in self.raised
        self.raised.setdefault(alarm, step)
        if self.progress is not None:
            self.progress.postfix(**{**self.progress.figures, **self.figures()})
        what = f"alarm {alarm} at step {step}: {text}; likely {CAUSES[alarm]}"
        if first and self.tracker is not None:
            self.tracker.set_tag(f"pretrieve.health.{alarm}", f"{action}: {what}"[:5000])
        if action == "stop" and self.stop is None:
            kept = self._latest()
            if alarm == "nonfinite":
                kept = f"no checkpoint of this state is saved, {kept}"
            self.stop = HealthStopped(alarm, f"{what}; {kept}; exit {code} (train.health.{alarm}: stop)")
        elif action == "warn" and first and self.rank == 0:
            self.note(f"pretrieve: warning: {what}; training goes on (train.health.{alarm}: warn; stop ends the "
                      f"run with exit {code})")

    def _latest(self) -> str:
        tag = latest_checkpoint(self.run_dir)
        return f"`latest` stays {tag}" if tag else "no checkpoint was saved yet"

    def figures(self) -> dict[str, str]:
        """The progress line's figure: the alarms raised so far."""
        return {"alarm": ",".join(self.raised)} if self.raised else {}

    def stop_if_alarmed(self) -> None:
        """Raise the alarm set to stop (its MLflow run ended FAILED), if one was raised."""
        if self.stop is not None:
            if self.progress is not None:
                self.progress.show()
            if self.tracker is not None:
                self.tracker.finish("FAILED")
            raise self.stop

    def may_save(self, step: int, log_now: bool) -> bool:
        """Whether step `step`'s checkpoint may be saved: not when the window holds a non-finite step (with
        nonfinite: stop, the run ends here instead)."""
        if not self.on("nonfinite"):
            return True
        bad = self.window_bad
        if not log_now:
            # the one read at a save step that does not log: a checkpoint must not hold a non-finite state
            values = self.values()
            text = self._nonfinite(values.tolist() if values is not None else [])
            if text is not None:
                self._raise("nonfinite", step, text)
                self.stop_if_alarmed()
            bad = text is not None
        if bad and self.rank == 0:
            self.note(f"pretrieve: step {step}: checkpoint not saved, its window holds a non-finite step; "
                      f"{self._latest()}")
        return not bad

    def state_dict(self) -> dict:
        return {"early": self.early}

    def load_state_dict(self, state: dict) -> None:
        self.early = state.get("early")
