"""InfoNCE and the cross-rank gather: the one copy that contrastive pre-training, COSTA and fine-tuning share.

InfoNCE (van den Oord et al. 2018, eq. 4; DPR's in-batch form, Karpukhin et al. 2020 eq. 2): for an anchor a
with positive c+ among candidates C, L_a = -log( exp(s(a, c+)) / sum_{c in C} exp(s(a, c)) ), s already divided
by the temperature. Candidates left out of C (false negatives, padding) are masked to -inf before the softmax.

Negatives across ranks: every rank's candidates, concatenated in rank order, with gradients. The backward of
torch.distributed.nn's all_gather sums every rank's gradient for a rank's slot and hands each rank its own
slot's: each rank's rows get the gradient of every rank's loss, so the ranks' mean gradient (what DeepSpeed
applies) is the gradient of the global batch's mean loss, once each rank divides its anchors' sum by the global
batch's anchors over the world size (heads/contrastive.py pair_loss: ranks may hold different numbers of anchors
at an epoch's tail).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0 in rank order (each rank's must have the same shape),
    keeping gradients for this rank's part; the tensor itself without a process group of more than one rank."""
    if world()[1] == 1:
        return tensor
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(tensor.contiguous()), dim=0)


def gather_candidates(tensor: torch.Tensor, cross_device: bool = True) -> tuple[torch.Tensor, int]:
    """(the candidates, the index of this rank's first row among them): every rank's rows when `cross_device`,
    this rank's alone otherwise."""
    rank, size = world()
    if not cross_device or size == 1:
        return tensor, 0
    return gather_across_ranks(tensor), rank * tensor.shape[0]


def info_nce(scores: torch.Tensor, target: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """Per-anchor InfoNCE loss [A] of `scores` [A, C] (divided by the temperature), the positives' columns
    `target` [A], and `excluded` [A, C] (True: not a candidate; never the positive). Computed in fp32 at least."""
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    if excluded is not None:
        scores = scores.masked_fill(excluded, float("-inf"))
    return F.cross_entropy(scores, target, reduction="none")
