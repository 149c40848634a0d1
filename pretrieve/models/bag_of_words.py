"""The bag-of-words loss: a vocabulary distribution scored against the set of a text's words (DupMAE's eq. 8,
bag-of-words prediction's loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bag_of_words_loss(mu: torch.Tensor, targets: torch.Tensor, lengths: torch.Tensor,
                      normalize: str = "length") -> torch.Tensor:
    """DupMAE's eq. (8) averaged over texts: -sum_{x in set(X)} w_x log softmax(mu_X)[x] for mu_X [B, vocab] (eq. 7);
    `targets` [B, U] = set(X) padded with -100; w_x = 1/(length - 2), the number of ordinary tokens
    ("length"), 1/|set(X)| ("unique": bag-of-words prediction's uniform target distribution), or 1 ("none")."""
    log_probs = F.log_softmax(mu.to(torch.promote_types(mu.dtype, torch.float32)), dim=-1)
    present = targets != -100
    picked = torch.gather(log_probs, 1, targets.clamp(min=0)) * present
    if normalize == "length":
        weight = 1.0 / (lengths - 2).clamp(min=1).to(picked.dtype)
    elif normalize == "unique":
        weight = 1.0 / present.sum(dim=1).clamp(min=1).to(picked.dtype)
    else:
        weight = 1.0
    per_text = -(picked.sum(dim=1) * weight)
    texts = present.any(dim=1)  # stream pad samples have no targets
    return per_text[texts].sum() / texts.sum().clamp(min=1)
