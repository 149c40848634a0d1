"""`dupmae`: DupMAE / RetroMAE-2 (Liu et al. 2023), its paper's §3.3, eqs. (6)-(9)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pretrieve.data import masking
from pretrieve.data.collators import bag_of_words_targets
from pretrieve.models.bag_of_words import bag_of_words_loss
from pretrieve.models.encoder import ordinary_positions
from pretrieve.models.flops import vocab_flops, vocab_projection_flops
from pretrieve.models.heads.registry import option, register_method
from pretrieve.models.heads.retromae import (
    QUERY_STREAM_CHOICES,
    RetroMAECollator,
    RetroMAEHead,
    RetroMAEOptions,
    retromae_flops,
)
from pretrieve.models.vocab_projection import max_pooled_linear
from pretrieve.models.token_targets import token_targets

LPU_CHOICES = ("mlm_head", "linear")
OT_POSITION_CHOICES = ("unmasked", "all")
BOW_NORMALIZE_CHOICES = ("length", "none")


@dataclass
class DupMAEOptions(RetroMAEOptions):
    bow_weight: float = option(1.0, at_least=0)  # eq. (9) adds the three losses with weight 1
    # W^O of eq. (6): the tied MLM head (official code) or a separate linear d x |V|
    lpu: str = option("mlm_head", choices=LPU_CHOICES)
    # "unmasked": ordinary tokens, masked ones excluded (paper §3.3); "all": every token after [CLS], masked ones
    # and the final [SEP] included (official code)
    ot_positions: str = option("unmasked", choices=OT_POSITION_CHOICES)
    # "length": each unique token weighs 1/len(X) (official); "none": eq. (8) sum
    bow_normalize: str = option("length", choices=BOW_NORMALIZE_CHOICES)
    # H1 through the embedding module, as the official DupMAE code
    query_stream: str = option("embeddings", choices=QUERY_STREAM_CHOICES)


@dataclass
class DupMAECollator(RetroMAECollator):
    """DupMAE batches: RetroMAE keys plus `bow_targets` [B, U], the unique ordinary token ids of each input
    (set(X) of eq. 8), padded with -100."""

    def extend(self, out, batch, words, num_words, rng):
        super().extend(out, batch, words, num_words, rng)
        out["bow_targets"] = bag_of_words_targets(batch, masking.ordinary_positions(batch.lengths, batch.ids.shape[1]),
                                                  self.static_shapes)


class DupMAEHead(RetroMAEHead):
    """L = L_mlm + L_dec + bow_weight * L_BoW (eq. 9).

    [CLS] decoding is RetroMAE's (eqs. 1-5). OT decoding: the ordinary-token states of the masked input go
    through the linear projection unit to the vocabulary, mu_xi = h_xi^T W^O (eq. 6), are max-pooled per
    vocabulary entry, mu_X = token.Max({mu_xi}) (eq. 7), and L_BoW = -sum_{x in set(X)} w_x log softmax(mu_X)[x]
    (eq. 8) with w_x = 1 (paper) or 1/len(X) (official), averaged over the batch's texts.
    """

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        if options.lpu == "linear":
            self.lpu = nn.Linear(encoder.config.hidden_size, encoder.config.vocab_size)
            encoder.init_new(self.lpu)

    def lpu_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """mu_xi of eq. (6) for hidden states [..., hidden] -> [..., vocab]."""
        return F.linear(*self.lpu_parts(hidden))

    def lpu_parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input, weight, bias) of the LPU's final linear map: lpu_logits = F.linear(*lpu_parts)."""
        return lpu_parts(self.encoder, self.lpu if self.options.lpu == "linear" else None, hidden)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        dec = self.decoder_loss(hidden[:, 0], batch)
        bow = self.bow_loss(hidden, batch)
        loss = mlm + dec + self.options.bow_weight * bow
        return {"loss": loss, "mlm": mlm.detach(), "dec": dec.detach(), "bow": bow.detach()}

    def bow_loss(self, hidden: torch.Tensor, batch: dict) -> torch.Tensor:
        lengths = batch["attention_mask"].sum(dim=1)
        if self.options.ot_positions == "unmasked":
            ot_mask = ordinary_positions(lengths, hidden.shape[1]) & (batch["mlm_labels"] == -100)
        else:  # the official code pools the logits of positions 1 .. length-1
            positions = torch.arange(hidden.shape[1], device=lengths.device)
            ot_mask = (positions >= 1) & (positions < lengths[:, None])
        mu = max_pooled_linear(*self.lpu_parts(hidden), ot_mask)  # eq. (7), without [B, L, vocab] logits
        return bag_of_words_loss(mu, batch["bow_targets"], lengths, self.options.bow_normalize)


def lpu_parts(encoder, lpu: nn.Linear | None, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input, weight, bias) of W^O in eq. (6): a separate linear map `lpu`, or else the encoder's tied MLM head."""
    if lpu is not None:
        return hidden, lpu.weight, lpu.bias
    return encoder.mlm_transform(hidden), encoder.output_weight, encoder.mlm_bias


def ot_vector(logits: torch.Tensor, ot_mask: torch.Tensor) -> torch.Tensor:
    """mu_X [B, vocab] of eq. (7): token-wise max of the LPU logits [B, L, vocab] over `ot_mask` (none: 0)."""
    with torch.no_grad():  # pick the winning position per entry, then gather: a far cheaper backward than amax's
        winner = logits.masked_fill(~ot_mask[..., None], float("-inf")).argmax(dim=1, keepdim=True)
    pooled = torch.gather(logits, 1, winner).squeeze(1)
    pooled = pooled.to(torch.promote_types(pooled.dtype, torch.float32))  # softmax over |V| in fp32 at least
    return torch.where(ot_mask.any(dim=1, keepdim=True), pooled, torch.zeros_like(pooled))


def dupmae_flops(options: DupMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """RetroMAE's decoder, plus the OT projection of every position to the vocabulary (eq. 6): the MLM head's
    transform and decoder for `lpu: mlm_head`, a d x |V| linear map for `lpu: linear`."""
    positions = batch["input_ids"].numel()
    ot = vocab_flops(config, positions) if options.lpu == "mlm_head" else vocab_projection_flops(config, positions)
    return retromae_flops(options, config, batch) + ot


def dupmae_no_backward_flops(options: DupMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The OT projection to the vocabulary: its backward is a gather of each entry's winning position
    (models.vocab_projection), no matmul."""
    return vocab_projection_flops(config, batch["input_ids"].numel())


register_method("dupmae", DupMAEHead, DupMAECollator, DupMAEOptions, flops=dupmae_flops,
                no_backward_flops=dupmae_no_backward_flops, eval_pooling="dupmae", study_arm=3)  # eq. 12's joint one
