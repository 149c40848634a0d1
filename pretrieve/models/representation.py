"""Text representations from encoder states, for fine-tuning and the evaluation farm.

`cls` and `mean` are the usual dense poolings. `JointRepresentation` is DupMAE's (dupmae-retromae-2-acl2023.txt
§3.4, eqs. 10-12): the [CLS] state projected to d' dimensions plus the top-k entries of the max-pooled
OT vocabulary vector mu_X, scored against a query by eq. (12).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pretrieve.models.encoder import ordinary_positions
from pretrieve.models.heads.dupmae import ot_vector


def cls_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def mean_pooling(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


POOLINGS = {"cls": cls_pooling, "mean": mean_pooling}


@dataclass
class JointVectors:
    """One text's joint representation [h^_X ; mu^_X] (eqs. 10-11), plus the full mu_X a query needs (eq. 12)."""

    dense: torch.Tensor  # [N, d'] h^_X = h_X^T W^cls
    ot_values: torch.Tensor  # [N, k] mu_X at I_X
    ot_indices: torch.Tensor  # [N, k] I_X = indices of top-k(mu_X)
    ot_full: torch.Tensor  # [N, vocab] mu_X


class JointRepresentation(nn.Module):
    """DupMAE's joint representation; defaults CLS:384 + OT:384, Table 4's variant is cls_dim=384, ot_topk=260.

    W^cls (eq. 10) is learned in fine-tuning. Before that it is a random orthogonal projection (inner
    products preserved in expectation), or the identity when d' equals the hidden size.
    """

    def __init__(self, hidden_size: int, cls_dim: int = 384, ot_topk: int = 384, seed: int = 0):
        super().__init__()
        self.cls_dim, self.ot_topk = cls_dim, ot_topk
        self.cls_proj = nn.Linear(hidden_size, cls_dim, bias=False)
        with torch.no_grad():
            if cls_dim == hidden_size:
                self.cls_proj.weight.copy_(torch.eye(hidden_size))
            else:
                generator = torch.Generator().manual_seed(seed)
                q, _ = torch.linalg.qr(torch.randn(max(hidden_size, cls_dim), min(hidden_size, cls_dim),
                                                   generator=generator))
                self.cls_proj.weight.copy_(q if cls_dim > hidden_size else q.T)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, lpu) -> JointVectors:
        """`lpu` maps hidden states [..., d] to vocabulary logits (DupMAEHead.lpu_logits), eq. (6)."""
        dense = self.cls_proj(hidden[:, 0])
        ordinary = ordinary_positions(attention_mask.sum(dim=1), hidden.shape[1])
        mu = ot_vector(lpu(hidden), ordinary)  # eq. (7) over every ordinary token (nothing masked at inference)
        values, indices = mu.topk(self.ot_topk, dim=-1)  # eq. (11)
        return JointVectors(dense, values, indices, mu)


def joint_scores(queries: JointVectors, docs: JointVectors) -> torch.Tensor:
    """[Q, D] scores of eq. (12): h^_q . h^_d + sum over i in I_d of mu_q[i] * mu_d[i]."""
    dense = queries.dense @ docs.dense.T
    mu_q_at_docs = queries.ot_full[:, docs.ot_indices]  # [Q, D, k]
    return dense + (mu_q_at_docs * docs.ot_values.unsqueeze(0)).sum(dim=-1)


def sparse_representation(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """SPLADE-style [B, vocab] vector (cot-mote.txt eq. 4): max over the sequence's tokens of log(1 + relu(logits)),
    `logits` [B, L, vocab] from the MLM head; padding contributes nothing (the terms are >= 0)."""
    weights = torch.log1p(torch.relu(logits.float())) * attention_mask[..., None].to(torch.float32)
    return weights.amax(dim=1)


def hybrid_scores(dense_q: torch.Tensor, dense_d: torch.Tensor, sparse_q: torch.Tensor, sparse_d: torch.Tensor,
                  sparse_weight: float = 1.0) -> torch.Tensor:
    """[Q, D] dense + sparse inner products, CoT-MoTE's hybrid similarity (§3.3, eq. 13's s(q, p))."""
    return dense_q @ dense_d.T + sparse_weight * (sparse_q @ sparse_d.T)
