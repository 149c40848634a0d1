"""`cls`, `mean` and `last`: one vector per text pooled from the encoder's token states (models/poolings.py names
the ones evaluation and fine-tuning offer: cls and mean)."""

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


POOLINGS = {"cls": cls_pooling, "mean": mean_pooling}  # what evaluation and fine-tuning offer (models/poolings.py)
CONTRASTIVE_POOLINGS = {**POOLINGS, "last": last_token_pooling}  # the contrastive method's, decoder LLMs' included
