"""`mlm`: the BERT masked-language-model baseline (Devlin et al. 2019; whole-word masking, 80/10/10, 0.15)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrieve.data.collators import MLMCollator
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, no_flops, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class MLMOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # BERT


class MLMHead(PretrainingHead):
    """L_mlm: cross-entropy of the MLM head at the masked positions (`mlm_labels` != -100)."""

    decoder_llms = "bidirectional"  # a masked token is predicted from both sides

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        loss = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        return {"loss": loss, "mlm": loss.detach()}


register_method("mlm", MLMHead, MLMCollator, MLMOptions, flops=no_flops,  # the encoder alone
                study_arm=1)  # no representation of its own: evaluated with the base's pooling
