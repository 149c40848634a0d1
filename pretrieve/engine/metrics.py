"""What the training loop reports: run_dir/metrics.jsonl and MLflow, on rank 0 (docs/training.md, "Metrics").

The loop adds each micro-batch's losses, counts and FLOPs to a MetricsWindow; the sums stay on the device, so a
micro-step reads nothing back (on a GPU each read would wait for it). At a log step the window is reduced over
ranks in one collective and read back once: losses averaged over ranks and micro-batches, throughput summed over
ranks (tokens: non-padding), the share of the batches' positions that are padding, TFLOP/s and MFU per device
(engine/flops.py), the gradient norm and the loss scale. The health alarms' numbers (engine/health.py) come
back with the same read.

Log steps are every `train.log_every`-th step and the last of the schedule, wherever a run stops: a checkpoint
carries the window's partial sums (`state_dict`), so a run stopped in the middle of an interval and resumed logs
the uninterrupted run's records, bit for bit but the timings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pretrieve.utils.run_dir import write_atomic


class MetricsWindow:
    """The sums since the last log step, and the writers of the records (rank 0: metrics.jsonl and `tracker`;
    the other ranks write nothing but take part in the reduction)."""

    def __init__(self, path: Path | None, tracker, engine, peak: float | None, health=None):
        self.path, self.file = path, None  # opened at the first record: a resume truncates it after its load
        self.tracker, self.engine, self.peak, self.health = tracker, engine, peak, health
        self._reset()

    def state_dict(self) -> dict:
        """The partial sums since the last log step (a checkpoint carries them), as plain numbers: float64 sums
        come back exactly."""
        return {"loss": float(self.loss), "parts": {n: float(v) for n, v in self.parts.items()},
                "micro": self.micro, "tokens": self.tokens, "samples": self.samples, "flops": self.flops,
                "positions": self.positions, "seconds": time.perf_counter() - self.started}

    def load_state_dict(self, state: dict) -> None:
        """Continue the window `state` describes: the next micro-batch's losses add to these float64 sums in the
        order they would have (held as Python floats: nothing is allocated before the first step, whose CPU
        kernels may round otherwise on memory laid out otherwise)."""
        self.loss = state["loss"]
        self.parts = dict(state["parts"])
        for key in ("micro", "tokens", "samples", "flops", "positions"):
            setattr(self, key, state[key])
        self.started = time.perf_counter() - state["seconds"]

    @staticmethod
    def merged(states: list[dict]) -> dict:
        """One window holding the sums of `states` (a resume at another world size: rank 0 takes them all)."""
        names = {name for state in states for name in state["parts"]}
        return {"loss": sum(s["loss"] for s in states),
                "parts": {n: sum(s["parts"].get(n, 0.0) for s in states) for n in names},
                **{key: sum(s[key] for s in states) for key in ("micro", "tokens", "samples", "flops", "positions")},
                "seconds": max(s["seconds"] for s in states)}

    def _reset(self) -> None:
        self.loss, self.parts = 0.0, {}
        self.micro = self.tokens = self.samples = self.flops = self.positions = 0
        self.started = time.perf_counter()

    def add(self, out: dict, samples: int, tokens: int, flops: int, positions: int = 0) -> None:
        """One micro-batch: its named losses (summed on the device), its host-side counts (`positions`: its
        padded shape's, padding included) and FLOPs."""
        self.micro += 1
        self.positions += positions
        self.samples += samples
        self.tokens += tokens
        self.flops += flops
        for name, value in out.items():
            if name == "loss":
                self.loss = self.loss + value.detach().double()
            else:
                self.parts[name] = self.parts.get(name, 0.0) + value.detach().double()

    def log(self, step: int, lr: float, grad_norm: float | None) -> dict:
        """The window's record at optimizer step `step` (`lr`: that update's), written; the window starts over."""
        import torch.distributed as dist

        names = sorted(self.parts)
        losses = torch.stack([self.loss, *(self.parts[n] for n in names)])  # on the device: one sync here
        counts = torch.tensor([self.micro, self.tokens, self.samples, self.flops, self.positions],
                              dtype=torch.float64, device=losses.device)
        sums = torch.cat([losses, counts])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(sums)
        alarms = self.health.values() if self.health is not None else None  # read with the sums, once
        values = (sums if alarms is None else torch.cat([sums, alarms])).tolist()
        loss, *parts, micro, tokens, samples, flops, positions = values[:len(sums)]
        seconds = time.perf_counter() - self.started  # after the sync: the GPU has finished the window's work
        micro = max(micro, 1)
        device_flops = flops / world / seconds
        record = {"step": step, "loss": loss / micro, **{n: v / micro for n, v in zip(names, parts)},
                  "lr": lr, "tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds,
                  "tflops_per_device": device_flops / 1e12}
        if positions:
            record["padding_fraction"] = 1 - tokens / positions
        if self.peak:
            record["mfu"] = device_flops / self.peak
        if grad_norm is None:
            grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        if self.engine.fp16_enabled():
            record["loss_scale"] = float(self.engine.optimizer.cur_scale)
        self.write(record)
        self._reset()
        if self.health is not None:
            self.health.read(step, values[len(sums):], record["loss"])
        return record

    def write(self, record: dict) -> None:
        """One record (with its "step") to metrics.jsonl and MLflow, on rank 0."""
        if self.path is not None and self.file is None:
            self.file = open(self.path, "a")
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tracker is not None:
            self.tracker.log_metrics(record["step"], record)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def plain_grad_norm(engine) -> float | None:
    """The gradient norm where DeepSpeed does not keep it (ZeRO 0 in fp32 clips with it and drops it); the
    gradients are already averaged over ranks at the accumulation boundary."""
    if engine.zero_optimization() or engine.fp16_enabled() or engine.bfloat16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the records after `step`: a crashed attempt's later steps run again after a resume."""
    if path.is_file():
        lines = path.read_text().splitlines(keepends=True)
        write_atomic(path, "".join(line for line in lines if json.loads(line)["step"] <= step))
