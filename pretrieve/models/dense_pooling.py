"""`cls`, `mean` and `last`: one vector per text pooled from the encoder's token states (models/poolings.py names
them for the command line)."""

from __future__ import annotations

import torch


def cls_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def mean_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def last_token_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each text's last real token, under right or left padding: a causal decoder's one state that has read the
    whole text (E5-Mistral, Qwen3-Embedding)."""
    width = attention_mask.shape[1]
    last = width - 1 - attention_mask.flip(1).int().argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


# what evaluation, fine-tuning and the contrastive method offer (models/poolings.py); last: decoder LLMs
POOLINGS = {"cls": cls_pooling, "mean": mean_pooling, "last": last_token_pooling}
