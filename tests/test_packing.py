"""Packing invariants: no block over the limit; blocks partition the document in order."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pretrieve.data.packing import pack_sentences, sentence_starts, sentence_token_bounds


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40), max_tokens=st.integers(1, 50),
       short_seq_prob=st.sampled_from([0.0, 0.1, 1.0]), seed=st.integers(0, 2**16))
def test_blocks_partition_document_and_respect_limit(lengths, max_tokens, short_seq_prob, seed):
    ends = np.cumsum(lengths)
    blocks = pack_sentences(ends, max_tokens, short_seq_prob, np.random.default_rng(seed))
    assert all(0 < b - a <= max_tokens for a, b in blocks)
    assert [a for a, _ in blocks] == [0] + [b for _, b in blocks[:-1]]  # contiguous, in order
    assert blocks[-1][1] == ends[-1]  # every token once
    if short_seq_prob == 0.0:  # full-length targets: a block ends at a sentence end unless a sentence was cut
        boundaries = set(ends.tolist())
        for a, b in blocks[:-1]:
            assert b in boundaries or b - a == max_tokens


def test_greedy_fills_blocks():
    assert pack_sentences(np.array([3, 6, 9, 12]), 7) == [(0, 6), (6, 12)]
    # an over-long sentence is cut; its remnant shares a block with the next sentence
    assert pack_sentences(np.array([10, 12]), 4) == [(0, 4), (4, 8), (8, 12)]


def test_sentence_boundaries_follow_tokens():
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    text = 'He left. "Then what?" she asked.\nA new paragraph (with 3 words). e.g. lower case stays.'
    starts = sentence_starts(text)
    assert [text[s:s + 5] for s in starts] == ['"Then', "A new"]  # not before "she" (lower case), nor "e.g."
    enc = load_backend(DEFAULT_TOKENIZER).encode(text, add_special_tokens=False)
    ends = sentence_token_bounds(enc, starts)
    pieces = np.split(np.array(enc.tokens), ends[:-1])
    assert [" ".join(p[:2]) for p in pieces] == ['he left', '" then', 'a new']
    assert ends[-1] == len(enc.ids)


def test_sentence_bounds_match_token_offsets():
    """Sentence starts map to the first token at or after them, also where the start character is dropped by
    normalization (the NULs below), on short and long real documents (both lookup strategies)."""
    from support import SAMPLES

    from pretrieve.data.corpora import read_corpus
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    texts = [doc.text for doc in read_corpus("wikipedia", [SAMPLES / "wikipedia"])][:10]
    texts += [doc.text for doc in read_corpus("books", [SAMPLES / "books"])]
    assert max(len(sentence_starts(text)) for text in texts) > 800  # a book takes the offsets path
    texts.append("One line.\n\x00Two starts with NUL.\n\x07\x00Three.")
    backend = load_backend(DEFAULT_TOKENIZER)
    for text, enc in zip(texts, backend.encode_batch(texts, add_special_tokens=False)):
        starts = sentence_starts(text)
        token_starts = np.array([o[0] for o in enc.offsets])
        expected = np.unique(np.searchsorted(token_starts, starts))
        expected = np.append(expected[(expected > 0) & (expected < len(enc))], len(enc))
        np.testing.assert_array_equal(sentence_token_bounds(enc, starts), expected)
