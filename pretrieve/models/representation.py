"""Text representations from encoder states, for fine-tuning and the evaluation farm.

`cls` and `mean` are the usual dense poolings. `JointRepresentation` is DupMAE's (RetroMAE-2 (ACL 2023)
§3.4, eqs. 10-12): the [CLS] state projected to d' dimensions plus the top-k entries of the max-pooled
OT vocabulary vector mu_X, scored against a query by eq. (12). Fine-tuning (eqs. 13-15 score with eq. 12)
learns W^cls and the encoder through `JointRepresentation.vectors`; `load_joint` reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pretrieve.models.dense_pooling import POOLINGS, cls_pooling, mean_pooling  # noqa: F401 (handed on)
from pretrieve.models.encoder import HEAD_WEIGHTS, finetune_meta, ordinary_positions, read_weights
from pretrieve.models.heads.dupmae import lpu_parts, ot_vector
from pretrieve.models.vocab_projection import max_pooled_linear


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
    products preserved in expectation), or the identity when d' equals the hidden size. W^O of eq. (6) is the
    encoder's MLM head, or with `lpu_vocab` (DupMAE's `lpu: linear`) a d x |V| map of this module's own.
    """

    def __init__(self, hidden_size: int, cls_dim: int = 384, ot_topk: int = 384, seed: int = 0,
                 lpu_vocab: int | None = None):
        super().__init__()
        self.cls_dim, self.ot_topk = cls_dim, ot_topk
        self.lpu = nn.Linear(hidden_size, lpu_vocab) if lpu_vocab else None
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

    def vectors(self, encoder, hidden: torch.Tensor, attention_mask: torch.Tensor, documents: bool) -> torch.Tensor:
        """[N, d' + vocab] vectors whose inner products are eq. (12): [h^_X ; mu_X] for queries; for documents
        mu_X is kept at I_X (eq. 11) and 0 elsewhere. mu_X is max-pooled vocabulary chunk by chunk
        (max_pooled_linear: no [N, L, vocab] logits); gradients reach W^cls, W^O and, through each entry's
        winning position, the encoder."""
        dense = self.cls_proj(hidden[:, 0])
        ordinary = ordinary_positions(attention_mask.sum(dim=1), hidden.shape[1])
        mu = max_pooled_linear(*lpu_parts(encoder, self.lpu, hidden), ordinary)
        if documents:
            mu = keep_top_k(mu, self.ot_topk)
        return torch.cat([dense, mu.to(dense.dtype)], dim=-1)


