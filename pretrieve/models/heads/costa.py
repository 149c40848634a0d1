"""`costa`: COSTA (Ma et al. 2022), its paper's §3.2-3.3: contrastive span prediction + MLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pretrieve.data.collators import MLMCollator
from pretrieve.data.spans import sample_spans, word_candidates
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.infonce import gather_across_ranks, world
from pretrieve.models.token_targets import token_targets


@dataclass
class COSTAOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # §3.3: MLM "similar to BERT"
    spans_per_level: int = option(5, at_least=1)  # §4.5.1
    span_alpha: float = option(4.0, above=0)  # §4.5.1: Beta(4, 2), skewed towards longer spans
    span_beta: float = option(2.0, above=0)
    temperature: float = option(0.1, above=0)  # §4.5.1: tau of eq. 8
    # §4.5.1 sets "the hyper-parameter in Eq. 3.3" to 0.1; read as the MLM loss weight
    mlm_weight: float = option(0.1, at_least=0)


@dataclass
class COSTACollator(MLMCollator):
    """COSTA batches: MLM keys plus `span_bounds` [B, 4 levels x spans_per_level, 2], (start, end) token positions
    of the sampled multi-granularity spans (data/spans.py), (-1, -1) where a text is too short for a level and
    throughout a stream pad sample."""

    spans_per_level: int = 5
    span_alpha: float = 4.0
    span_beta: float = 2.0

    def __post_init__(self):
        self._candidates = word_candidates(self.vocab)  # one-token words the word level may take

    def extend(self, out, batch, words, num_words, rng):
        bounds = sample_spans(batch.ids, batch.lengths, words, self.vocab, self._candidates, rng,
                              self.spans_per_level, self.span_alpha, self.span_beta)
        bounds[batch.pad] = -1  # a pad sample carries no target: without spans it is no anchor of eq. (8)
        out["span_bounds"] = torch.from_numpy(bounds)


def span_means(hidden: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """[B, S, d] mean of the output vectors over each span [start, end) (eq. 7); invalid spans give 0."""
    batch, width, size = hidden.shape
    prefix = torch.cat([hidden.new_zeros(batch, 1, size), hidden.cumsum(dim=1)], dim=1)  # [B, L + 1, d]
    start, end = bounds[..., 0].clamp(min=0), bounds[..., 1].clamp(min=0)
    total = torch.gather(prefix, 1, end[..., None].expand(-1, -1, size)) \
        - torch.gather(prefix, 1, start[..., None].expand(-1, -1, size))
    return total / (end - start).clamp(min=1)[..., None].to(hidden.dtype)


def group_contrastive_loss(texts: torch.Tensor, spans: torch.Tensor, valid: torch.Tensor, temperature: float,
                           first_anchor: int = 0, anchors: int | None = None) -> torch.Tensor:
    """Eq. (8) over a (global) batch of N texts [N, d] and their spans [N, S, d] (`valid` [N, S]).

    For a text i, the positives are its own spans P(i) and the candidates are every other representation in
    the batch (all texts and all spans but z_i itself):
    L_i = -1/|P(i)| sum_{p in P(i)} log( exp(z_i . z_p / tau) / sum_{a != i} exp(z_i . z_a / tau) ).
    The loss is the mean over the anchors texts[first_anchor : first_anchor + anchors] that have spans.
    """
    n, s, size = spans.shape
    anchors = n - first_anchor if anchors is None else anchors
    candidates = torch.cat([texts, spans.reshape(n * s, size)])  # [N + N*S, d]
    keep = torch.cat([torch.ones(n, dtype=torch.bool, device=valid.device), valid.reshape(-1)])
    z = texts[first_anchor:first_anchor + anchors]
    logits = z @ candidates.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature  # [A, N + N*S]
    own = torch.arange(first_anchor, first_anchor + anchors, device=z.device)
    excluded = ~keep[None, :].expand_as(logits).clone()
    excluded[torch.arange(anchors), own] = True  # z_i is not its own candidate
    log_prob = logits.masked_fill(excluded, float("-inf")).log_softmax(dim=-1)
    positive = torch.zeros_like(excluded)
    span_cols = n + own[:, None] * s + torch.arange(s, device=z.device)[None, :]
    positive.scatter_(1, span_cols, valid[own])
    count = positive.sum(dim=1)
    per_anchor = -(log_prob.masked_fill(~positive, 0.0)).sum(dim=1) / count.clamp(min=1)
    has = count > 0
    return per_anchor[has].sum() / has.sum().clamp(min=1)


class COSTAHead(PretrainingHead):
    """L = L_CSP + mlm_weight * L_MLM. The encoder reads the masked text once; z_i = g(h_CLS), with the
    projector g a two-layer FFN with a ReLU (eqs. 5-6); span representations are the mean output vectors
    over each span (eq. 7); L_CSP is the group-wise contrastive loss of eq. (8) over all texts and spans of
    the global batch (gathered across ranks, anchors = this rank's texts); L_MLM of eq. (9)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        size = encoder.config.hidden_size
        self.projector = nn.Sequential(nn.Linear(size, size), nn.ReLU(), nn.Linear(size, size))
        encoder.init_new(self.projector)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, token_targets(batch, "mlm_labels"))
        bounds = batch["span_bounds"]
        texts = self.projector(hidden[:, 0])
        spans = span_means(hidden, bounds)
        valid = bounds[..., 0] >= 0
        rank = world()[0]
        csp = group_contrastive_loss(gather_across_ranks(texts), gather_across_ranks(spans),
                                     gather_across_ranks(valid), self.options.temperature,
                                     first_anchor=rank * len(texts), anchors=len(texts))
        loss = csp + self.options.mlm_weight * mlm
        return {"loss": loss, "mlm": mlm.detach(), "csp": csp.detach()}


def costa_flops(options: COSTAOptions, config, batch: dict[str, torch.Tensor]) -> int:
    """The projector g, two h x h layers on each text's [CLS] state; its contrastive matrix (anchors x
    candidates x h, well under 1% at these sizes) is left out."""
    return 4 * batch["input_ids"].shape[0] * config.hidden_size * config.hidden_size


register_method("costa", COSTAHead, COSTACollator, COSTAOptions, flops=costa_flops, eval_pooling="cls",
                study_arm=5)
