"""`bow`: bag-of-words prediction, "Drop your Decoder" (Ma et al., SIGIR 2024, arXiv 2401.11248, §3).

No decoder: the [CLS] state of the masked input goes through the MLM head to vocabulary logits, and their softmax
predicts the input's bag of words. The paper's text was not available to this implementation: the loss follows
its abstract and the released code (caskcsg/ir `bowdpr`, src/bowdpr/pretrain), which docs/methods.md compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pretrieve.data.collators import MLMCollator, bag_of_words_targets
from pretrieve.data.masking import ordinary_positions
from pretrieve.models.bag_of_words import bag_of_words_loss
from pretrieve.models.flops import vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets


@dataclass
class BoWOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.30, above=0, at_most=1)  # the released recipe's --mlm_probability
    bow_weight: float = option(1.0, at_least=0)  # the released --dec_bow_loss_coef
    # the bag-of-words weight decays, cosine over train.max_steps, to this fraction of bow_weight (the released
    # recipe's --bow_factor_cosine_decay_to 0.1); 1: a constant weight
    bow_decay_to: float = option(0.1, at_least=0, at_most=1)


@dataclass
class BoWCollator(MLMCollator):
    """Bag-of-words prediction batches: MLM keys plus `bow_targets` [B, U], the unique ordinary token ids of
    each unmasked input, the tokenizer's special tokens ([UNK] ...) left out, padded with -100."""

    mlm_ratio: float = 0.30
    budget_counts_cls_sep: ClassVar[bool] = True  # bowdpr's max(1, round(p x n)) over [CLS] text [SEP]

    def extend(self, out, batch, words, num_words, rng):
        keep = ordinary_positions(batch.lengths, batch.ids.shape[1]) & ~self.vocab.special[batch.ids]
        out["bow_targets"] = bag_of_words_targets(batch, keep, self.static_shapes)


class BoWHead(PretrainingHead):
    """L = L_mlm + bow_weight x s(t) x L_bow.

    L_bow = -(1/|T|) sum_{x in T} log softmax(W h_CLS + b)[x], averaged over the batch's texts: T is the set of
    the unmasked input's ordinary tokens, special tokens left out; W h_CLS + b is the MLM head (transform, tied
    output weights, bias) at the masked input's [CLS] state, the same pass L_mlm reads. s(t) = d + (1 - d) x
    (1 + cos(pi t / max_steps)) / 2 with d = bow_decay_to, at optimizer step t (0-based), set by `set_step`.
    """

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.bow_scale = 1.0  # s(t): 1 until the training loop says which step it is

    def set_step(self, step: int, max_steps: int) -> None:
        self.bow_scale = cosine_decay(step, max_steps, self.options.bow_decay_to)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        logits = self.encoder.mlm_logits(hidden[:, 0])  # [B, vocab]: only the [CLS] row is projected
        bow = bag_of_words_loss(logits, batch["bow_targets"], batch["attention_mask"].sum(dim=1), "unique")
        loss = mlm + self.options.bow_weight * self.bow_scale * bow
        return {"loss": loss, "mlm": mlm.detach(), "bow": bow.detach()}


def cosine_decay(step: int, max_steps: int, final: float) -> float:
    """From 1 at step 0 down to `final` at `max_steps`, half a cosine; `final` after it."""
    progress = min(step / max(1, max_steps), 1.0)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def bow_flops(options: BoWOptions, config, batch) -> int:
    """The MLM head (transform and projection to the vocabulary) at each text's [CLS] state."""
    return vocab_flops(config, batch["input_ids"].shape[0])


register_method("bow", BoWHead, BoWCollator, BoWOptions, flops=bow_flops, eval_pooling="cls", study_arm=7)
