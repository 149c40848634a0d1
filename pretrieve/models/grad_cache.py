"""GradCache (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", §3.2):
a contrastive loss over a batch whose activations would not fit in memory, with the whole batch's gradients.

1. Representations: every text of the batch is encoded chunk by chunk, without a graph.
2. The loss and its gradient with respect to the representations (the loss's own graph is small: the
   representations and the score matrix).
3. Each chunk is encoded again, with a graph, and its slice of that gradient is back-propagated through it;
   the parameters' gradients add up over the chunks.

Steps 1 and 3 are the forward and the backward of one autograd Function, so a training step still makes one
backward call: DeepSpeed's accumulation boundary, ZeRO's gradient reduction and activation checkpointing see one
backward per micro-batch, as without GradCache (DeepSpeed's own TiledMLP has this shape). Inside it, ZeRO must
reduce a parameter's gradient once, after the last chunk: before the others the parameters are marked
`ds_grad_is_ready = False`, and ZeRO stages 1-3 leave their gradients accumulating in place.

Dropout: the random state (CPU, and the chunk's CUDA device) is saved before each chunk's first encoding and
restored for its second, so both draw the same masks; after the step the random state is the one the first
encodings left. The masks are drawn per chunk, so a chunk size changes which masks a batch gets (not their
distribution): the equality tests compare with the same chunks encoded under one graph.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

Encode = Callable[..., torch.Tensor]  # encode(*row-aligned tensors) -> [rows, d] representations


@dataclass(frozen=True)
class GradCache:
    """`grad_cache: {chunk: N}`: encode the batch N texts at a time (memory: one chunk's activations)."""

    chunk: int


def grad_cache_of(value, where: str) -> GradCache | None:
    """The `grad_cache` option `value` of section `where` (None: off); a ValueError names the key."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"chunk"}:
        raise ValueError(f"{where}.grad_cache: expected {{chunk: N}} (texts encoded at a time), got {value!r}")
    chunk = value["chunk"]
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{where}.grad_cache.chunk: must be an integer >= 1, got {chunk!r}")
    return GradCache(chunk)


def whole_batch_problem(value, where: str, rows: int, what: str) -> str | None:
    """The error of a chunk that splits nothing: `rows` texts in the micro-batch's largest group (`what` says
    which and why), all in one chunk, each encoded twice for nothing. None for a chunk below that."""
    cache = grad_cache_of(value, where)
    if cache is None or cache.chunk < rows:
        return None
    return (f"{where}.grad_cache.chunk: {cache.chunk} >= {what}: no chunk would split the micro-batch, and "
            f"GradCache would encode every text twice for nothing; give a chunk below {rows}, or leave "
            f"{where}.grad_cache out")


def encode_in_chunks(encode: Encode, groups: Sequence[tuple[torch.Tensor, ...]], chunk: int | None,
                     params: Sequence[torch.nn.Parameter], cache: bool = True) -> list[torch.Tensor]:
    """Each group's representations: `encode(*group)` with `chunk` None; with a chunk, `encode` on `chunk` rows
    at a time, through GradCache (`cache`) or under one graph (`cache=False`, what GradCache must equal).
    `params`: the trainable parameters `encode` uses (their ZeRO reduction waits for the last chunk)."""
    if chunk is None:
        return [encode(*group) for group in groups]
    if not cache or not torch.is_grad_enabled():
        return [torch.cat([encode(*part) for part in _chunks(group, chunk)]) for group in groups]
    anchor = torch.empty(0, requires_grad=True)  # makes the outputs require grad whatever the inputs
    arity = [len(group) for group in groups]
    return list(_CachedEncoding.apply(encode, chunk, arity, list(params), anchor,
                                      *[t for group in groups for t in group]))


def _chunks(group: tuple[torch.Tensor, ...], chunk: int) -> Iterator[tuple[torch.Tensor, ...]]:
    rows = len(group[0])
    for start in range(0, rows, chunk):
        yield tuple(t[start:start + chunk] for t in group)


def _rng_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def _replayed(state: tuple, device: torch.device):
    """Run with the random state `state`; the state from before comes back afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class _CachedEncoding(torch.autograd.Function):
    """forward: step 1 (no graph, random states saved); backward: step 3 for the gradient of step 2."""

    @staticmethod
    def forward(ctx, encode, chunk, arity, params, anchor, *tensors):
        groups, start = [], 0
        for n in arity:
            groups.append(tensors[start:start + n])
            start += n
        ctx.encode, ctx.params, ctx.runs = encode, params, []
        outputs = []
        for index, group in enumerate(groups):
            parts = []
            for part in _chunks(group, chunk):
                ctx.runs.append((index, len(part[0]), part, _rng_state(part[0].device)))
                parts.append(encode(*part))
            outputs.append(torch.cat(parts))
        ctx.num_inputs = len(tensors)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        todo, offsets = [], {}
        for index, rows, part, state in ctx.runs:
            start = offsets.get(index, 0)
            offsets[index] = start + rows
            if grads[index] is not None:
                todo.append((part, state, grads[index][start:start + rows]))
        try:
            for k, (part, state, grad) in enumerate(todo):
                last = k == len(todo) - 1
                for p in ctx.params:  # ZeRO reduces each gradient once, after its last chunk
                    p.ds_grad_is_ready = last
                with _replayed(state, part[0].device), torch.enable_grad():
                    out = ctx.encode(*part)
                torch.autograd.backward(out, grad)
        finally:
            for p in ctx.params:
                p.ds_grad_is_ready = True
        ctx.runs = None
        return (None,) * (5 + ctx.num_inputs)
