"""`seed`: SEED-Encoder (Lu et al. 2021), seed-encoder.txt §3.4, eqs. (9)-(10): MLM + a weak decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pretrieve.data.collators import SEEDCollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import DecoderLayer, masked_attention
from pretrieve.models.heads.registry import register_method


@dataclass
class SEEDOptions:
    max_len: int = 512
    mlm_ratio: float = 0.15  # §4.1: BERT-base setup, 15% masks, no NSP
    decoder_layers: int = 3  # §4.1: a three-layer Transformer decoder
    decoder_window: int = 2  # §4.1: attention span k = 2


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


class CausalDecoder(nn.Module):
    """Decoder layers over [h_cls, e_x1 + p_1, ...]; position t predicts token t + 1 with the tied MLM head.

    The encoder's [CLS] state enters as the decoder's first position, visible to every position in every
    layer: it is the decoder's only view of the encoder (its token inputs are the target text, shifted).
    """

    def __init__(self, encoder, layers: int, window: int | None):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(encoder.config) for _ in range(layers))
        self.window = window
        encoder.init_new(self.layers)

    def loss(self, encoder, h_cls: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             labels: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h_cls[:, None], encoder.embeddings(input_ids=input_ids)[:, 1:]], dim=1)
        attend = masked_attention(window_mask(attention_mask.sum(dim=1), input_ids.shape[1], self.window))
        for layer in self.layers:
            x = layer(x, x, attend)
        return encoder.token_loss(x, labels)


class SEEDHead(PretrainingHead):
    """L = L_MLM + L_dec^weak (eq. 10); L_dec^weak = -sum_t log P(x_t | x_{t-k:t-1}, h_0) (eq. 9) over the
    ordinary tokens of the unmasked text, from a `decoder_layers`-deep decoder whose attention is restricted
    to `decoder_window` tokens (`window_mask`)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.decoder = CausalDecoder(encoder, options.decoder_layers, options.decoder_window)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, batch["mlm_labels"])
        dec = self.decoder.loss(self.encoder, hidden[:, 0], batch["dec_input_ids"], batch["attention_mask"],
                                batch["dec_labels"])
        return {"loss": mlm + dec, "mlm": mlm.detach(), "dec": dec.detach()}


register_method("seed", SEEDHead, SEEDCollator, SEEDOptions)
