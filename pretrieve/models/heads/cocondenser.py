"""`cocondenser`: coCondenser (Gao & Callan, ACL 2022, arXiv 2108.05540 §3.1-3.3, eqs. 1-7, 9, 11-12): Condenser
(heads/condenser.py; §3.1, eqs. 1-5) plus a corpus-aware contrastive loss over the [CLS] states of two spans of
each document (§3.2).

For the n documents of the global batch, each with spans s_i1 and s_i2 and late [CLS] states h_ij, the contrastive
loss (eq. 6):
L^co_ij = -log( exp(<h_ij, h_ij'>) / sum_{k, l: kl != ij} exp(<h_ij, h_kl>) ), j' the document's other span; the
candidates are every span of every rank (gathered in rank order, with gradients; models/infonce.py) but h_ij
itself and the stream pad samples' spans. Eq. 7 averages the head's MLM loss and L^co over the 2n spans,
L = 1/(2n) sum_ij [L^mlm_ij + L^co_ij]; here the mean of L^co over the spans is added to Condenser's two MLM
losses, the head's and the late layers' (Condenser's eq. 10, which eq. 7 leaves out), each a token mean over the
masked positions of every span: the released code's loss (docs/methods.md).

GradCache (§3.3; models/grad_cache.py), `grad_cache: {chunk: N}`: the 2B spans are encoded N at a time without a
graph, the contrastive loss's gradient with respect to their [CLS] states (v_ij, eq. 9) is taken on the whole
(global) batch, and each chunk is encoded again and back-propagated with its slice of it (eqs. 11-12). The chunk's
MLM losses travel with its [CLS] states as two more columns (their sums over the chunk's masked tokens, on its
first row), so the MLM terms are normalised once, by the micro-batch's masked tokens, whatever the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from pretrieve.data.collators import MLMCollator
from pretrieve.models.grad_cache import encode_in_chunks, grad_cache_of
from pretrieve.models.heads.condenser import CondenserHead, condenser_flops
from pretrieve.models.heads.registry import MethodOptions, option, register_method
from pretrieve.models.infonce import gather_candidates, info_nce, world


@dataclass
class CoCondenserOptions(MethodOptions):
    max_len: int = option(128, at_least=3, why="[CLS], a token, [SEP]")  # a span with its special tokens
    mlm_ratio: float = option(0.15, above=0, at_most=1)  # the released collator's mlm_probability
    span_len: int | None = option(None, at_least=1)  # tokens of a span at most; None: max_len - 2
    skip_from: int | None = option(None, at_least=1)  # as condenser's: None, half the encoder's layers
    head_layers: int = option(2, at_least=1)
    cross_device: bool = True  # every rank's spans are candidates (the released code gathers them)
    grad_cache: dict | None = None  # {chunk: N}: GradCache over the micro-batch's 2B spans (§3.3, eqs. 9-12)
    texts_per_sample: ClassVar[int] = 2  # two spans of each block: a GradCache chunk must split 2B texts

    def __post_init__(self):
        super().__post_init__()
        grad_cache_of(self.grad_cache, "method")
        if self.span_len is not None and self.span_len > self.max_len - 2:  # the collator would cut it silently
            raise ValueError(f"method.span_len: {self.span_len} tokens do not fit method.max_len {self.max_len} "
                             f"with [CLS] and [SEP] ({self.max_len - 2} at most); leave span_len out (max_len - 2) "
                             "or raise max_len")


@dataclass
class CoCondenserCollator(MLMCollator):
    """coCondenser batches: two spans of each sample's block, one after the other (rows 2i and 2i + 1 are
    sample i's), each masked for MLM as a text of its own, plus `pad` [2B] (the spans of a stream pad sample,
    which are neither anchors nor candidates of the contrastive loss).

    The block is cut into max(2, ceil(tokens / span_len)) windows of equal length (each at most `span_len`
    tokens, `span_len` None: max_len - 2) and two different windows are drawn: two disjoint spans of one
    document, as the released data holds documents as lists of spans and samples two of them. A block of one
    token gives that token twice."""

    mlm_ratio: float = 0.15
    max_len: int = 128
    token_losses: ClassVar[tuple[str, ...]] = ()  # the head cuts the batch in chunks: labels alone (token_targets)
    span_len: int | None = None

    def texts(self, samples, rng):
        room = self.max_len - 2 if self.span_len is None else min(self.span_len, self.max_len - 2)
        spans = []
        for sample in samples:
            ids = np.asarray(sample["ids"])
            cuts = max(2, -(-len(ids) // room))
            edges = np.linspace(0, len(ids), cuts + 1).round().astype(np.int64)
            for window in rng.choice(cuts, size=2, replace=False):
                start, end = edges[window], edges[window + 1]
                piece = ids[start:end] if end > start else ids[:1]
                spans.append({**sample, "ids": piece})
        return spans

    def extend(self, out, batch, words, num_words, rng):
        out["pad"] = torch.from_numpy(batch.pad)

    @staticmethod
    def count(batch: dict) -> tuple[int, int, int]:
        """(blocks, non-padding tokens, positions) of a batch: a sample is a block, whose two spans are rows."""
        mask = batch["attention_mask"]
        return len(mask) // 2, int(mask.sum()), mask.numel()


def span_contrastive_loss(reps: torch.Tensor, pad: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Sum of the span contrastive loss L^co (eq. 6) over the anchors reps[first : first + rows] that are real spans;
    `reps` [N, d] holds every candidate span, documents in pairs (2i, 2i + 1), `pad` [N] the stream pad samples'
    spans (no anchors, no candidates)."""
    anchors = torch.arange(first, first + rows, device=reps.device)
    scores = reps[first:first + rows] @ reps.T  # [rows, N]
    rows_at = torch.arange(rows, device=reps.device)
    excluded = pad[None, :].expand_as(scores).clone()
    excluded[rows_at, anchors ^ 1] = False  # never the positive: a pad sample's row stays finite (and is dropped)
    excluded[rows_at, anchors] = True  # a span is not its own candidate
    losses = info_nce(scores, anchors ^ 1, excluded)
    return losses.masked_fill(pad[first:first + rows], 0.0).sum()


