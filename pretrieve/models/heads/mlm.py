"""`mlm`: the BERT masked-language-model baseline (Devlin et al. 2019; whole-word masking, 80/10/10, 0.15)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.collators import MLMCollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import register_method


@dataclass
class MLMOptions:
    max_len: int = 512
    mlm_ratio: float = 0.15  # BERT


class MLMHead(PretrainingHead):
    """L_mlm: cross-entropy of the MLM head at the masked positions (`mlm_labels` != -100)."""

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        loss = self.encoder.token_loss(hidden, batch["mlm_labels"])
        return {"loss": loss, "mlm": loss.detach()}


register_method("mlm", MLMHead, MLMCollator, MLMOptions)
