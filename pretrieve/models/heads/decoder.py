"""The decoders of the auto-encoding heads: layers of the encoder's own family, each with a query stream and a
key/value stream (models/backbones: `decoder_layer`), then the family's final norm.

RetroMAE's enhanced decoder (eqs. 2-3) runs one layer with two streams and the compact position-specific mask;
the causal decoder (SEED-Encoder, CoT-MAE's CLM summary) runs its layers as plain self-attention (h1 = h2) with a
dense mask; the bottleneck decoders (SimLM, LexMAE) share their options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pretrieve.models.flops import labelled, layer_flops, vocab_flops
from pretrieve.models.heads.registry import MethodOptions, option

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


def window_mask(lengths: torch.Tensor, width: int, window: int | None) -> torch.Tensor:
    """bool [B, L, L] of a causal decoder whose position 0 holds the encoder's [CLS] state.

    visible(i, j) = j < length and (j == 0 or i - window < j <= i): each position sees itself and the
    window - 1 tokens before it (x_{t-k..t-1} of eq. 9 when position t-1 predicts x_t), plus the [CLS] state;
    window None = the full causal prefix (CoT-MAE). Every layer applies it, as the official SEED code does, so
    L layers reach x_{t-L(k-1)-1..t-1}.
    """
    i = torch.arange(width, device=lengths.device)[:, None]
    j = torch.arange(width, device=lengths.device)[None, :]
    allowed = j <= i if window is None else (j <= i) & (j > i - window)
    allowed = allowed | (j == 0)
    return allowed[None] & (j[None] < lengths[:, None, None])


class CausalDecoder(Decoder):
    """Decoder layers over [h_cls, e_x1 + p_1, ...]; position t predicts token t + 1 with the tied MLM head.

    The encoder's [CLS] state enters as the decoder's first position, visible to every position in every
    layer: it is the decoder's only view of the encoder (its token inputs are the target text, shifted).
    """

    def __init__(self, encoder, layers: int, window: int | None):
        super().__init__(encoder, layers)
        self.window = window

    def loss(self, encoder, h_cls: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h_cls[:, None], encoder.embeddings(input_ids=input_ids)[:, 1:]], dim=1)
        attend = masked_attention(window_mask(attention_mask.sum(dim=1), input_ids.shape[1], self.window))
        return encoder.token_loss(self(x, None, attend), labels)


def causal_decoder_flops(layers: int, config, input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """`layers` decoder layers over the decoder's text `input_ids` (dense masks: every score is computed) and
    the MLM head at its targets."""
    b, width = input_ids.shape
    return layers * layer_flops(config, b, width, width) + vocab_flops(config, labelled(labels))


@dataclass
class BottleneckDecoderOptions(MethodOptions):
    """A shallow decoder reconstructing a more heavily masked copy of the text from one vector (SimLM, LexMAE: the
    two released recipes agree on these defaults)."""

    max_len: int = option(144, at_least=3, why="[CLS], a token, [SEP]")  # released: --rlm_max_length 144
    mlm_ratio: float = option(0.30, above=0, below=1)  # the encoder's masking: --rlm_encoder_mask_prob 0.3
    decoder_mask_ratio: float = option(0.50, at_least=0, at_most=1)  # the decoder's: --rlm_decoder_mask_prob 0.5
    decoder_layers: int = option(2, at_least=1)  # released: --rlm_decoder_layers 2
