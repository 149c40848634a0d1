"""`lexmae`: LexMAE, the lexicon-bottlenecked masked autoencoder (Shen et al., ICLR 2023, openreview.net SHD0Dc1M5r).
The paper's method section was not available to this implementation (its abstract and introduction were): no
equation numbers are cited; the loss follows the released code (taoshen58/LexMAE `peach/models/modeling_lexmae.py`,
`script_lexmae.py` and the README's pre-training command), which docs/methods.md compares.

The encoder reads its masked text and predicts the masked tokens (MLM). Its MLM logits, max-pooled over the
text's tokens, become a lexicon-importance distribution over the vocabulary; the distribution's expectation of
the word embeddings, a continuous bag of words, is the only thing a shallow decoder learns of the text beyond its
own more heavily masked copy, which it reconstructs. The encoder is thus taught lexicon weights that say what a
text is about, for learned sparse retrieval (its export is scored so by `pretrieve eval --pooling sparse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from pretrieve.data.collators import MLMCollator, covering_mask
from pretrieve.data.masking import corrupt
from pretrieve.models.encoder import masked_token_loss, ordinary_positions
from pretrieve.models.flops import labelled, layer_flops, vocab_flops, vocab_projection_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import BottleneckDecoderOptions, Decoder, masked_attention
from pretrieve.models.heads.registry import option, register_method
from pretrieve.models.token_targets import token_targets
from pretrieve.models.vocab_projection import max_pooled_linear

# how the pooled logits become the lexicon-importance distribution (the released --dec_mlm_bottleneck_src):
# "softmax" (its default `logits`) or "saturated" (`logits_sat`: SPLADE's log(1 + relu), normalised to sum 1)
IMPORTANCES = ("softmax", "saturated")


@dataclass
class LexMAEOptions(BottleneckDecoderOptions):
    # max_len 144, mlm_ratio 0.30, decoder_mask_ratio 0.50, decoder_layers 2: LexMAE's released --max_length,
    # --data_mlm_prob, --dec_mlm_prob and --n_head_layers as well
    importance: str = option("softmax", choices=IMPORTANCES)
    enc_weight: float = option(1.0, at_least=0)  # released: --mlm_enc_loss_weight 1.0
    dec_weight: float = option(1.0, at_least=0)  # released: --mlm_dec_loss_weight 1.0

    def __post_init__(self):
        super().__post_init__()
        # the decoder's mask covers the encoder's (the released --dec_mlm_overlap inclusive, which asserts
        # dec_mlm_prob >= the encoder's): below it, the collator would mask at the encoder's ratio, not this one
        if self.decoder_mask_ratio < self.mlm_ratio:
            raise ValueError(f"method.decoder_mask_ratio: {self.decoder_mask_ratio} is below method.mlm_ratio "
                             f"{self.mlm_ratio}, but the decoder's mask covers the encoder's, so it would mask "
                             f"{self.mlm_ratio}: give a decoder_mask_ratio of {self.mlm_ratio} or more")


@dataclass
class LexMAECollator(MLMCollator):
    """LexMAE batches: MLM keys (80/10/10 at `mlm_ratio`) plus the decoder's `dec_input_ids` (the text corrupted
    80/10/10 again, drawn anew, at the decoder's masked positions) and `dec_labels` (the original token there,
    -100 elsewhere). The decoder's mask holds the encoder's and adds whole words to cover `decoder_mask_ratio` of
    the tokens in expectation (the released code's `dec_mlm_overlap: inclusive`), as SimLM's collator does."""

    mlm_ratio: float = 0.30
    decoder_mask_ratio: float = 0.50
    token_losses: ClassVar[tuple[str, ...]] = ("mlm_labels", "dec_labels")

    def extend(self, out, batch, words, num_words, rng):
        dec_masked = covering_mask(out, batch, words, num_words, self.budget_tokens(batch), self.mlm_ratio,
                                   self.decoder_mask_ratio, rng)
        dec_input_ids, dec_labels = corrupt(batch.ids, dec_masked, self.vocab, rng, *self.corruption)
        out["dec_input_ids"] = torch.from_numpy(dec_input_ids)
        out["dec_labels"] = torch.from_numpy(dec_labels)


class LexMAEHead(PretrainingHead):
    """L = enc_weight x L_enc + dec_weight x L_dec, as the released `LexmaeLearner`.

    L_enc: the encoder's MLM loss at its masked positions (token mean over the batch).
    Lexicon bottleneck: s = max_{i in T} (W t(h_i) + b) [B, V] over the text's tokens T (no [CLS], [SEP] or
    padding; masked positions included), from the encoder's MLM head (transform t, tied output weights W, bias
    b); the importance p = softmax(s) (or, `importance: saturated`, log(1 + relu(s)) / (sum + 1e-4)); the
    bottleneck b = p E with E the word embeddings, taking no gradient through E (the released `.detach()`).
    L_dec: `decoder_layers` new layers of the encoder's family with full self-attention over the text (padding
    hidden), reading [b; e(x^dec_1..n)] (the bottleneck in place of the decoder text's [CLS] embedding), then
    the decoder's own MLM head (its own transform and bias, the encoder's output weights); its MLM loss at the
    decoder's masked positions, which cover the encoder's (token mean over the batch).
    """

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.decoder = Decoder(encoder, num_layers=options.decoder_layers)
        # the decoder's MLM head: the released BertForEDMLM's decoder_cls, its output weights tied to the encoder's
        self.decoder_mlm_transform = encoder.backbone.mlm_transform(encoder.config)
        encoder.init_new(self.decoder_mlm_transform)
        bias = torch.zeros(encoder.config.vocab_size) if encoder.backbone.mlm_bias else None
        self.decoder_mlm_bias = None if bias is None else nn.Parameter(bias)

    def forward(self, batch):
        attention_mask = batch["attention_mask"]
        hidden = self.encoder(batch["input_ids"], attention_mask)
        enc = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        importance = self.lexicon_importance(hidden, attention_mask)
        bottleneck = importance.to(hidden.dtype) @ self.encoder.word_embeddings.weight.detach()  # [B, hidden]
        states = torch.cat([bottleneck[:, None], self.encoder.embeddings(input_ids=batch["dec_input_ids"])[:, 1:]],
                           dim=1)
        width = attention_mask.shape[1]
        visible = attention_mask.bool()[:, None, :].expand(-1, width, -1)  # padding hidden, as in the encoder
        dec = self.decoder_loss(self.decoder(states, None, masked_attention(visible)),
                                token_targets(batch, "dec_labels"))
        loss = self.options.enc_weight * enc + self.options.dec_weight * dec
        # the distribution's entropy (nats): low when a few words carry the text, log V when uniform
        entropy = -(importance * torch.log(importance.clamp(min=1e-30))).sum(dim=-1).mean()
        return {"loss": loss, "enc": enc.detach(), "dec": dec.detach(), "entropy": entropy.detach()}

    def lexicon_importance(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """p [B, vocab] in fp32 at least: the lexicon-importance distribution of each text (class docstring)."""
        text = ordinary_positions(attention_mask.sum(dim=1), hidden.shape[1])
        pooled = max_pooled_linear(self.encoder.mlm_transform(hidden), self.encoder.output_weight,
                                   self.encoder.mlm_bias, text)  # no [B, L, vocab] logits kept
        pooled = pooled.to(torch.promote_types(pooled.dtype, torch.float32))  # a softmax over |V|: fp32 at least
        if self.options.importance == "softmax":
            return torch.softmax(pooled, dim=-1)
        saturated = torch.log1p(torch.relu(pooled))
        return saturated / (saturated.sum(dim=-1, keepdim=True) + 1e-4)

    def decoder_loss(self, states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the decoder's MLM head at the positions whose label is not -100."""
        return masked_token_loss(states, labels, self.decoder_mlm_transform, self.encoder.output_weight,
                                 self.decoder_mlm_bias, self.encoder.vocab_loss)


def lexmae_flops(options: LexMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The MLM head at every position (the max-pooled logits; the encoder's own count has its masked ones), the
    bottleneck p E, the decoder's layers over the whole text and its MLM head at the decoder's targets."""
    b, length = batch["input_ids"].shape
    return (vocab_flops(config, b * length) + bottleneck_flops(config, b)
            + options.decoder_layers * layer_flops(config, b, length, length)
            + vocab_flops(config, labelled(batch["dec_labels"])))


def bottleneck_flops(config, texts: int) -> int:
    """p E: [texts, vocab] x [vocab, hidden]."""
    return 2 * texts * config.vocab_size * config.hidden_size


def lexmae_no_backward_flops(options: LexMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The max-pooled projection to the vocabulary (its backward is a gather of each entry's winning position,
    models.vocab_projection), and half of p E, whose E takes no gradient: one backward matmul, not two."""
    b, length = batch["input_ids"].shape
    return vocab_projection_flops(config, b * length) + bottleneck_flops(config, b) // 2


register_method("lexmae", LexMAEHead, LexMAECollator, LexMAEOptions, flops=lexmae_flops,
                no_backward_flops=lexmae_no_backward_flops, eval_pooling="sparse", study_arm=11)
