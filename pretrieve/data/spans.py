"""COSTA's multi-granularity span sampling (the COSTA paper §3.2, eqs. 1-3; settings of §4.5.1).

For each level a span length is drawn from Beta(alpha, beta) scaled to the level's [min, max] token lengths
(max capped by the text's length), and a start uniformly among the positions where it fits. The word level
takes one whole WordPiece word instead, never a stopword (NLTK's English list) nor a word without a letter
or digit. Spans are (start, end) token positions in the collated layout ([CLS] at 0), end exclusive;
(-1, -1) marks a level a text is too short for.
"""

from __future__ import annotations

import numpy as np

from pretrieve.data.masking import Vocabulary

# (min, max) span lengths in tokens; None = one whole word (§4.5.1).
LEVELS: dict[str, tuple[int, int] | None] = {"word": None, "phrase": (4, 16), "sentence": (16, 64),
                                              "paragraph": (64, 128)}

# NLTK's English stopword list.
STOPWORDS = frozenset("""
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself yourselves he him his
himself she she's her hers herself it it's its itself they them their theirs themselves what which who whom
this that that'll these those am is are was were be been being have has had having do does did doing a an the
and but if or because as until while of at by for with about against between into through during before after
above below to from up down in out on off over under again further then once here there when where why how all
any both each few more most other some such no nor not only own same so than too very s t can will just don
don't should should've now d ll m o re ve y ain aren aren't couldn couldn't didn didn't doesn doesn't hadn
hadn't hasn hasn't haven haven't isn isn't ma mightn mightn't mustn mustn't needn needn't shan shan't shouldn
shouldn't wasn wasn't weren weren't won won't wouldn wouldn't
""".split())


def word_candidates(vocab: Vocabulary) -> np.ndarray:
    """bool [vocab]: a one-token word with this token may be sampled at word level, and is a bag-of-words target
    (data/llama2vec.py). Tokens are judged by the text they decode to, without surrounding spaces, so RoBERTa's
    "Ġthe" is a stopword too, and a byte-level ".Ċ" (".\n"), "âĢĶ" ("—") or "Â°" ("°") has no letter or digit;
    nor has a token holding only part of a character's bytes (it decodes to U+FFFD): a piece of a character is
    not a word."""
    ordinary = np.array([text.strip().lower() not in STOPWORDS and any(c.isalnum() for c in text)
                         and not (t.startswith("[") and t.endswith("]"))
                         for t, text in zip(vocab.tokens, token_texts(vocab))], dtype=bool)
    return ordinary & ~vocab.special


def token_texts(vocab: Vocabulary) -> list[str]:
    """The text each token stands for, by the tokenizer's decoder (byte-level BPE stores bytes as printable
    stand-ins: a newline is "Ċ"; SentencePiece's byte fallback stores "<0x0A>"); the stored strings without a
    decoder."""
    decoder = getattr(vocab.backend, "decoder", None)
    if decoder is None:
        return list(vocab.tokens)
    backend = vocab.backend
    return [decoder.decode([backend.id_to_token(i)]) for i in range(vocab.size)]


def sample_spans(ids: np.ndarray, lengths: np.ndarray, words: np.ndarray, vocab: Vocabulary,
                 candidate_token: np.ndarray, rng: np.random.Generator, spans_per_level: int = 5,
                 alpha: float = 4.0, beta: float = 2.0, levels: dict = LEVELS) -> np.ndarray:
    """int64 [B, levels x spans_per_level, 2] span bounds; `words` from masking.word_ids."""
    batch = len(lengths)
    tokens = lengths - 2  # ordinary tokens at positions 1 .. length-2
    out = np.full((batch, len(levels) * spans_per_level, 2), -1, dtype=np.int64)
    for level, bounds in enumerate(levels.values()):
        cols = slice(level * spans_per_level, (level + 1) * spans_per_level)
        if bounds is None:
            out[:, cols] = _word_spans(ids, words, vocab, candidate_token, rng, spans_per_level)
            continue
        low, high = bounds
        upper = np.minimum(high, tokens)[:, None]
        fraction = rng.beta(alpha, beta, size=(batch, spans_per_level))
        length = np.minimum(low + np.floor(fraction * (upper - low + 1)).astype(np.int64), upper)
        start = 1 + np.floor(rng.random((batch, spans_per_level)) * (tokens[:, None] - length + 1)).astype(np.int64)
        fits = tokens[:, None] >= low
        out[:, cols, 0] = np.where(fits, start, -1)
        out[:, cols, 1] = np.where(fits, start + length, -1)
    return out


def _word_spans(ids, words, vocab, candidate_token, rng, count) -> np.ndarray:
    batch, width = ids.shape
    spans = np.full((batch, count, 2), -1, dtype=np.int64)
    starts = (words >= 0) & ~vocab.continuation[ids]
    starts[:, 1] = words[:, 1] >= 0
    single = starts & ~np.concatenate([vocab.continuation[ids[:, 1:]] & (words[:, 1:] >= 0),
                                       np.zeros((batch, 1), dtype=bool)], axis=1)
    # a multi-piece word is never a stopword; a one-piece word must be a candidate token
    eligible = starts & (~single | candidate_token[ids])
    for b in range(batch):
        positions = np.flatnonzero(eligible[b])
        if len(positions) == 0:
            continue
        chosen = rng.choice(positions, size=count, replace=len(positions) < count)
        spans[b, :, 0], spans[b, :, 1] = chosen, _word_ends(words[b], words[b, chosen])
    return spans


def _word_ends(row_words: np.ndarray, word: np.ndarray) -> np.ndarray:
    """End (exclusive) of each word index: one past its last position."""
    last = np.full(row_words.max(initial=-1) + 2, -1, dtype=np.int64)
    positions = np.flatnonzero(row_words >= 0)
    last[row_words[positions]] = positions  # later positions overwrite: the last piece wins
    return last[word] + 1