def keep_top_k(vectors: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest entries, 0 elsewhere (eq. 11's I_X); differentiable in the kept values."""
    if k >= vectors.shape[1]:
        return vectors
    values, indices = vectors.topk(k, dim=-1)
    return torch.zeros_like(vectors).scatter(1, indices, values)


def load_joint(path: str | Path, encoder, cls_dim: int | None = None,
               ot_topk: int | None = None) -> JointRepresentation:
    """The joint representation of a model directory: a model fine-tuned with pooling dupmae (its learned
    W^cls and W^O, its k unless `ot_topk` is given), or a DupMAE pre-training export (its LPU; W^cls the
    default map to `cls_dim` = 384 or the hidden size if smaller; k = `ot_topk` or 384)."""
    from pretrieve.models.export import export_meta

    path = Path(path)
    config = encoder.config
    tuned = finetune_meta(path)
    if tuned.get("pooling") == "dupmae":
        spec = tuned["joint"]
        if cls_dim is not None and cls_dim != spec["cls_dim"]:
            raise ValueError(f"{path}: fine-tuned with cls_dim {spec['cls_dim']}, asked for {cls_dim}")
        cls_dim, lpu, prefix = spec["cls_dim"], spec["lpu"], "joint."
        ot_topk = ot_topk or spec["ot_topk"]
    else:
        head = export_meta(path) if not tuned else {}
        if head.get("method") != "dupmae":
            kind = f"fine-tuned with pooling {tuned.get('pooling')}" if tuned else head.get("method", "not an export")
            raise ValueError(f"{path}: pooling dupmae needs a DupMAE export or a model fine-tuned with pooling "
                             f"dupmae (this one: {kind})")
        cls_dim, lpu, prefix = cls_dim or min(384, config.hidden_size), head["options"].get("lpu"), ""
    joint = JointRepresentation(config.hidden_size, cls_dim, ot_topk or 384,
                                lpu_vocab=config.vocab_size if lpu == "linear" else None)
    # a pre-training export has the LPU only (W^cls is not trained there); a fine-tuned one has both
    wanted = [k for k in joint.state_dict() if prefix or k.startswith("lpu.")]
    state = read_weights(path, HEAD_WEIGHTS, prefixes=tuple(prefix + k for k in wanted))
    missing = [prefix + k for k in wanted if prefix + k not in state]
    if missing:
        raise ValueError(f"{path / HEAD_WEIGHTS}: {missing[0]} missing")
    joint.load_state_dict({k: state[prefix + k] for k in wanted}, strict=False)
    return joint.to(encoder.embeddings.word_embeddings.weight.device)


def joint_scores(queries: JointVectors, docs: JointVectors) -> torch.Tensor:
    """[Q, D] scores of eq. (12): h^_q . h^_d + sum over i in I_d of mu_q[i] * mu_d[i]."""
    dense = queries.dense @ docs.dense.T
    mu_q_at_docs = queries.ot_full[:, docs.ot_indices]  # [Q, D, k]
    return dense + (mu_q_at_docs * docs.ot_values.unsqueeze(0)).sum(dim=-1)


def splade_vectors(encoder, hidden: torch.Tensor, attention_mask: torch.Tensor, special_tokens: bool) -> torch.Tensor:
    """[B, vocab] SPLADE-style vectors (the CoT-MoTE paper eq. 4) of token states [B, L, hidden] through the encoder's
    MLM head (an untied LM head's own weights where it has one): max over the text's tokens of log(1 + relu(logits)),
    the max taken vocabulary chunk by chunk (max_pooled_linear: no [B, L, vocab] logits; log(1 + relu) is
    monotone, so it commutes with the max), differentiable through each entry's winning position.

    The tokens are those between [CLS] and [SEP], as LexMAE's released fine-tuning pools them
    (`keep_special_tokens` off); `special_tokens` takes every real position, [CLS] and [SEP] too (SPLADE's)."""
    positions = attention_mask.bool()
    if not special_tokens:
        positions = ordinary_positions(attention_mask.sum(dim=1), hidden.shape[1])
    pooled = max_pooled_linear(encoder.mlm_transform(hidden), encoder.output_weight, encoder.mlm_bias, positions)
    return torch.log1p(torch.relu(pooled))


def sparse_special_tokens(model_dir: str | Path) -> bool:
    """Whether a model's `sparse` vectors pool [CLS] and [SEP] too: as its fine-tuning records it
    (pretrieve_finetune.json's `sparse_special_tokens`; a sparse fine-tuning that predates the key pooled them),
    else not (LexMAE's released fine-tuning)."""
    tuned = finetune_meta(model_dir)
    return bool(tuned.get("sparse_special_tokens", tuned.get("pooling") == "sparse"))


def flops_regularizer(vectors: torch.Tensor) -> torch.Tensor:
    """Paria et al. 2020's FLOPS loss of a batch of non-negative sparse vectors [N, vocab]: sum over the vocabulary
    of the squared mean weight, a smooth stand-in for the expected number of multiplications an inverted index
    makes per query-document pair (SPLADE's regulariser; LexMAE fine-tunes with it)."""
    return vectors.float().mean(dim=0).square().sum()


def sparse_representation(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """SPLADE-style [B, vocab] vector (the CoT-MoTE paper eq. 4): max over the sequence's tokens of log(1 + relu(logits)),
    `logits` [B, L, vocab] from the MLM head; padding contributes nothing (the terms are >= 0)."""
    weights = torch.log1p(torch.relu(logits.float())) * attention_mask[..., None].to(torch.float32)
    return weights.amax(dim=1)


def hybrid_scores(dense_q: torch.Tensor, dense_d: torch.Tensor, sparse_q: torch.Tensor, sparse_d: torch.Tensor,
                  sparse_weight: float = 1.0) -> torch.Tensor:
    """[Q, D] dense + sparse inner products, CoT-MoTE's hybrid similarity (§3.3, eq. 13's s(q, p))."""
    return dense_q @ dense_d.T + sparse_weight * (sparse_q @ sparse_d.T)