class CoCondenserHead(CondenserHead):
    """L = L_mlm(head) + L_mlm(late) + L_co (eq. 7 with Condenser's eq. 10), see the module docstring."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        cache = grad_cache_of(options.grad_cache, "method")
        self.chunk = None if cache is None else cache.chunk
        self.grad_cache = True  # with a chunk: GradCache; False: the chunks under one graph (its reference)

    def resolved_options(self):  # the collator's span length (CoCondenserCollator.texts)
        span = self.options.max_len - 2
        return replace(super().resolved_options(), span_len=span if self.options.span_len is None
                       else min(self.options.span_len, span))

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """[rows, d + 2]: each span's late [CLS] state, then the chunk's summed head and late MLM losses on its
        first row (zeros below), so that any chunking adds up to the same sums."""
        late, condensed = self.condense(input_ids, attention_mask)
        count = (labels != -100).sum()
        sums = torch.stack([self.encoder.token_loss(condensed, labels), self.encoder.token_loss(late, labels)]) * count
        column = torch.cat([sums[None], sums.new_zeros(len(labels) - 1, 2)])
        # fp32 at least: a bf16 sum of a chunk's token losses would keep 3 significant digits
        dtype = torch.promote_types(late.dtype, torch.float32)
        return torch.cat([late[:, 0].to(dtype), column.to(dtype)], dim=1)

    def forward(self, batch):
        labels = batch["mlm_labels"]
        params = [p for p in self.parameters() if p.requires_grad]
        group = (batch["input_ids"], batch["attention_mask"], labels)
        # with a chunk, GradCache: v_ij (eq. 9) cached, each chunk back-propagated again with it (eqs. 11-12)
        (out,) = encode_in_chunks(self.encode, [group], self.chunk, params, cache=self.grad_cache)
        reps, sums = out[:, :-2], out[:, -2:].sum(dim=0)
        masked = (labels != -100).sum().clamp(min=1)
        head, mlm = sums[0] / masked, sums[1] / masked  # token means, where eq. 7 averages per-span sums
        pad = batch["pad"].bool()
        all_reps, first = gather_candidates(reps, self.options.cross_device)
        all_pad, _ = gather_candidates(pad, self.options.cross_device)
        # each rank's sum over its spans, divided by the global batch's spans over the world size: the ranks'
        # mean (DeepSpeed's) is the global batch's mean also where the ranks hold different numbers of real spans
        spans = (~all_pad).sum()
        rank_count = world()[1]
        if rank_count > 1 and not self.options.cross_device:
            torch.distributed.all_reduce(spans)
        # the mean of eq. 6 over the global batch's spans; the loss is eq. 7's sum with the late MLM term added
        co = span_contrastive_loss(all_reps, all_pad, first, len(reps)) * rank_count / spans.clamp(min=1)
        return {"loss": head + mlm + co, "mlm": mlm.detach(), "head": head.detach(), "co": co.detach()}


def cocondenser_flops(options, config, batch: dict[str, torch.Tensor]) -> int:
    """Condenser's head over the 2B spans; the span score matrix (2B x 2B x h, well under 1%) is left out, and so
    is GradCache's second encoding (recomputation, as activation checkpointing's)."""
    return condenser_flops(options, config, batch)


register_method("cocondenser", CoCondenserHead, CoCondenserCollator, CoCondenserOptions, flops=cocondenser_flops,
                eval_pooling="cls", study_arm=9,
                # a tiny model needs no GradCache (its loss and gradients are the one-graph ones:
                # tests/test_equations_condenser.py), which would only encode each span twice; a BERT-base run at
                # the speed ladder's 32 documents (64 spans) encodes them 16 at a time, as the paper trains (§3.3)
                tiny_overrides=("method.grad_cache=null",), paper_overrides=("method.grad_cache.chunk=16",))
