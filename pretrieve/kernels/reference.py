"""Executable definition of the compact decoder mask and the attention that consumes it (docs/design.md
"Compact decoder mask"; RetroMAE eqs. 3 and 5). Fused kernels are tested against these functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpack_pool(dec_pool: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, P, L] from the bit-packed uint8 [B, P, ceil(L / 8)] pool (little-endian bit order)."""
    shifts = torch.arange(8, device=dec_pool.device, dtype=torch.uint8)
    bits = (dec_pool.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :width].bool()


def decoder_visibility(dec_pool: torch.Tensor, dec_row: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """bool [B, L, L]: visible(i, j) = pool[row(i), j] and j != i and j < length."""
    batch, width = dec_row.shape
    pool = unpack_pool(dec_pool, width)
    rows = dec_row.long().unsqueeze(-1).expand(batch, width, width)
    visible = torch.gather(pool, 1, rows)
    visible &= ~torch.eye(width, dtype=torch.bool, device=visible.device)
    visible &= torch.arange(width, device=visible.device) < lengths[:, None, None]
    return visible


def expand_decoder_mask(batch: dict) -> torch.Tensor:
    """bool [B, L, L] decoder mask of a collated batch (keys dec_pool, dec_row, attention_mask); True = visible."""
    return decoder_visibility(batch["dec_pool"], batch["dec_row"], batch["attention_mask"].sum(dim=1))


def two_stream_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dec_pool: torch.Tensor,
                         dec_row: torch.Tensor, lengths: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) + M) V of eq. (3) with M from the compact mask; q, k, v: [B, heads, L, d].

    Materialises the [B, L, L] mask (what the fused kernel avoids). Every row sees at least one key: position 0
    for rows i > 0, the final [SEP] for row 0 (pool rows never hide special tokens).
    """
    visible = decoder_visibility(dec_pool, dec_row, lengths)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible.unsqueeze(1), dropout_p=dropout_p)


def eager_two_stream_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dec_pool: torch.Tensor,
                               dec_row: torch.Tensor, lengths: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Eq. (3) spelled out: scores, an additive 0 / -inf mask, softmax, dropout, weighted values."""
    visible = decoder_visibility(dec_pool, dec_row, lengths).unsqueeze(1)
    scores = query @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(query.dtype), p=dropout_p, training=dropout_p > 0)
    return probs @ value
