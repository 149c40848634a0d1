"""`retromae`: RetroMAE (Xiao et al. 2022), as restated in RetroMAE v2 (arXiv) §3.1, eqs. (1)-(5)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch
from torch.profiler import record_function

from pretrieve.data.collators import MLMCollator
from pretrieve.data.masking import decoder_mask_pool, ordinary_positions, word_ids
from pretrieve.kernels import IMPLEMENTATIONS, CompactMask, fused_problem, two_stream_attention
from pretrieve.models.flops import labelled, layer_flops, vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.decoder import Decoder
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.token_targets import token_targets

QUERY_STREAM_CHOICES = ("position", "embeddings")


@dataclass
class RetroMAEOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    # encoder masking, whole words, 80/10/10 (§3.1: 15-30%; 30% in DupMAE §3.1)
    mlm_ratio: float = option(0.30, above=0, at_most=1)
    # share of words each decoder mask row hides (eq. 5's sample s(X))
    decoder_hide_ratio: float = option(0.50, at_least=0, at_most=1)
    decoder_pool_size: int = option(256, at_least=1)  # mask rows sampled per text: min(L, 256), official collator
    # the decoder's attention: fused (Triton) | sdpa | eager | auto, the faster as measured (pretrieve.kernels)
    attention_impl: str = option("auto", choices=IMPLEMENTATIONS)
    # None: the encoder's; the fused kernel needs 0
    decoder_attention_dropout: float | None = option(None, at_least=0, below=1)
    # H1 of eq. (2): "position" = h + p_i (paper, official RetroMAE code); "embeddings" = h through the embedding
    # module (+ token type 0, LayerNorm, dropout: official DupMAE code)
    query_stream: str = option("position", choices=QUERY_STREAM_CHOICES)


@dataclass
class RetroMAECollator(MLMCollator):
    """RetroMAE batches: MLM keys plus the decoder's `dec_input_ids` (the unmasked ids), `dec_labels` (every
    ordinary token, eq. 4) and the compact position-specific mask `dec_pool` / `dec_row` (eq. 5, see
    masking.decoder_mask_pool)."""

    mlm_ratio: float = 0.30
    decoder_hide_ratio: float = 0.50
    decoder_pool_size: int = 256
    budget_counts_cls_sep: ClassVar[bool] = True
    token_losses: ClassVar[tuple[str, ...]] = ("mlm_labels", "dec_labels")

    def extend(self, out, batch, words, num_words, rng):
        ordinary = ordinary_positions(batch.lengths, batch.ids.shape[1]) & ~batch.pad[:, None]
        # the released decoder mask hides an [UNK] like a word (attention only: its id is no MLM target)
        words, num_words = word_ids(batch.ids, batch.lengths, self.vocab, specials=True)
        pool, rows = decoder_mask_pool(words, num_words, batch.lengths, self.decoder_pool_size,
                                       self.decoder_hide_ratio, rng)
        out["dec_input_ids"] = torch.from_numpy(batch.ids)
        out["dec_labels"] = torch.from_numpy(np.where(ordinary, batch.ids, -100))
        out["dec_pool"] = torch.from_numpy(pool)
        out["dec_row"] = torch.from_numpy(rows)


class RetroMAEHead(PretrainingHead):
    """L = L_mlm + L_dec.

    Encoder (eq. 1): the masked input gives h_X~ = the [CLS] state, and L_mlm at the masked positions.
    Decoder: one layer with two streams (eq. 2), H1 = [h_X~ + p_0, ..., h_X~ + p_N] (query; `query_stream`
    "position", exactly eq. 2 as the official RetroMAE code, or "embeddings", h_X~ through the embedding module
    as the official DupMAE code) and H2 = [h_X~, e_x1 + p_1, ..., e_xN + p_N] (context: h_X~ itself, then the
    tokens' embeddings with the embedding LayerNorm, as both official codes); position-specific mask M from the
    compact `dec_pool` / `dec_row` (eq. 5); L_dec = cross-entropy of the (tied) MLM head over every ordinary
    token of the unmasked input (eq. 4).
    """

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.decoder = Decoder(encoder, num_layers=1)
        if options.decoder_attention_dropout is not None:
            self.decoder.attention_dropout = options.decoder_attention_dropout
        # fused with attention dropout, or on a machine that cannot run it: refused up front, not at the first step
        if options.attention_impl == "fused" and (problem := fused_problem(self.decoder.attention_dropout)):
            raise ValueError(problem)

    def resolved_options(self):
        return replace(self.options, decoder_attention_dropout=self.decoder.attention_dropout)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        dec = self.decoder_loss(hidden[:, 0], batch)
        return {"loss": mlm + dec, "mlm": mlm.detach(), "dec": dec.detach()}

    def decoder_loss(self, h_cls: torch.Tensor, batch: dict) -> torch.Tensor:
        # named regions of a profile (benchmarks/pretrain_throughput.py --profile): the decoder's kernels, and its
        # projection onto the vocabulary at every ordinary token apart from the encoder's MLM loss (the same kernels)
        with record_function("pretrieve/retromae.decoder"):
            embeddings = self.encoder.embeddings
            ids = batch["dec_input_ids"]
            h2 = torch.cat([h_cls[:, None], embeddings(input_ids=ids)[:, 1:]], dim=1)
            h1 = self.query_stream(h_cls, ids.shape[1])
            lengths = batch["attention_mask"].sum(dim=1)
            mask = CompactMask(batch["dec_pool"], batch["dec_row"], lengths)
            out = self.decoder(h1, h2, lambda q, k, v, dropout_p: two_stream_attention(
                q, k, v, mask, self.options.attention_impl, dropout_p))
        with record_function("pretrieve/retromae.decoder_vocab_loss"):
            return self.encoder.token_loss(out, token_targets(batch, "dec_labels"))

    def query_stream(self, h_cls: torch.Tensor, width: int) -> torch.Tensor:
        """H1 [B, L, hidden] of eq. (2) from the [CLS] states h_cls [B, hidden]. With rotary positions
        (ModernBERT) there is no p_i to add: the decoder rotates its queries by position instead."""
        if self.options.query_stream == "position":
            positions = self.encoder.position_vectors(width, h_cls.device)
            return h_cls[:, None].expand(-1, width, -1) if positions is None else h_cls[:, None] + positions[None]
        return self.encoder.embeddings(inputs_embeds=h_cls[:, None].expand(-1, width, -1))


def retromae_flops(options: RetroMAEOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The decoder layer over the whole text, layer(B, L, L), and the MLM head at its targets."""
    b, length = batch["input_ids"].shape
    return layer_flops(config, b, length, length) + vocab_flops(config, labelled(batch["dec_labels"]))


register_method("retromae", RetroMAEHead, RetroMAECollator, RetroMAEOptions, flops=retromae_flops,
                eval_pooling="cls", study_arm=2)
