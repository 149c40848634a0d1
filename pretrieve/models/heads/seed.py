"""`seed`: SEED-Encoder (Lu et al. 2021), its paper's §3.4, eqs. (9)-(10): MLM + a weak decoder."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrieve.data.collators import SEEDCollator
from pretrieve.models.flops import labelled, layer_flops, vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import Decoder, masked_attention
from pretrieve.models.heads.registry import MethodOptions, option, register_method


@dataclass
class SEEDOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # §4.1: BERT-base setup, 15% masks, no NSP
    decoder_layers: int = option(3, at_least=1)  # §4.1: a three-layer Transformer decoder
    decoder_window: int = option(2, at_least=1)  # §4.1: attention span k = 2


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


def causal_decoder_flops(layers: int, config, input_ids: torch.Tensor, labels: torch.Tensor) -> int:
    """`layers` decoder layers over the decoder's text `input_ids` (dense masks: every score is computed) and
    the MLM head at its targets."""
    b, width = input_ids.shape
    return layers * layer_flops(config, b, width, width) + vocab_flops(config, labelled(labels))


def seed_flops(options: SEEDOptions, config, batch: dict[str, torch.Tensor]) -> int:
    return causal_decoder_flops(options.decoder_layers, config, batch["dec_input_ids"], batch["dec_labels"])


register_method("seed", SEEDHead, SEEDCollator, SEEDOptions, flops=seed_flops)
