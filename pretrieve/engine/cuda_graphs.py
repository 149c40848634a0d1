"""`train.cuda_graphs`: the training step's forward and backward captured once as a CUDA graph and replayed for
every batch of the captured shapes, so that the host launches one graph a step instead of each of its kernels
(BERT-base's step on an H200 was bound by the host launching ~3,900 kernels: docs/benchmarks.md).

Why the whole forward and backward in one graph, PyTorch's "whole network capture", and not the others:
  - `torch.compile(mode="reduce-overhead")` graphs what it compiles, the whole model: it would replace
    `train.compile`'s regional compile (one graph for every layer) by a compile of the whole head, and its
    graph trees would own the activations' memory across DeepSpeed's step
  - `torch.cuda.make_graphed_callables` on each layer graphs the layers alone: the embeddings, the heads' losses
    and decoders and the launches between the layers stay the host's
  - one graph of the module's forward and the engine's backward keeps every launch of them off the host, and the
    loop, the health alarms, the metrics window and DeepSpeed's step (clipping, the optimizer, the schedule) stay
    eager, reading the graph's outputs and gradients after each replay: nothing reads the device inside it
DeepSpeed's forward is not captured: it synchronises the device for its throughput timer. The graph runs the
module under the engine's autocast (bf16-autocast, with autocast's cast cache off, as capture needs) and the
engine's backward, which at ZeRO 0 on one rank adds only host bookkeeping and the division by the gradient
accumulation steps. So the switch needs ZeRO 0, one rank, fp32 or bf16-autocast (no DeepSpeed wrapper), no
accumulation, no activation checkpointing, and batches of one shape (`train.static_shapes`): its row in the
table of speed switches refuses the rest by key when the config is read; the device, the world, the module and
the engine built are checked at start-up.

The first WARMUP_STEPS micro-batches run eagerly on a side stream (lazy initialisation, compiled layers' first
calls, cuBLAS workspaces happen there, not in the capture); then the next batch is captured and replayed. Its
gradients live in the graph's memory pool: after each replay they are handed back to the parameters, which
DeepSpeed's step sets to None. A batch of other shapes (a stream's short last batch) runs eagerly.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from pretrieve.utils.options import ConfigError

WARMUP_STEPS = 3  # eager micro-batches before the capture (PyTorch's whole-network example warms up 3)


def check_device() -> None:
    """A run with `train.cuda_graphs` needs a CUDA device: said before anything starts (the config may have been
    checked on a machine without one)."""
    if not torch.cuda.is_available():
        raise ConfigError(f"train.cuda_graphs: captures CUDA graphs, and torch {torch.__version__} sees no CUDA "
                          "device: leave it out on this machine")


def module_refusal(module: torch.nn.Module, world: int) -> str | None:
    """Why `train.cuda_graphs` cannot capture the step of `module` (the module the recipe built, for pre-training
    and fine-tuning alike) in a world of `world` ranks, or None."""
    from pretrieve.models.encoder import Encoder
    from pretrieve.models.heads.base import PretrainingHead

    if world > 1:
        return (f"train.cuda_graphs: one rank only (this world has {world}): the gradients' all-reduce of DeepSpeed's "
                "backward is not captured")
    if any(isinstance(m, Encoder) and m.unpad for m in module.modules()):
        return ("train.cuda_graphs: model.unpad packs each batch into a row of its own length, and a graph replays "
                "one shape: set model.unpad=false")
    if isinstance(module, PretrainingHead) and type(module).set_step is not PretrainingHead.set_step:
        return (f"train.cuda_graphs: {type(module).__name__}'s loss follows a schedule over training (set_step), "
                "which a replayed graph would keep at its value when captured")
    return None


def engine_refusal(engine) -> str | None:
    """Why the DeepSpeed engine built (its ds_config may be `train.ds_config`'s) cannot be captured, or None."""
    if engine.zero_optimization():
        return "train.cuda_graphs: needs ZeRO stage 0 (ZeRO's gradient hooks partition and reduce during backward)"
    if engine.bfloat16_enabled() or engine.fp16_enabled():
        return ("train.cuda_graphs: DeepSpeed's bf16 / fp16 wrapper checks gradients on the host: use "
                "train.precision=bf16-autocast or fp32")
    if engine.gradient_accumulation_steps() != 1:
        return "train.cuda_graphs: needs train.grad_accum=1 (the graph writes each gradient, it does not add to it)"
    return None


def check_module(module: torch.nn.Module, world: int) -> None:
    if (why := module_refusal(module, world)) is not None:
        raise ConfigError(why)


def _signature(batch: dict) -> tuple:
    return tuple((k, tuple(v.shape), v.dtype) for k, v in batch.items())


@contextlib.contextmanager
def _no_autocast_cache():
    """Autocast's cache of cast weights off: cast copies made inside a capture would be freed when it ends."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


class CapturedStep:
    """The forward and backward of a micro-batch (on the host) through the engine: eager for the first
    WARMUP_STEPS and for a batch of other shapes than the captured one, else a replay of the captured graph."""

    def __init__(self, engine):
        if (why := engine_refusal(engine)) is not None:
            raise ConfigError(why)
        self.engine = engine
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.grads: list[torch.Tensor | None] = []
        self.signature: tuple | None = None
        self.side = torch.cuda.Stream()
        self.replayed = self.eager = 0

    def __call__(self, batch: dict) -> dict:
        """The module's outputs, detached; its gradients are the parameters'. The outputs of a replay are the
        graph's own tensors: read them before the next step (the loop's window and alarms sum them at once)."""
        if self.graph is None and self.eager < WARMUP_STEPS:
            return self._eager(batch, warmup=True)
        if self.graph is None:
            self._capture(batch)
        elif _signature(batch) != self.signature:
            return self._eager(batch)
        else:
            for key, value in batch.items():
                self.inputs[key].copy_(value, non_blocking=True)
        self.graph.replay()
        for param, grad in zip(self.params, self.grads):
            param.grad = grad
        self.replayed += 1
        return self.outputs

    def _eager(self, batch: dict, warmup: bool = False) -> dict:
        engine = self.engine
        batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
        if not warmup and self.eager == WARMUP_STEPS:
            print(f"train.cuda_graphs: a batch of other shapes than the captured one runs eagerly: "
                  f"{_signature(batch)}, not {self.signature}", file=sys.stderr, flush=True)
        self.eager += 1
        stream = self.side if warmup else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        # autocast's cache off as in the capture: torch.compile guards on it, and compiled layers would recompile
        with torch.cuda.stream(stream), _no_autocast_cache():
            out = engine(batch)
            engine.backward(out["loss"])
        torch.cuda.current_stream().wait_stream(stream)
        return {k: v.detach() for k, v in out.items()}

    def _capture(self, batch: dict) -> None:
        from deepspeed.runtime.torch_autocast import autocast_if_enabled

        engine = self.engine
        self.inputs = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
        self.signature = _signature(self.inputs)
        for param in self.params:  # allocated by the captured backward in the graph's pool, rewritten by each replay
            param.grad = None
        graph = torch.cuda.CUDAGraph()
        try:
            with _no_autocast_cache(), torch.cuda.graph(graph):
                with autocast_if_enabled(engine):
                    out = engine.module(self.inputs)
                engine.backward(out["loss"])
        except RuntimeError as error:
            raise RuntimeError(
                f"train.cuda_graphs: the step could not be captured as a CUDA graph ({error}); a captured step must "
                "not read the device (.item(), nonzero, a boolean index: train.static_shapes removes the heads' "
                "reads) nor change shape") from error
        self.graph = graph
        self.outputs = {k: v.detach() for k, v in out.items()}
        self.grads = [param.grad for param in self.params]

    def summary(self) -> str:
        return (f"train.cuda_graphs: {self.replayed} micro-batches replayed, {self.eager} eager "
                f"({WARMUP_STEPS} warm-up, the rest of other shapes)")
