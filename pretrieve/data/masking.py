"""Masking for the pre-training collators, vectorised over the batch (docs/design.md, "Batch", "Compact decoder mask").

All functions take a padded batch `ids` [B, L] laid out as [CLS] tokens [SEP] [PAD]... with `lengths` [B]
(special tokens included). Only the ordinary tokens, positions 1 .. length-2, are ever masked or hidden;
[CLS] and the final [SEP] never are, as in BERT and the official RetroMAE collator. Nor is a special token
inside the text ([UNK], <unk>): it is no word (`word_ids`), as HF's whole-word collator and the released
Condenser, RetroMAE, SimLM and bowdpr collators never mask a special id.

A word is a token that starts one plus the pieces that continue it: "##" pieces for WordPiece (BERT's whole
words), pieces without "Ġ" / "▁" for byte-level BPE and SentencePiece (`word_starts`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Vocabulary:
    """What masking needs to know about the token ids."""

    size: int
    cls_id: int
    sep_id: int
    pad_id: int
    mask_id: int
    continuation: np.ndarray  # bool [size]: the token continues the word of the token before it
    special: np.ndarray  # bool [size]: a special token ([CLS], <s>, ...)
    tokens: tuple[str, ...] = ()  # the token strings in id order, without a word-start marker ("Ġ", "▁")
    backend: object = field(default=None, compare=False, repr=False)  # the tokenizer, for a prompt's ids

    def encode(self, text: str) -> list[int]:
        """The ids of `text` with no special tokens around it (a prompt a collator appends to each text)."""
        if self.backend is None:
            raise ValueError("this vocabulary was made without its tokenizer: it cannot encode a prompt")
        return self.backend.encode(text, add_special_tokens=False).ids

    @classmethod
    def of_tokenizer(cls, path) -> "Vocabulary":
        """The vocabulary of a HF tokenizer directory, with the special tokens its config names (cls, sep, pad,
        mask: [CLS] ... for BERT, <s> ... for RoBERTa and XLM-R)."""
        from pretrieve.data.tokenizer import load_tokenizer

        return cls.of_loaded(load_tokenizer(path), path)

    @classmethod
    def of_loaded(cls, tok, path) -> "Vocabulary":
        """`of_tokenizer` of a tokenizer loaded already (`load_tokenizer(path)`): its roles and its backend."""
        roles = {role: getattr(tok, f"{role}_token", None) for role in ("cls", "sep", "pad", "mask")}
        missing = [role for role, token in roles.items() if token is None]
        if missing:
            raise ValueError(f"{path}: the tokenizer names no {', '.join(f'{r}_token' for r in missing)}; "
                             "masking needs all four (tokenizer_config.json)")
        return cls.from_backend(tok.backend_tokenizer, {role: str(token) for role, token in roles.items()})

    @classmethod
    def from_backend(cls, backend, roles: dict[str, str] | None = None) -> "Vocabulary":
        """`roles`: the cls, sep, pad and mask tokens (default BERT's). Word boundaries follow the tokenizer's
        convention (`word_starts`)."""
        roles = roles or {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]"}
        vocab = backend.get_vocab(with_added_tokens=True)
        ids = {role: vocab.get(token) for role, token in roles.items()}
        missing = [roles[role] for role, index in ids.items() if index is None]
        if missing:
            raise ValueError(f"tokenizer has no {', '.join(missing)} token; masking needs its cls, sep, pad and "
                             "mask tokens")
        by_id = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
        special = np.zeros(len(vocab), dtype=bool)
        special[[index for index, token in backend.get_added_tokens_decoder().items() if token.special]] = True
        special[list(ids.values())] = True
        continuation, marker = word_starts(backend, by_id)
        continuation &= ~special
        tokens = tuple(t[len(marker):] if marker and t.startswith(marker) else t for t in by_id)
        return cls(len(vocab), ids["cls"], ids["sep"], ids["pad"], ids["mask"], continuation, special, tokens,
                   backend)


def word_starts(backend, tokens: list[str]) -> tuple[np.ndarray, str]:
    """(bool [size]: the token continues a word, the word-start marker or ""), by the tokenizer's convention:
    a continuation prefix ("##": WordPiece, and BPE trained with one), else a word-start marker ("Ġ": byte-level
    BPE, RoBERTa; "▁": Metaspace, SentencePiece / XLM-R), whose absence marks a continuation. With neither,
    every token is a word (token-level masking). Byte-level words run from space to space: "world," is one."""
    spec = json.loads(backend.to_str())
    prefix = spec["model"].get("continuing_subword_prefix")
    if prefix:
        return np.array([t.startswith(prefix) for t in tokens]), ""
    pre = spec.get("pre_tokenizer") or {}
    for step in pre.get("pretokenizers", [pre]):
        marker = {"ByteLevel": "Ġ", "Metaspace": step.get("replacement", "▁")}.get(step.get("type"))
        if marker:
            return np.array([not t.startswith(marker) for t in tokens]), marker
    return np.zeros(len(tokens), dtype=bool), ""


def ordinary_positions(lengths: np.ndarray, width: int) -> np.ndarray:
    """bool [B, L]: the positions 1 .. length-2 of each row (no [CLS], [SEP] or padding)."""
    pos = np.arange(width)
    return (pos >= 1) & (pos < (lengths[:, None] - 1))


def word_ids(ids: np.ndarray, lengths: np.ndarray, vocab: Vocabulary,
             specials: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(word index of every ordinary position, -1 elsewhere; number of words per row).

    A special token inside the text ([UNK]) is no word, so nothing drawn from these words masks it, and a piece
    after it begins a word; `specials` makes it a word of its own (RetroMAE's decoder hides it like one).
    """
    ordinary = ordinary_positions(lengths, ids.shape[1])
    in_word = ordinary if specials else ordinary & ~vocab.special[ids]
    starts = in_word & ~vocab.continuation[ids]
    starts[:, 1:] |= in_word[:, 1:] & ~in_word[:, :-1]  # a block that begins mid-word still begins a word
    words = np.cumsum(starts, axis=1) - 1
    return np.where(in_word, words, -1), starts.sum(axis=1)


def whole_word_mask(words: np.ndarray, num_words: np.ndarray, num_tokens: np.ndarray, ratio: float,
                    rng: np.random.Generator) -> np.ndarray:
    """bool [B, L]: whole words covering about `ratio` of each row's tokens (BERT / HF whole-word masking).

    Words are drawn in a random order and each is taken if it still fits the budget max(1, round(ratio x
    `num_tokens`)); one that would overflow it is skipped and the draw goes on, as HF's
    `DataCollatorForWholeWordMask` and the released collators do, so a row is filled exactly whenever its
    words allow. Vectorised over the batch: each round takes, in every row, the longest run of the remaining
    words that fit (a cumulative sum) and skips the word that overflows; the words left must fit what remains,
    which is below the longest word's length after the first round and shrinks each round, so the rounds are
    at most that length.
    """
    batch, max_words = len(num_words), max(int(num_words.max(initial=0)), 1)
    word_len = np.zeros((batch, max_words + 1), dtype=np.int64)  # the extra column collects position -1
    rows = np.broadcast_to(np.arange(batch)[:, None], words.shape)
    np.add.at(word_len, (rows, words), 1)
    word_len = word_len[:, :max_words]
    keys = rng.random((batch, max_words))
    keys[np.arange(max_words)[None, :] >= num_words[:, None]] = np.inf  # absent words (length 0) sort last
    order = np.argsort(keys, axis=1)
    drawn_len = np.take_along_axis(word_len, order, axis=1)
    remaining = np.maximum(1, np.rint(ratio * num_tokens)).astype(np.int64)
    taken = np.zeros((batch, max_words), dtype=bool)
    rank, first = np.arange(max_words)[None, :], np.zeros(batch, dtype=np.int64)  # the first undecided draw
    while True:
        candidates = (rank >= first[:, None]) & (drawn_len <= remaining[:, None])
        total = np.cumsum(np.where(candidates, drawn_len, 0), axis=1)
        fits = candidates & (total <= remaining[:, None])
        over = candidates & ~fits  # from the first overflowing word on (the total only grows)
        taken |= fits
        remaining -= np.where(fits, drawn_len, 0).sum(axis=1)
        if not over.any():
            break
        first = np.where(over.any(axis=1), over.argmax(axis=1) + 1, max_words)
    chosen = np.zeros((batch, max_words + 1), dtype=bool)
    np.put_along_axis(chosen, order, taken, axis=1)
    return np.take_along_axis(chosen, np.where(words < 0, max_words, words), axis=1)


def visible_word_samples(words: np.ndarray, num_words: np.ndarray, lengths: np.ndarray, rows: int,
                         hide_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """bool [B, rows, L]: `rows` independent whole-word samples per text, each word hidden with probability
    `hide_ratio` (quantised to 1/256); [CLS] and [SEP] always visible, padding never.

    The expected hidden share of tokens is `hide_ratio`, as with an exact budget, but drawing words
    independently needs no sort per row, which matters at 256 rows per text (see `random_bits`).
    """
    batch, width = words.shape
    max_words = max(int(num_words.max(initial=0)), 1)
    visible_words = random_bits(rng, (batch, rows, max_words + 2), 1.0 - hide_ratio)
    visible_words[:, :, max_words] = True  # read by [CLS] and [SEP]
    visible_words[:, :, max_words + 1] = False  # read by padding
    padding = np.arange(width)[None, :] >= lengths[:, None]
    index = np.where(words >= 0, words, np.where(padding, max_words + 1, max_words))
    out = np.empty((batch, rows, width), dtype=bool)
    for b in range(batch):  # per-text fancy indexing: ~5x faster than one take_along_axis over the batch
        np.take(visible_words[b], index[b], axis=1, out=out[b], mode="clip")  # "raise" would buffer `out`
    return out


def random_bits(rng: np.random.Generator, shape: tuple[int, ...], probability: float) -> np.ndarray:
    """bool array, each entry True with probability round(probability * 256) / 256, independently.

    Compares a random 8-bit number u with t = round(256 p) bit plane by bit plane, from the most significant
    bit, on packed bytes (8 entries per byte), and stops after t's last 1 bit: p = 0.5 costs one random bit
    per entry instead of a random byte or two.
    """
    threshold = min(256, max(0, round(probability * 256)))
    count = int(np.prod(shape))
    if threshold in (0, 256):
        return np.full(shape, threshold == 256)
    nbytes = -(-count // 8)
    less = np.zeros(nbytes, dtype=np.uint8)  # u < t decided so far
    equal = np.full(nbytes, 0xFF, dtype=np.uint8)  # u and t equal on the bits seen so far
    bit = 7
    while bit >= 0 and threshold & ((2 << bit) - 1):  # a 1 bit of t remains at or below this plane
        plane = rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]  # 3x faster than rng.bytes
        if threshold >> bit & 1:
            less |= equal & ~plane
            equal &= plane
        else:
            equal &= ~plane
        bit -= 1
    return np.unpackbits(less)[:count].view(bool).reshape(shape)


def corrupt(ids: np.ndarray, masked: np.ndarray, vocab: Vocabulary, rng: np.random.Generator,
            mask_prob: float = 0.8, random_prob: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """BERT's 80/10/10: (encoder input, MLM labels with -100 off the masked positions)."""
    labels = np.where(masked, ids, -100).astype(np.int64)
    draw = rng.random(ids.shape)
    corrupted = ids.astype(np.int64)
    corrupted[masked & (draw < mask_prob)] = vocab.mask_id
    swap = masked & (draw >= mask_prob) & (draw < mask_prob + random_prob)
    corrupted[swap] = rng.integers(0, vocab.size, size=int(swap.sum()))
    return corrupted, labels


def decoder_mask_pool(words: np.ndarray, num_words: np.ndarray, lengths: np.ndarray, pool_size: int,
                      hide_ratio: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The compact position-specific decoder mask of RetroMAE eq. (5): (dec_pool, dec_row).

    dec_pool: uint8 [B, P, ceil(L / 8)], bit-packed (little-endian bit order) visibility rows, 1 = visible.
    Each row hides whole words with probability `hide_ratio` among the ordinary tokens; [CLS] and [SEP] stay
    visible and padding is never visible. P = min(L, pool_size); a sample of length n uses its first
    min(n, pool_size) rows, as the official collator samples min(n, 256) masks per text.
    dec_row: int16 [B, L], the pool row each query position i reads (uniform over the sample's rows).
    The consumer also hides the diagonal (j == i) and j >= length: see kernels.reference.expand_decoder_mask.
    """
    batch, width = words.shape
    rows = min(width, pool_size)
    visible = visible_word_samples(words, num_words, lengths, rows, hide_ratio, rng)
    packed = np.packbits(visible, axis=2, bitorder="little")
    used_rows = np.minimum(lengths, rows)
    dec_row = (rng.random((batch, width)) * used_rows[:, None]).astype(np.int16)
    return packed, dec_row
