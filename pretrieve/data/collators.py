"""What the methods' collators share (docs/design.md, "Batch"); each method's own stands beside its head
(models/heads/<method>.py, CoT-MAE's and Llama2Vec's in data/cotmae.py and data/llama2vec.py), and its registry
entry names it.

A collator turns stream samples (dicts with `ids`, the block's token ids without special tokens, plus the
stream's `epoch`, `shard`, `index`, `pad`) into a dict of batch-first tensors. Its random choices come from
(seed, epoch, shard, index, pad) of the batch's first sample, so a batch is a pure function of its samples:
the same masks whatever the number of workers, and again after a resume. Samples flagged `pad` (a rank
padded to an equal batch count, see stream.py) are collated but carry no target. `MLMCollator` is the MLM
baseline's and the base a method's collator extends (`extend`: its own keys); the functions below build what
several methods' collators add.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from pretrieve.data.masking import Vocabulary, corrupt, ordinary_positions, whole_word_mask, word_ids


# beside a token loss's labels `<key>` [B, L]: its labelled positions and their labels, a fixed count of each
# (labelled_positions; models/token_targets.py reads them)
POSITIONS, TARGETS = "_positions", "_targets"


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
    # train.static_shapes: every batch max_len wide, each token loss's positions a count fixed for the run
    static_shapes: bool = False
    data_kind: ClassVar[str] = "text"  # the manifests' `kind` it collates: blocks of text
    # the labels of the head's token losses (Encoder.token_loss), each given its labelled positions
    token_losses: ClassVar[tuple[str, ...]] = ("mlm_labels",)
    # (share of masked tokens set to [MASK], share set to a random token; the rest keep theirs): BERT's 80/10/10
    corruption: ClassVar[tuple[float, float]] = (0.8, 0.1)
    # the mask budget round(mlm_ratio x n) counts [CLS] and [SEP] in n, as the released collators that mask the
    # text with them (HF's whole-word collator on a tokenized text: RetroMAE, SimLM, bowdpr); False: the text's
    # own tokens, as those that mask it before adding them (Condenser, coCondenser, CoT-MAE)
    budget_counts_cls_sep: ClassVar[bool] = False

    @classmethod
    def from_options(cls, options, vocab: Vocabulary, seed: int = 0):
        """The collator configured by the same-named fields of a method's options."""
        return collator_from_options(cls, options, vocab, seed)

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
        for key in (key for key in self.token_losses if key in out):  # a variant may go without one
            labels = out[key].numpy()
            slots = self.label_slots(key, *labels.shape) if self.static_shapes else None
            positions, targets = labelled_positions(labels, slots)
            out[key + POSITIONS], out[key + TARGETS] = torch.from_numpy(positions), torch.from_numpy(targets)
        return out

    def label_slots(self, key: str, rows: int, width: int) -> int:
        """The run-wide count of labelled positions of `key` in a batch of `rows` texts `width` wide
        (train.static_shapes): a bound no batch exceeds. The MLM mask takes whole words within each row's budget
        max(1, round(mlm_ratio x n)) (masking.whole_word_mask), n at most max_len (budget_counts_cls_sep) or
        max_len - 2; other labels: every position."""
        if key != "mlm_labels":
            return rows * width
        most = self.max_len if self.budget_counts_cls_sep else self.max_len - 2
        return rows * max(1, int(np.rint(self.mlm_ratio * most)))

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
        if self.static_shapes:  # texts are cut to max_len
            width = self.max_len
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


def labelled_positions(labels: np.ndarray, slots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(positions [N], targets [N]) of labels [B, L] (-100: no target): the flat indices into [B * L] of the
    labelled entries in row-major order, and their labels; N = `slots` (None: the count, at least 1), the
    padding entries at position 0 with target -100. Counted here on the host, where it costs no wait."""
    flat = labels.reshape(-1)
    index = np.flatnonzero(flat != -100)
    slots = max(len(index), 1) if slots is None else slots
    if len(index) > slots:
        raise ValueError(f"{len(index)} labelled positions in a batch, more than its {slots} slots")
    positions = np.zeros(slots, dtype=np.int64)
    positions[:len(index)] = index
    targets = np.full(slots, -100, dtype=np.int64)
    targets[:len(index)] = flat[index]
    return positions, targets


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


def bag_of_words_targets(batch: Padded, keep: np.ndarray, static_shapes: bool = False) -> torch.Tensor:
    """[B, U]: the unique ids of each text at the positions `keep` [B, L], padded with -100; none for a stream
    pad sample. U: the most of a text, or L with `static_shapes` (a text has no more positions)."""
    unique = [np.unique(row[kept]) if not is_pad else np.empty(0, dtype=np.int64)
              for row, kept, is_pad in zip(batch.ids, keep, batch.pad)]
    width = batch.ids.shape[1] if static_shapes else max(1, max(len(u) for u in unique))
    targets = np.full((len(unique), width), -100, dtype=np.int64)
    for row, u in enumerate(unique):
        targets[row, :len(u)] = u
    return torch.from_numpy(targets)


def next_token_labels(ids: np.ndarray, lengths: np.ndarray, pad: np.ndarray) -> np.ndarray:
    """Labels for a causal decoder whose position t predicts token t + 1: the ordinary tokens, shifted left."""
    ordinary = ordinary_positions(lengths, ids.shape[1]) & ~pad[:, None]
    labels = np.full(ids.shape, -100, dtype=np.int64)
    labels[:, :-1] = np.where(ordinary[:, 1:], ids[:, 1:], -100)
    return labels


def collator_from_options(cls, options, vocab: Vocabulary, seed: int):
    """A collator class configured by the same-named fields of a method's options."""
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