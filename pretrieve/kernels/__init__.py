"""Two-stream masked attention for RetroMAE-style decoders, fed by the compact decoder mask.

    out = two_stream_attention(q, k, v, CompactMask(dec_pool, dec_row, lengths), impl="auto")

q from the query stream, k and v from the context stream, all [B, heads, L, d]. Implementations:
`fused` (Triton kernel, kernels/fused.py; CUDA, or CPU under TRITON_INTERPRET=1), `sdpa` (PyTorch
scaled_dot_product_attention with the dense boolean mask), `eager` (matmul, softmax, matmul: the
reference). `auto` = the faster of fused and sdpa as measured on this device at about this length
(kernels/choice.py and its table); sdpa on CPU, under attention dropout, or where nothing was measured.
The fused kernel has no attention-probability dropout, and runs on a CUDA device or under Triton's interpreter:
anything else is an error naming method.attention_impl (`fused_problem`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

IMPLEMENTATIONS = ("auto", "fused", "sdpa", "eager")


@dataclass(frozen=True)
class CompactMask:
    dec_pool: torch.Tensor  # uint8 [B, P, ceil(L / 8)], bit-packed visibility rows
    dec_row: torch.Tensor  # int16 [B, L], the pool row of each query position
    lengths: torch.Tensor  # [B] sequence lengths (special tokens included)


def resolve(impl: str, device: torch.device, dropout_p: float = 0.0, length: int | None = None) -> str:
    """The implementation a call runs; `length`: its sequence length L (auto without one: sdpa)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "auto":
        from pretrieve.kernels import choice
        from pretrieve.kernels.fused import available

        if length is None:
            return choice.DEFAULT
        return choice.auto(device, length, dropout_p, available())
    if impl == "fused" and (problem := fused_problem(dropout_p, device.type == "cuda")) is not None:
        raise ValueError(problem)
    return impl


def fused_problem(dropout_p: float = 0.0, cuda: bool | None = None) -> str | None:
    """Why the fused kernel cannot run (None: it can): attention dropout, which it has none of; no triton; or no
    CUDA device (`cuda`; None: whether this machine has one) outside Triton's interpreter (TRITON_INTERPRET=1, set
    before triton loads: how the tests run it on CPU). Without one, triton fails at the first step with "0 active
    drivers"."""
    from pretrieve.kernels.fused import available

    if dropout_p > 0:
        return ("method.attention_impl: the fused two-stream attention has no attention dropout; set "
                "method.decoder_attention_dropout to 0 or use attention_impl sdpa/eager")
    if not available():
        return "method.attention_impl: fused needs triton, which is not installed: pip install 'pretrieve[gpu]'"
    if not (torch.cuda.is_available() if cuda is None else cuda) and os.environ.get("TRITON_INTERPRET") != "1":
        return ("method.attention_impl: fused runs a Triton kernel, which needs a CUDA device; use auto, sdpa or "
                "eager on CPU")
    return None


def two_stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: CompactMask,
                         impl: str = "auto", dropout_p: float = 0.0) -> torch.Tensor:
    from pretrieve.kernels import reference

    impl = resolve(impl, q.device, dropout_p, q.shape[-2])
    if impl == "fused":
        return _fused(q, k, v, mask)
    if impl == "sdpa":
        return reference.two_stream_attention(q, k, v, mask.dec_pool, mask.dec_row, mask.lengths, dropout_p)
    return reference.eager_two_stream_attention(q, k, v, mask.dec_pool, mask.dec_row, mask.lengths, dropout_p)


@torch.compiler.disable  # a compiled decoder layer (train.compile) runs the kernel as it is, a graph break:
def _fused(q, k, v, mask: CompactMask) -> torch.Tensor:  # dynamo traces neither its launch nor the CPU interpreter
    from pretrieve.kernels.fused import fused_two_stream_attention

    return fused_two_stream_attention(q, k, v, mask.dec_pool, mask.dec_row, mask.lengths)
