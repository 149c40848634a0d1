"""CoT-MAE's and CoT-MoTE's batches (models/heads/cotmae.py): each anchor block with a contextual span of its
document, as the released CoT-MAE (caskcsg/ir `cotmae/`) pairs them.

The released data gives every span of a document (an anchor) three contexts, drawn once when the data is made:
a random other span of the document (within 100 spans of it), a neighbour (the span before or after it) and an
overlapping span (the anchor's end and the text after it; for the document's last span, its start and the text
before it); each time the anchor is read, one of the three is picked, 1/3 each. Here a document's spans are its
blocks in the shard (data/neighbours.py), and the three contexts come from a generator seeded by (seed, source,
document, block): each anchor keeps them in every epoch, as if the data had been made once; the kind is drawn
per batch. The released data drops one-span documents; the stream reads every block, so a one-block document is
cut into two halves, one of them the anchor (fixed per anchor) and the other its context: no text decodes
itself, but a one-token block, which can only be its own context (`ctx_kind` "self").

`decoder_objective` mlm (the released one) encodes both texts of each pair, rows [a0, c0, a1, c1, ...], and
gives each row the other one masked again at `decoder_mask_ratio` for its decoder; clm (the CoT-MoTE paper's
summary) encodes the anchor alone and gives the decoder its context, unmasked, to predict token by token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from pretrieve.data.collators import MLMCollator, Padded, next_token_labels, text_hash
from pretrieve.data.masking import corrupt, whole_word_mask
from pretrieve.data.neighbours import NeighbourBlocks

CONTEXT_KINDS = ("random", "neighbour", "overlap")  # `context: mixed` picks one per anchor and batch, 1/3 each
KIND_IDS = {"random": 0, "neighbour": 1, "overlap": 2, "query": 3, "self": -1}  # `ctx_kind` in a batch
WINDOW = 100  # the released data's random span lies within 100 spans of the anchor (make_cotmae_data.py)


@dataclass
class Pair:
    anchor: np.ndarray
    context: np.ndarray
    kind: str  # a key of KIND_IDS


@dataclass
class CoTMAECollator(MLMCollator):
    """CoT-MAE batches. Both objectives: `ctx_kind` [B] (KIND_IDS; per anchor), `ctx_is_query`, `ctx_from_self`.

    mlm: `input_ids`, `attention_mask`, `mlm_labels` over rows [a0, c0, a1, c1, ...] (anchor i and its context,
    each masked at `mlm_ratio`), plus the decoder's `dec_input_ids` / `dec_attention_mask` / `dec_labels`: row r
    holds the text of row r ^ 1 masked anew at `decoder_mask_ratio` (whole words, 80/10/10), its [CLS] slot for
    row r's encoder state. clm: the MLM keys of the anchors alone, plus `ctx_input_ids` ([CLS] context [SEP]),
    `ctx_attention_mask`, `ctx_labels` (the next ordinary token)."""

    max_len: int = 128
    mlm_ratio: float = 0.30
    token_losses: ClassVar[tuple[str, ...]] = ("mlm_labels", "dec_labels", "ctx_labels")
    decoder_mask_ratio: float | None = 0.45
    decoder_objective: str = "mlm"
    # mixed | random | neighbour | overlap | query (pseudo-queries only) | auto (a query when the document has one)
    context: str = "mixed"
    neighbours: NeighbourBlocks = field(default_factory=NeighbourBlocks, repr=False)

    def texts(self, samples, rng):
        texts = []
        for sample in samples:
            pair = self.pair(sample, rng)
            texts.append({**sample, "ids": pair.anchor, "pair": pair, "role": "anchor"})
            if self.decoder_objective == "mlm":
                texts.append({**sample, "ids": pair.context, "pair": pair, "role": "context"})
        return texts

    def extend(self, out, batch, words, num_words, rng):
        pairs = [s["pair"] for s in batch.samples if s["role"] == "anchor"]
        out["ctx_kind"] = torch.tensor([KIND_IDS[p.kind] for p in pairs])
        out["ctx_is_query"] = out["ctx_kind"] == KIND_IDS["query"]
        out["ctx_from_self"] = out["ctx_kind"] == KIND_IDS["self"]
        if self.decoder_objective == "clm":
            ctx = self.pad([{"ids": p.context, "pad": s.get("pad", False)} for p, s in zip(pairs, batch.samples)])
            out["ctx_input_ids"] = torch.from_numpy(ctx.ids)
            out["ctx_attention_mask"] = attention_mask(ctx)
            out["ctx_labels"] = torch.from_numpy(next_token_labels(ctx.ids, ctx.lengths, ctx.pad))
            return
        partner = np.arange(len(batch.ids)) ^ 1  # rows 2i and 2i + 1 decode each other
        masked = whole_word_mask(words[partner], num_words[partner], batch.lengths[partner] - 2,
                                 self.decoder_mask_ratio, rng)
        masked[batch.pad[partner]] = False
        dec_input_ids, dec_labels = corrupt(batch.ids[partner], masked, self.vocab, rng, *self.corruption)
        out["dec_input_ids"] = torch.from_numpy(dec_input_ids)
        out["dec_attention_mask"] = out["attention_mask"][partner]
        out["dec_labels"] = torch.from_numpy(dec_labels)

    def pair(self, sample: dict, rng: np.random.Generator) -> Pair:
        """The sample's anchor text and its context; what is fixed per anchor comes from `anchor_draws`."""
        room = self.max_len - 2
        queries = sample.get("queries") if self.context in ("auto", "query") else None
        if queries:
            query = np.asarray(queries[int(rng.integers(len(queries)))], dtype=np.int64)
            return Pair(np.asarray(sample["ids"])[:room], query, "query")
        if self.context == "query":
            raise ValueError(f"method.context is 'query' but document {sample.get('doc')!r} of "
                             f"{sample.get('source')!r} has no pseudo-queries (prepare a jsonl with a queries field)")
        draws = self.anchor_draws(sample)
        spans, at = self.spans(sample, draws[0])
        anchor = np.asarray(spans[at])[:room]
        if len(spans) == 1:
            return Pair(anchor, anchor, "self")
        kind = self.context if self.context in CONTEXT_KINDS else CONTEXT_KINDS[int(rng.integers(3))]
        if kind == "overlap":
            return Pair(anchor, overlap(spans, at, anchor, 1 + int(draws[3] * max(1, len(anchor) // 2)), room),
                        kind)
        reach = WINDOW if kind == "random" else 1
        others = [j for j in range(max(0, at - reach), min(len(spans), at + reach + 1)) if j != at]
        return Pair(anchor, np.asarray(spans[others[int(draws[1 if kind == "random" else 2] * len(others))]]),
                    kind)

    def anchor_draws(self, sample: dict) -> np.ndarray:
        """Four uniform numbers fixed per anchor, whatever the epoch or batch: the half of a one-block document
        that is the anchor, the random span, the neighbour's side and the overlap's length."""
        if sample.get("doc") is None:  # a text without a document (made by hand): its tokens name it
            key = text_hash(sample["ids"])
        else:
            digest = hashlib.blake2b(f"{sample.get('source')}\0{sample['doc']}".encode(), digest_size=8).digest()
            key = int.from_bytes(digest, "little") >> 1
        return np.random.default_rng([self.seed, key, int(sample.get("block", 0))]).random(4)

    def spans(self, sample: dict, half: float) -> tuple[list[np.ndarray], int]:
        """(the document's spans, the anchor's place among them): its blocks in the shard, within WINDOW of the
        sample's; a one-block document's two halves (the anchor: the first when `half` < 0.5)."""
        if "shard_file" in sample and sample.get("doc") is not None:
            blocks, at = self.neighbours.document(sample, WINDOW)
            spans = [np.asarray(ids) for ids, _ in blocks]
        else:
            spans, at = [np.asarray(sample["ids"])], 0
        if len(spans) > 1 or len(spans[0]) < 2:
            return spans, at
        ids = spans[0]
        cut = (len(ids) + 1) // 2
        return [ids[:cut], ids[cut:]], int(half >= 0.5)


def overlap(spans: list[np.ndarray], at: int, anchor: np.ndarray, keep: int, room: int) -> np.ndarray:
    """The anchor's last `keep` tokens and the document's text after them, `room` tokens in all; for the last
    span, the text before its first `keep` tokens and them (the released overlap, counted in tokens)."""
    last = at == len(spans) - 1
    order = spans[at - 1::-1] if last else spans[at + 1:]
    rest, need = [], room - keep
    for span in order:
        if need <= 0:
            break
        piece = span[len(span) - need:] if last and len(span) > need else span[:need]
        rest.append(piece)
        need -= len(piece)
    if last:
        return np.concatenate([*rest[::-1], anchor[:keep]])
    return np.concatenate([anchor[-keep:], *rest])


def attention_mask(padded: Padded) -> torch.Tensor:
    return torch.from_numpy((np.arange(padded.ids.shape[1])[None, :] < padded.lengths[:, None]).astype(np.int64))


@dataclass
class CoTMoTECollator(CoTMAECollator):
    """CoT-MoTE batches: CoT-MAE keys plus `text_type` per encoder row (1 = query, 0 = passage): texts of a corpus
    `source` listed in `query_sources`, and pseudo-queries encoded as contexts, go through the query experts."""

    max_len: int = 144
    context: str = "auto"
    query_sources: tuple[str, ...] = ()

    def extend(self, out, batch, words, num_words, rng):
        super().extend(out, batch, words, num_words, rng)
        out["text_type"] = torch.tensor([int(s.get("source") in self.query_sources
                                             or (s["role"] == "context" and s["pair"].kind == "query"))
                                         for s in batch.samples])
