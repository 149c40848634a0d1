"""`cotmae`: CoT-MAE (Wu et al. 2022) as summarised in cot-mote.txt §3.2, eqs. (10)-(12)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.collators import CoTMAECollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import register_method
from pretrieve.models.heads.seed import CausalDecoder


@dataclass
class CoTMAEOptions:
    max_len: int = 512
    mlm_ratio: float = 0.30  # encoder masking (CoT-MAE: 30%)
    decoder_layers: int = 1  # §3.2: a single-layer shallow decoder
    context: str = "auto"  # the decoder's target: a pseudo-query when the corpus has them, else a neighbour block

    def __post_init__(self):
        if self.context not in ("auto", "neighbour", "query"):
            raise ValueError(f"method.context: {self.context!r} is not one of auto, neighbour, query")


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


register_method("cotmae", CoTMAEHead, CoTMAECollator, CoTMAEOptions)
