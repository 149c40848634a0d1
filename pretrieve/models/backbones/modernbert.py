"""ModernBERT (Warner et al. 2024): pre-norm layers with a fused QKV projection, GeGLU feed-forward blocks,
rotary positions (RoPE), alternating local and global attention, a final norm, and an MLM head (dense, act,
norm) before the tied decoder.

In the auto-encoding heads' decoders:
- positions are rotary, so RetroMAE's query stream h + p_i (eq. 2) has no p_i to add: every query starts as h
  and RoPE rotates the decoder's queries by their position i and its keys by theirs, which gives each query
  row its position as p_i does in an absolute-position model;
- the decoder layer is ModernBERT's layer 0 (global attention, no norm before attention: its inputs are the
  embedding module's output and the encoder's final-normed [CLS] state, both normalised already), and the
  decoder ends with the family's final norm before the MLM head, as the encoder does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ModernBertConfig, ModernBertModel
from transformers.masking_utils import create_bidirectional_sliding_window_mask
from transformers.models.modernbert.modeling_modernbert import (
    ModernBertEncoderLayer,
    ModernBertPredictionHead,
    ModernBertRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pretrieve.models.backbones.base import Attend, Backbone
from pretrieve.models.backbones.bert import heads
from pretrieve.models.unpadding import padded_mask

GLOBAL = "full_attention"  # the layer type of ModernBERT's global-attention layers (layer 0 is one)
LOCAL = "sliding_attention"  # ... and of its local (sliding-window) ones


def layer_masks(model, attention_mask: torch.Tensor, ready: bool = False) -> dict:
    """{layer type: the padded batch's mask} for the global and the local layers (unpadding.padded_mask)."""
    return {GLOBAL: padded_mask(model, attention_mask, ready=ready),
            LOCAL: padded_mask(model, attention_mask, create_bidirectional_sliding_window_mask, ready=ready)}


class ModernBertDecoderLayer(ModernBertEncoderLayer):
    """ModernBERT's layer with queries from H1 and keys/values from H2, both rotated by their positions 0..L-1."""

    def __init__(self, config):
        super().__init__(config, layer_idx=0)
        self.rotary = ModernBertRotaryEmbedding(config)
        self.attention_dropout = config.attention_dropout

    def forward(self, h1: torch.Tensor, h2: torch.Tensor, attend: Attend) -> torch.Tensor:
        hidden, num_heads = h1.shape[-1], self.config.num_attention_heads
        weight, bias = self.attn.Wqkv.weight, self.attn.Wqkv.bias  # rows: W^Q, W^K, W^V
        q = F.linear(self.attn_norm(h1), weight[:hidden], None if bias is None else bias[:hidden])
        k, v = F.linear(self.attn_norm(h2), weight[hidden:], None if bias is None else bias[hidden:]).chunk(2, -1)
        q, k, v = (heads(x, num_heads) for x in (q, k, v))
        positions = torch.arange(h2.shape[1], device=h2.device)[None]
        cos, sin = self.rotary(h2, positions, GLOBAL)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        a = attend(q, k, v, self.attention_dropout if self.training else 0.0)
        x = h1 + self.attn.out_drop(self.attn.Wo(a.transpose(1, 2).reshape(h1.shape)))
        return x + self.mlp(self.mlp_norm(x))


class ModernBertBackbone(Backbone):
    name = model_type = "modernbert"
    display_name = "ModernBERT"
    model_class, config_class = ModernBertModel, ModernBertConfig
    default_pad_token_id = 50283
    # ModernBertForMaskedLM: head (dense, act, norm), then decoder (tied weight, own bias)
    hf_mlm_keys = {"head.": "mlm_transform.", "decoder.bias": "mlm_bias"}
    feed_forward_modules = ("mlp_norm", "mlp")
    ffn_matrices = 3  # GeGLU: W_i is h x 2f (input and gate), W_o f x h
    ffn_activations = 4  # W_i's output (input and gate: 2f), GELU(input), and its product with the gate (W_o's input)
    unpads = True

    @classmethod
    def config(cls, options, pad_token_id: int):
        return ModernBertConfig(
            vocab_size=options.vocab_size, hidden_size=options.hidden_size, num_hidden_layers=options.num_layers,
            num_attention_heads=options.num_heads, intermediate_size=options.intermediate_size,
            max_position_embeddings=options.max_position_embeddings, embedding_dropout=options.dropout,
            attention_dropout=options.dropout, mlp_dropout=options.dropout, pad_token_id=pad_token_id,
            # the defaults are ids of ModernBERT's own vocabulary; masking reads the tokenizer's, not these
            bos_token_id=None, eos_token_id=None, cls_token_id=None, sep_token_id=None)

    @staticmethod
    def forward(model, input_ids, attention_mask):
        """The padded batch under its global and local masks, built here on the device (unpadding.padded_mask)."""
        masks = layer_masks(model, attention_mask, ready=True)
        return model(input_ids=input_ids, attention_mask=masks).last_hidden_state

    @staticmethod
    def packed_forward(model, input_ids, packed, attention_mask):
        """ModernBERT's stack on one packed row, positions restarting at each text (RoPE). Attention runs by
        cu_seqlens on the varlen kernel where it can, else padded under the padded batch's global and local
        masks (given even without padding, as BERT's packed forward says)."""
        return model(input_ids=input_ids, attention_mask=layer_masks(model, attention_mask, ready=True),
                     position_ids=packed.position_ids, packed=packed).last_hidden_state

    @staticmethod
    def mlm_transform(config) -> nn.Module:
        return ModernBertPredictionHead(config)

    @classmethod
    def extend_positions(cls, model, positions: int) -> None:
        """Rotary positions have no table: the config's length is all there is to raise."""
        model.config.max_position_embeddings = max(positions, model.config.max_position_embeddings)

    @staticmethod
    def decoder_layer(config) -> nn.Module:
        return ModernBertDecoderLayer(config)

    @staticmethod
    def decoder_norm(config) -> nn.Module:
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    @staticmethod
    def init_new(model, module: nn.Module) -> None:
        """ModernBERT's own initialisation (truncated normals, output projections scaled by depth)."""
        for m in module.modules():
            model._init_weights(m)
