"""Decoder layers of the auto-encoding heads: a BERT layer with separate query and key/value streams.

RetroMAE's enhanced decoder (eqs. 2-3) uses it with two streams and the compact position-specific mask;
the causal decoders (SEED-Encoder, CoT-MAE) use it as plain self-attention (h1 = h2) with a dense mask.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig



class DecoderLayer(nn.Module):
    """A BERT layer whose queries come from the query stream H1 and keys/values from the context stream H2.

    Q = H1 W^Q, K = H2 W^K, V = H2 W^V; A = softmax(Q K^T / sqrt(d) + M) V (eq. 3); the attention output is
    added to H1 (residual) and goes through BERT's feed-forward block, as in the official decoder layer.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(hidden, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.attention_dropout = config.attention_probs_dropout_prob

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, hidden] -> [B, heads, L, d]
        batch, width, hidden = x.shape
        return x.view(batch, width, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, h1: torch.Tensor, h2: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`attend(q, k, v, dropout_p)` -> [B, heads, L, d] applies the layer's attention mask."""
        q, k, v = self._heads(self.query(h1)), self._heads(self.key(h2)), self._heads(self.value(h2))
        a = attend(q, k, v, self.attention_dropout if self.training else 0.0)
        a = a.transpose(1, 2).reshape(h1.shape)
        x = self.attention_norm(h1 + self.dropout(self.attention_output(a)))
        return self.output_norm(x + self.dropout(self.output(F.gelu(self.intermediate(x)))))


def masked_attention(visible: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`attend` for a dense bool mask [B, L, L] (True = visible)."""
    return lambda q, k, v, dropout_p: F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1),
                                                                     dropout_p=dropout_p)
