"""How the heads compute the cross-entropy of a vocabulary projection (`model.vocab_loss`).

    loss = vocab_cross_entropy(x, weight, bias, labels, "auto")
         == F.cross_entropy(F.linear(x, weight, bias), labels)        (labels of -100 left out, as ignore_index)

Each path computes that loss and its gradients for x, weight and bias; they differ in speed and memory:
  chunked  models/vocab_projection.py: logits made chunk by chunk of positions, gradients made in forward and
           summed in fp32; no [positions, V] tensor is kept. The fastest on CPU (cache-sized passes), but its
           weight gradient is an fp32 GEMM, a small fraction of a GPU's bf16 rate
  plain    F.linear in the compute dtype (bf16 GEMMs on a GPU, forward and backward) and F.cross_entropy on
           fp32 logits; keeps the [positions, V] logits from forward to backward
  liger    Liger-Kernel's fused linear cross-entropy (Triton kernels, chunked, bf16 GEMMs into an fp32
           gradient): needs a CUDA device, or the Triton interpreter (TRITON_INTERPRET=1: tests on CPU)
  auto     chunked on CPU, plain on CUDA (until the GPU ladder has measured them)
The heads pass the labelled positions, padded to a fixed count by rows labelled -100 (models/token_targets.py),
which are dropped (chunked: the CPU path, which reads their count by `nonzero`) or ignored (plain, liger: no
read of the device).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pretrieve.models.vocab_projection import linear_cross_entropy
from pretrieve.optional import LIGER, require

VOCAB_LOSSES = ("auto", "chunked", "plain", "liger")
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index; the collators' "no label"


def vocab_loss_problem(impl: str) -> str | None:
    """Why `model.vocab_loss: impl` cannot run here (an unknown value, liger without its package or a device),
    or None."""
    if impl not in VOCAB_LOSSES:
        return f"model.vocab_loss: {impl!r} is not one of {', '.join(VOCAB_LOSSES)}"
    if impl == "liger":
        try:
            require(LIGER, "model.vocab_loss: liger")
        except ModuleNotFoundError as e:
            return str(e)
        if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
            return ("model.vocab_loss: liger runs Liger-Kernel's Triton kernels, which need a CUDA device; "
                    "use auto, chunked or plain on CPU")
    return None


def resolve(impl: str, device: torch.device) -> str:
    """The path `impl` stands for on `device` (auto: chunked on CPU, plain on CUDA); refuses what cannot run."""
    problem = vocab_loss_problem(impl)
    if problem is not None:
        raise ValueError(problem)
    if impl == "auto":
        return "plain" if device.type == "cuda" else "chunked"
    return impl


def vocab_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                        impl: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of the logits x @ weight.T + bias [N, V] against labels [N], over the labels that are
    not IGNORE_INDEX, computed by path `impl` (VOCAB_LOSSES); bias None: none."""
    path = resolve(impl, x.device)
    if path == "chunked":  # drops the unlabelled rows: one read of the count (a device sync on a GPU)
        keep = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        if not len(keep):  # padding entries alone: no mean to take (the caller's loss is 0 there)
            return x.sum() * 0.0
        return linear_cross_entropy(x.index_select(0, keep), weight, bias, labels.index_select(0, keep))
    # the GPU paths skip unlabelled rows by ignore_index: a boolean index would make the host wait for the device
    # (the heads pass the labelled positions alone anyway)
    if path == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return zero_without_labels(liger_fused_linear_cross_entropy(x, weight, labels, bias, ignore_index=IGNORE_INDEX,
                                                                    accum_dtype=torch.float32), labels)
    logits = F.linear(x, weight, bias)
    # log-softmax and its sums in fp32, as the chunked path: a bf16 loss would keep 3 significant digits
    return zero_without_labels(F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels),
                               labels)


def zero_without_labels(loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`loss`, or 0 where every label is IGNORE_INDEX (a fixed count's padding alone: a batch of stream pad
    samples), whose mean is 0 / 0; decided on the device, no read. No gradient flows there: cross-entropy's
    backward writes none at ignored rows."""
    return torch.where((labels != IGNORE_INDEX).any(), loss, 0.0)
