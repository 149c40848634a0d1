"""The decoder of the auto-encoding heads: layers of the encoder's own family, each with a query stream and a
key/value stream (models/backbones: `decoder_layer`), then the family's final norm.

RetroMAE's enhanced decoder (eqs. 2-3) runs one layer with two streams and the compact position-specific mask;
the causal decoders (SEED-Encoder, CoT-MAE) run their layers as plain self-attention (h1 = h2) with a dense mask.
"""

from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

# A BERT decoder layer's weights as checkpoints written before the backbone interface name them (their own
# layer class) -> as a BertLayer names them.
_OLD_BERT_LAYER_KEYS = {
    "query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
    "attention_output": "attention.output.dense", "attention_norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense", "output": "output.dense", "output_norm": "output.LayerNorm"}
_OLD_KEY = re.compile(r"(?:layers\.(\d+)\.)?(" + "|".join(_OLD_BERT_LAYER_KEYS) + r")\.(weight|bias)$")


class Decoder(nn.Module):
    """`num_layers` decoder layers of `encoder`'s backbone, initialised as the backbone initialises new modules."""

    def __init__(self, encoder, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(encoder.backbone.decoder_layer(encoder.config) for _ in range(num_layers))
        self.norm = encoder.backbone.decoder_norm(encoder.config)
        encoder.init_new(self)
        self.register_load_state_dict_pre_hook(_rename_old_keys)

    # rename_old_keys(state_dict, prefix): the load hook's renaming in place, also for a universal checkpoint's
    # per-parameter folders (engine/checkpoint.py)
    rename_old_keys = staticmethod(lambda state_dict, prefix: _rename_old_keys(None, state_dict, prefix))

    @property
    def attention_dropout(self) -> float:
        return self.layers[0].attention_dropout

    @attention_dropout.setter
    def attention_dropout(self, p: float) -> None:
        for layer in self.layers:
            layer.attention_dropout = p

    def forward(self, h1: torch.Tensor, h2: torch.Tensor | None, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """h2 None: self-attention (each layer's keys and values are its own input)."""
        for layer in self.layers:
            h1 = layer(h1, h1 if h2 is None else h2, attend)
        return self.norm(h1)


def _rename_old_keys(module, state_dict, prefix, *args) -> None:
    """RetroMAE's one layer was the decoder itself (`decoder.query.weight`), the causal decoders' layers were
    `decoder.layers.i.query.weight`; both become `decoder.layers.i.attention.self.query.weight`."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        match = _OLD_KEY.fullmatch(key[len(prefix):])
        if match:
            index, name, kind = match.groups()
            state_dict[f"{prefix}layers.{index or 0}.{_OLD_BERT_LAYER_KEYS[name]}.{kind}"] = state_dict.pop(key)


def masked_attention(visible: torch.Tensor) -> Callable[..., torch.Tensor]:
    """`attend` for a dense bool mask [B, L, L] (True = visible)."""
    return lambda q, k, v, dropout_p: F.scaled_dot_product_attention(q, k, v, attn_mask=visible.unsqueeze(1),
                                                                     dropout_p=dropout_p)
