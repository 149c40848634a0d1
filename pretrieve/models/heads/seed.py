"""`seed`: SEED-Encoder (Lu et al. 2021), its paper's §3.4, eqs. (9)-(10): MLM + a weak decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from pretrieve.data.collators import MLMCollator, next_token_labels
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import CausalDecoder, causal_decoder_flops
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class SEEDOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # §4.1: BERT-base setup, 15% masks, no NSP
    decoder_layers: int = option(3, at_least=1)  # §4.1: a three-layer Transformer decoder
    decoder_window: int = option(2, at_least=1)  # §4.1: attention span k = 2


@dataclass
class SEEDCollator(MLMCollator):
    """SEED-Encoder batches: MLM keys plus `dec_input_ids` (the unmasked ids) and `dec_labels` (next ordinary
    token at each position; position 0 will hold the encoder's [CLS] state)."""

    token_losses: ClassVar[tuple[str, ...]] = ("mlm_labels", "dec_labels")

    def extend(self, out, batch, words, num_words, rng):
        out["dec_input_ids"] = torch.from_numpy(batch.ids)
        out["dec_labels"] = torch.from_numpy(next_token_labels(batch.ids, batch.lengths, batch.pad))


class SEEDHead(PretrainingHead):
    """L = L_MLM + L_dec^weak (eq. 10); L_dec^weak = -sum_t log P(x_t | x_{t-k:t-1}, h_0) (eq. 9) over the
    ordinary tokens of the unmasked text, from a `decoder_layers`-deep decoder whose attention is restricted
    to `decoder_window` tokens (`window_mask`)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.decoder = CausalDecoder(encoder, options.decoder_layers, options.decoder_window)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        dec = self.decoder.loss(self.encoder, hidden[:, 0], batch["dec_input_ids"], batch["attention_mask"],
                                token_targets(batch, "dec_labels"))
        return {"loss": mlm + dec, "mlm": mlm.detach(), "dec": dec.detach()}


def seed_flops(options: SEEDOptions, config, batch: dict[str, torch.Tensor]) -> int:
    return causal_decoder_flops(options.decoder_layers, config, batch["dec_input_ids"], batch["dec_labels"])


register_method("seed", SEEDHead, SEEDCollator, SEEDOptions, flops=seed_flops, eval_pooling="cls", study_arm=4)
