"""Batch builders of the built-in methods; each method's registry entry names its own (docs/design.md, "Batch").

A collator turns stream samples (dicts with `ids`, the block's token ids without special tokens, plus the
stream's `epoch`, `shard`, `index`, `pad`) into a dict of batch-first tensors. Its random choices come from
(seed, epoch, shard, index, pad) of the batch's first sample, so a batch is a pure function of its samples:
the same masks whatever the number of workers, and again after a resume. Samples flagged `pad` (a rank
padded to an equal batch count, see stream.py) are collated but carry no target.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from pretrieve.data.masking import (Vocabulary, corrupt, decoder_mask_pool, ordinary_positions, whole_word_mask,
                                    word_ids)
from pretrieve.data.spans import sample_spans, word_candidates


@dataclass
class Padded:
    ids: np.ndarray  # int64 [B, L]: [CLS] tokens [SEP] [PAD]...
    lengths: np.ndarray  # int64 [B], special tokens included
    pad: np.ndarray  # bool [B]: stream pad samples (no targets)
    samples: list[dict]  # the stream samples, for collators that need more than the ids


@dataclass
class MLMCollator:
    """BERT MLM batches: `input_ids`, `attention_mask`, `mlm_labels` (whole-word masking, 80/10/10)."""

    vocab: Vocabulary
    max_len: int = 512
    mlm_ratio: float = 0.15
    seed: int = 0
    pad_to_multiple_of: int = 8
    data_kind: ClassVar[str] = "text"  # the manifests' `kind` it collates: blocks of text
    # (share of masked tokens set to [MASK], share set to a random token; the rest keep theirs): BERT's 80/10/10
    corruption: ClassVar[tuple[float, float]] = (0.8, 0.1)
    # the mask budget round(mlm_ratio x n) counts [CLS] and [SEP] in n, as the released collators that mask the
    # text with them (HF's whole-word collator on a tokenized text: RetroMAE, SimLM, bowdpr); False: the text's
    # own tokens, as those that mask it before adding them (Condenser, coCondenser, CoT-MAE)
    budget_counts_cls_sep: ClassVar[bool] = False

    @classmethod
    def from_options(cls, options, vocab: Vocabulary, seed: int = 0):
        """The collator configured by the same-named fields of a method's options."""
        return _from_options(cls, options, vocab, seed)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        rng = self._rng(samples)
        batch = self.pad(self.texts(samples, rng))
        words, num_words = word_ids(batch.ids, batch.lengths, self.vocab)
        masked = whole_word_mask(words, num_words, self.budget_tokens(batch), self.mlm_ratio, rng)
        masked[batch.pad] = False
        input_ids, labels = corrupt(batch.ids, masked, self.vocab, rng, *self.corruption)
        attention_mask = (np.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]).astype(np.int64)
        out = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention_mask),
               "mlm_labels": torch.from_numpy(labels)}
        self.extend(out, batch, words, num_words, rng)
        return out

    def extend(self, out: dict, batch: Padded, words: np.ndarray, num_words: np.ndarray,
               rng: np.random.Generator) -> None:
        """Method-specific keys; the MLM baseline has none."""

    def budget_tokens(self, batch: Padded) -> np.ndarray:
        """[B]: the tokens of each text a mask budget is a share of (`budget_counts_cls_sep`)."""
        return batch.lengths if self.budget_counts_cls_sep else batch.lengths - 2

    def texts(self, samples: list[dict], rng: np.random.Generator) -> list[dict]:
        """The encoder's texts of a batch: each sample's block (coCondenser's collator cuts two spans from each)."""
        return samples

    def pad(self, samples: list[dict]) -> Padded:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        room = self.max_len - 2
        lengths = np.array([min(len(s["ids"]), room) + 2 for s in samples], dtype=np.int64)
        width = int(lengths.max())
        width = min(-(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of, max(self.max_len, width))
        ids = np.full((len(samples), width), self.vocab.pad_id, dtype=np.int64)
        ids[:, 0] = self.vocab.cls_id
        for row, (s, n) in enumerate(zip(samples, lengths)):
            ids[row, 1:n - 1] = s["ids"][:n - 2]
            ids[row, n - 1] = self.vocab.sep_id
        pad = np.array([bool(s.get("pad", False)) for s in samples])
        return Padded(ids, lengths, pad, samples)

    def _rng(self, samples: list[dict]) -> np.random.Generator:
        first = samples[0]
        key = [self.seed, first.get("epoch", 0), first.get("shard", 0), first.get("index", 0),
               int(bool(first.get("pad", False))), len(samples)]
        return np.random.default_rng(key)


@dataclass
class RetroMAECollator(MLMCollator):
    """RetroMAE batches: MLM keys plus the decoder's `dec_input_ids` (the unmasked ids), `dec_labels` (every
    ordinary token, eq. 4) and the compact position-specific mask `dec_pool` / `dec_row` (eq. 5, see
    masking.decoder_mask_pool)."""

    mlm_ratio: float = 0.30
    decoder_hide_ratio: float = 0.50
    decoder_pool_size: int = 256
    budget_counts_cls_sep: ClassVar[bool] = True

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


@dataclass
class DupMAECollator(RetroMAECollator):
    """DupMAE batches: RetroMAE keys plus `bow_targets` [B, U], the unique ordinary token ids of each input
    (set(X) of eq. 8), padded with -100."""

    def extend(self, out, batch, words, num_words, rng):
        super().extend(out, batch, words, num_words, rng)
        out["bow_targets"] = bag_of_words_targets(batch, ordinary_positions(batch.lengths, batch.ids.shape[1]))


@dataclass
class BoWCollator(MLMCollator):
    """Bag-of-words prediction batches: MLM keys plus `bow_targets` [B, U], the unique ordinary token ids of
    each unmasked input, the tokenizer's special tokens ([UNK] ...) left out, padded with -100."""

    mlm_ratio: float = 0.30
    budget_counts_cls_sep: ClassVar[bool] = True  # bowdpr's max(1, round(p x n)) over [CLS] text [SEP]

    def extend(self, out, batch, words, num_words, rng):
        keep = ordinary_positions(batch.lengths, batch.ids.shape[1]) & ~self.vocab.special[batch.ids]
        out["bow_targets"] = bag_of_words_targets(batch, keep)


@dataclass
class SimLMCollator(MLMCollator):
    """SimLM batches: `input_ids` with [MASK] at every masked position (the released recipe's
    all_use_mask_token: the generator, not the collator, puts other tokens there), `attention_mask`, `mlm_labels`
    (the original token at the encoder's masked positions: where the generator samples, and its MLM target), plus
    `dec_input_ids` ([MASK] at the decoder's masked positions), `dec_masked` (bool [B, L], those positions) and
    `rlm_labels` (the original token at every ordinary position, the tokenizer's special tokens left out: the
    target of both the encoder and the decoder), and `replace_seed` [1], the seed of the generator's draws, drawn
    with the masks: a batch's replacements are a pure function of its samples, as its masks are.

    The decoder's mask holds the encoder's and adds whole words drawn independently at the rate that makes the
    union cover `decoder_mask_ratio` of the tokens in expectation, (d - e) / (1 - e), as the released collator
    does; a decoder ratio at or below the encoder's masks the decoder where the encoder is masked."""

    mlm_ratio: float = 0.30
    decoder_mask_ratio: float = 0.50
    corruption: ClassVar[tuple[float, float]] = (1.0, 0.0)
    budget_counts_cls_sep: ClassVar[bool] = True

    def extend(self, out, batch, words, num_words, rng):
        dec_masked = covering_mask(out, batch, words, num_words, self.budget_tokens(batch), self.mlm_ratio,
                                   self.decoder_mask_ratio, rng)
        targets = ordinary_positions(batch.lengths, batch.ids.shape[1]) & ~self.vocab.special[batch.ids]
        targets[batch.pad] = False
        out["dec_input_ids"] = torch.from_numpy(np.where(dec_masked, self.vocab.mask_id, batch.ids))
        out["dec_masked"] = torch.from_numpy(dec_masked)
        out["rlm_labels"] = torch.from_numpy(np.where(targets, batch.ids, -100))
        out["replace_seed"] = torch.from_numpy(rng.integers(0, 2**62, size=1))


@dataclass
class LexMAECollator(MLMCollator):
    """LexMAE batches: MLM keys (80/10/10 at `mlm_ratio`) plus the decoder's `dec_input_ids` (the text corrupted
    80/10/10 again, drawn anew, at the decoder's masked positions) and `dec_labels` (the original token there,
    -100 elsewhere). The decoder's mask holds the encoder's and adds whole words to cover `decoder_mask_ratio` of
    the tokens in expectation (the released code's `dec_mlm_overlap: inclusive`), as SimLM's collator does."""

    mlm_ratio: float = 0.30
    decoder_mask_ratio: float = 0.50

    def extend(self, out, batch, words, num_words, rng):
        dec_masked = covering_mask(out, batch, words, num_words, self.budget_tokens(batch), self.mlm_ratio,
                                   self.decoder_mask_ratio, rng)
        dec_input_ids, dec_labels = corrupt(batch.ids, dec_masked, self.vocab, rng, *self.corruption)
        out["dec_input_ids"] = torch.from_numpy(dec_input_ids)
        out["dec_labels"] = torch.from_numpy(dec_labels)


def covering_mask(out: dict, batch: Padded, words: np.ndarray, num_words: np.ndarray, budget_tokens: np.ndarray,
                  encoder_ratio: float, decoder_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """bool [B, L]: a decoder's mask that holds the encoder's (`out["mlm_labels"]`) and adds whole words drawn
    independently at (d - e) / (1 - e), so that the union covers `decoder_ratio` d of the tokens in expectation;
    at or below the encoder's ratio e, the encoder's mask itself. Stream pad samples: nothing masked."""
    dec_masked = (out["mlm_labels"] != -100).numpy().copy()
    extra = (decoder_ratio - encoder_ratio) / (1.0 - encoder_ratio) if encoder_ratio < 1 else 0.0
    if extra > 0:
        dec_masked |= whole_word_mask(words, num_words, budget_tokens, min(extra, 1.0), rng)
    dec_masked[batch.pad] = False
    return dec_masked


def bag_of_words_targets(batch: Padded, keep: np.ndarray) -> torch.Tensor:
    """[B, U]: the unique ids of each text at the positions `keep` [B, L], padded with -100; none for a stream
    pad sample."""
    unique = [np.unique(row[kept]) if not is_pad else np.empty(0, dtype=np.int64)
              for row, kept, is_pad in zip(batch.ids, keep, batch.pad)]
    targets = np.full((len(unique), max(1, max(len(u) for u in unique))), -100, dtype=np.int64)
    for row, u in enumerate(unique):
        targets[row, :len(u)] = u
    return torch.from_numpy(targets)


def next_token_labels(ids: np.ndarray, lengths: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """Labels for a causal decoder whose position t predicts token t + 1: the ordinary tokens, shifted left."""
    ordinary = ordinary_positions(lengths, ids.shape[1]) & ~pad[:, None]
    labels = np.full(ids.shape, -100, dtype=np.int64)
    labels[:, :-1] = np.where(ordinary[:, 1:], ids[:, 1:], -100)
    return labels


@dataclass
class SEEDCollator(MLMCollator):
    """SEED-Encoder batches: MLM keys plus `dec_input_ids` (the unmasked ids) and `dec_labels` (next ordinary
    token at each position; position 0 will hold the encoder's [CLS] state)."""

    def extend(self, out, batch, words, num_words, rng):
        out["dec_input_ids"] = torch.from_numpy(batch.ids)
        out["dec_labels"] = torch.from_numpy(next_token_labels(batch.ids, batch.lengths, batch.pad))


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


def _from_options(cls, options, vocab: Vocabulary, seed: int):
    names = {f.name for f in fields(cls) if f.init} - {"vocab", "seed", "neighbours"}
    return cls(vocab=vocab, seed=seed, **{n: getattr(options, n) for n in names if hasattr(options, n)})


def text_hash(ids: np.ndarray) -> int:
    """A 63-bit fingerprint of a text's token ids: equal texts, equal hashes (false-negative masking)."""
    digest = hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def pad_texts(texts: list[np.ndarray], max_len: int, vocab: Vocabulary, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, L] ids: [CLS] text [SEP] [PAD]..., each text cut to max_len - 2 tokens; [B, L] attention mask)."""
    lengths = np.array([min(len(t), max_len - 2) + 2 for t in texts], dtype=np.int64)
    width = min(-(-int(lengths.max()) // multiple) * multiple, max(max_len, int(lengths.max())))
    ids = np.full((len(texts), width), vocab.pad_id, dtype=np.int64)
    ids[:, 0] = vocab.cls_id
    for row, (text, n) in enumerate(zip(texts, lengths)):
        ids[row, 1:n - 1] = text[:n - 2]
        ids[row, n - 1] = vocab.sep_id
    return ids, (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)


@dataclass
class ContrastiveCollator:
    """Batches of (query, passage) pairs for contrastive pre-training, from a pair stream's samples (`query`,
    `pos`, `negs`: token ids without special tokens; `source`, `doc`):

    - `q_input_ids` / `q_attention_mask` [B, Lq] and `p_input_ids` / `p_attention_mask` [B, Lp]: [CLS] text [SEP];
    - with `negatives` N > 0, the pair's own negatives `n_input_ids` / `n_attention_mask` [B x N, Ln] (row i's
      at i x N ...), N of them drawn when it has more, and `n_valid` [B x N] False where it has fewer;
    - for false-negative masking: `q_hash`, `p_hash` [B] and `n_hash` [B x N] (the texts' fingerprints, uncut),
      `doc_hash` [B] (the pair's source and document);
    - `pad` [B]: stream pad samples, which are neither anchors nor candidates.
    """

    vocab: Vocabulary
    max_len: int = 128
    query_max_len: int = 128
    negatives: int = 0
    seed: int = 0
    pad_to_multiple_of: int = 8
    data_kind: ClassVar[str] = "pairs"

    @classmethod
    def from_options(cls, options, vocab: Vocabulary, seed: int = 0):
        return _from_options(cls, options, vocab, seed)

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        queries = [np.asarray(s["query"], dtype=np.int64) for s in samples]
        passages = [np.asarray(s["pos"], dtype=np.int64) for s in samples]
        out = {}
        for prefix, texts, max_len in (("q", queries, self.query_max_len), ("p", passages, self.max_len)):
            ids, mask = pad_texts(texts, max_len, self.vocab, self.pad_to_multiple_of)
            out[f"{prefix}_input_ids"], out[f"{prefix}_attention_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
            out[f"{prefix}_hash"] = torch.tensor([text_hash(t) for t in texts], dtype=torch.int64)
        out["doc_hash"] = torch.tensor([text_hash(np.frombuffer(f"{s.get('source', '')}\0{s.get('doc', '')}".encode(),
                                                                dtype=np.uint8)) for s in samples], dtype=torch.int64)
        out["pad"] = torch.tensor([bool(s.get("pad", False)) for s in samples])
        if self.negatives:
            rng = np.random.default_rng([self.seed, samples[0].get("epoch", 0), samples[0].get("shard", 0),
                                         samples[0].get("index", 0), len(samples)])
            negatives, valid = [], []
            for s in samples:
                own = [np.asarray(n, dtype=np.int64) for n in (s.get("negs") or [])]
                if len(own) > self.negatives:
                    own = [own[i] for i in sorted(rng.choice(len(own), self.negatives, replace=False))]
                valid += [True] * len(own) + [False] * (self.negatives - len(own))
                negatives += own + [np.empty(0, dtype=np.int64)] * (self.negatives - len(own))
            ids, mask = pad_texts(negatives, self.max_len, self.vocab, self.pad_to_multiple_of)
            out["n_input_ids"], out["n_attention_mask"] = torch.from_numpy(ids), torch.from_numpy(mask)
            out["n_valid"] = torch.tensor(valid)
            out["n_hash"] = torch.tensor([text_hash(t) for t in negatives], dtype=torch.int64)
        return out

    @staticmethod
    def count(batch: dict) -> tuple[int, int, int]:
        """(pairs, non-padding tokens, positions) of a batch: every text, queries, passages and negatives."""
        masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
        return len(batch["q_attention_mask"]), int(sum(m.sum() for m in masks)), sum(m.numel() for m in masks)
