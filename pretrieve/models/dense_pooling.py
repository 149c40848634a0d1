"""`cls` and `mean`: one vector per text pooled from the encoder's token states (models/poolings.py names them)."""

from __future__ import annotations

import torch


def cls_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def mean_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


POOLINGS = {"cls": cls_pooling, "mean": mean_pooling}
