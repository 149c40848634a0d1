"""`cotmae`: CoT-MAE (Wu et al. 2022) as summarised in cot-mote.txt §3.2, eqs. (10)-(12)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrieve.data.collators import CoTMAECollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.heads.seed import CausalDecoder, causal_decoder_flops


@dataclass
class CoTMAEOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.30, above=0, at_most=1)  # encoder masking (CoT-MAE: 30%)
    decoder_layers: int = option(1, at_least=1)  # §3.2: a single-layer shallow decoder
    # the decoder's target: a pseudo-query when the corpus has them, else a neighbour block
    context: str = option("auto", choices=("auto", "neighbour", "query"))


class CoTMAEHead(PretrainingHead):
    """L = L_mlm + L_dec. The masked anchor block goes through the encoder (eqs. 10-11, MLM at the masked
    positions); a causal decoder conditioned only on the encoder's [CLS] state reconstructs the contextual span,
    a pseudo-query or a neighbouring block of the same document, token by token (eq. 12, CLM over the span)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.decoder = CausalDecoder(encoder, options.decoder_layers, window=None)

    def forward(self, batch):
        # text_type only in CoT-MoTE batches: it picks each text's expert (cotmote.py)
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"], batch.get("text_type"))
        mlm = self.encoder.token_loss(hidden, batch["mlm_labels"])
        dec = self.decoder.loss(self.encoder, hidden[:, 0], batch["ctx_input_ids"], batch["ctx_attention_mask"],
                                batch["ctx_labels"])
        return {"loss": mlm + dec, "mlm": mlm.detach(), "dec": dec.detach()}


def cotmae_flops(options: CoTMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The causal decoder over the contextual span (its own width, not the anchor block's)."""
    return causal_decoder_flops(options.decoder_layers, config, batch["ctx_input_ids"], batch["ctx_labels"])


register_method("cotmae", CoTMAEHead, CoTMAECollator, CoTMAEOptions, flops=cotmae_flops)
