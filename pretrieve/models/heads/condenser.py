"""`condenser`: Condenser (Gao & Callan, EMNLP 2021, arXiv 2104.08253 §3.3-3.4, eqs. 6-11; restated in
coCondenser, arXiv 2108.05540 §3.1, eqs. 1-5).

The encoder's layers split into early and late ones: h^early after the first `skip_from` (eq. 6), h^late after
all of them (eq. 7). The Condenser head, `head_layers` layers of the encoder's family, reads the late [CLS] state
with the early token states, [h^cd_cls; h^cd] = Head([h^late_cls; h^early]) (eq. 8), and predicts the masked
tokens from its output through the encoder's MLM head (L_mlm, eq. 9). The backbone's own MLM loss on h^late
(L^c_mlm, eq. 10: §3.4's constraint for a head started from scratch on a warm-started backbone; the released
code's `late_mlm`) is added, L = L_mlm + L^c_mlm (eq. 11), so the late layers keep learning language while the
head pulls the text's information into the [CLS] state. Eqs. 9-10 sum cross-entropies over the masked tokens;
both terms here are token means, as the released code's cross-entropies (docs/methods.md). Only the encoder is
exported; the head is dropped for fine-tuning (its weights stay in pretrieve_head.safetensors for further
pre-training).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pretrieve.data.collators import MLMCollator
from pretrieve.models.flops import labelled, layer_flops, vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import Decoder, masked_attention
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class CondenserOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # the released collator's mlm_probability
    # the early layers whose token states the head reads (§4.1: 6 early and 6 late of BERT-base's 12; released:
    # --skip_from 6); None: half the encoder's layers
    skip_from: int | None = option(None, at_least=1)
    head_layers: int = option(2, at_least=1)  # §4.1's 2 head layers; released: --n_head_layers 2


def early_layer(options, encoder) -> int:
    """The layer after which the head reads the token states: `skip_from`, or half the encoder's layers."""
    layers = encoder.config.num_hidden_layers
    early = layers // 2 if options.skip_from is None else options.skip_from
    if not 1 <= early <= layers:
        raise ValueError(f"method.skip_from: {early} is not a layer of this {layers}-layer encoder "
                         f"(give 1..{layers}, or leave it out for half of them)")
    return early


class CondenserHead(PretrainingHead):
    """L = L_mlm + L^c_mlm (eq. 11): the Condenser head's MLM loss (eq. 9) on
    [h^cd_cls; h^cd] = Head([h^late_cls; h^early]) (eq. 8), plus the backbone's MLM loss on h^late (eq. 10); both
    are token means over the masked positions, as the released code's two cross-entropies (the paper's are
    sums)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.skip_from = early_layer(options, encoder)
        self.head = Decoder(encoder, num_layers=options.head_layers)

    def resolved_options(self):
        return replace(self.options, skip_from=self.skip_from)

    def condense(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^late [B, L, d], the head's output [B, L, d]): the early/late split and the head on one encoder pass."""
        late, early = self.encoder.forward_with_early(input_ids, attention_mask, self.skip_from)  # eqs. 6-7
        states = torch.cat([late[:, :1], early[:, 1:]], dim=1)  # [h^late_cls; h^early], eq. 8's input
        width = attention_mask.shape[1]
        visible = attention_mask.bool()[:, None, :].expand(-1, width, -1)  # padding hidden, as in the encoder
        return late, self.head(states, None, masked_attention(visible))  # eq. 8

    def forward(self, batch):
        late, condensed = self.condense(batch["input_ids"], batch["attention_mask"])
        head = self.encoder.token_loss(condensed, token_targets(batch, "mlm_labels"))  # L_mlm, eq. 9 (a token mean)
        mlm = self.encoder.token_loss(late, token_targets(batch, "mlm_labels"))  # L^c_mlm, eq. 10 (a token mean)
        return {"loss": head + mlm, "mlm": mlm.detach(), "head": head.detach()}  # L, eq. 11


def condenser_flops(options, config, batch: dict[str, torch.Tensor]) -> int:
    """The head's layers over the whole text and the MLM head at the masked positions (the encoder's own MLM
    head is counted with the encoder)."""
    b, length = batch["input_ids"].shape
    return (options.head_layers * layer_flops(config, b, length, length)
            + vocab_flops(config, labelled(batch["mlm_labels"])))


register_method("condenser", CondenserHead, MLMCollator, CondenserOptions, flops=condenser_flops,
                eval_pooling="cls", study_arm=8)
