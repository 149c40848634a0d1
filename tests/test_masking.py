"""Collators and the compact decoder mask on real text: ratios, whole words, the eq. (5) rules, padding."""

import random

import numpy as np
import pytest
import torch

from benchmarks.hf_whole_word import hf_whole_word_mask
from pretrieve.data.collators import MLMCollator
from pretrieve.data.masking import ordinary_positions, word_ids
from pretrieve.kernels.reference import expand_decoder_mask, two_stream_attention, unpack_pool
from pretrieve.models.heads.bow import BoWCollator
from pretrieve.models.heads.dupmae import DupMAECollator
from pretrieve.models.heads.lexmae import LexMAECollator
from pretrieve.models.heads.retromae import RetroMAECollator
from pretrieve.models.heads.simlm import SimLMCollator


def _whole_words_hold(ids, lengths, state, vocab):
    """Every "##" piece has the same state as the token before it; `state` is [B, L] or [B, rows, L]."""
    cont = vocab.continuation[ids] & ordinary_positions(lengths, ids.shape[1])
    cont[:, 1] = False  # a block may begin mid-word
    b, j = np.nonzero(cont)
    state = state if state.ndim == 3 else state[:, None, :]
    return np.array_equal(state[b, :, j], state[b, :, j - 1])


@pytest.mark.parametrize("ratio", [0.15, 0.30])
def test_encoder_masking_ratio_whole_words_specials(wiki_samples, vocab, ratio):
    batch = MLMCollator(vocab, max_len=512, mlm_ratio=ratio, seed=3)(wiki_samples)
    ids = torch.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"]).numpy()
    lengths = batch["attention_mask"].sum(1).numpy()
    masked = (batch["mlm_labels"] != -100).numpy()
    ordinary = ordinary_positions(lengths, ids.shape[1])
    assert not (masked & ~ordinary).any()  # never [CLS], [SEP] or padding
    per_row = masked.sum(1) / (lengths - 2)
    assert (masked.sum(1) <= np.maximum(1, np.rint(ratio * (lengths - 2)))).all()  # within the budget
    assert abs(per_row.mean() - ratio) < 0.01
    assert _whole_words_hold(ids, lengths, masked, vocab)


def test_80_10_10(wiki_samples, vocab):
    labels, inputs = [], []
    for seed in range(6):
        batch = MLMCollator(vocab, mlm_ratio=0.3, seed=seed)(wiki_samples)
        keep = batch["mlm_labels"] != -100
        labels.append(batch["mlm_labels"][keep])
        inputs.append(batch["input_ids"][keep])
    labels, inputs = torch.cat(labels), torch.cat(inputs)
    n = len(labels)
    assert n > 50_000
    as_mask = (inputs == vocab.mask_id).float().mean().item()
    unchanged = (inputs == labels).float().mean().item()
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01
    assert abs(1 - as_mask - unchanged - 0.1) < 0.01  # random replacements


def test_decoder_pool_rules(wiki_samples, vocab):
    batch = RetroMAECollator(vocab, max_len=512, seed=5)(wiki_samples[:16])
    lengths = batch["attention_mask"].sum(1)
    width = batch["input_ids"].shape[1]
    pool_rows = batch["dec_pool"].shape[1]
    assert pool_rows == min(width, 256)
    pool = unpack_pool(batch["dec_pool"], width).numpy()
    ids, n = batch["dec_input_ids"].numpy(), lengths.numpy()
    for b in range(len(n)):
        used = pool[b, :min(n[b], 256)]
        assert used[:, 0].all() and used[:, n[b] - 1].all()  # [CLS] and [SEP] always in the pool rows
        assert not used[:, n[b]:].any()  # padding never
        visible = used[:, 1:n[b] - 1].mean()
        assert abs(visible - 0.5) < 0.03, visible
    assert _whole_words_hold(ids, lengths.numpy(), pool, vocab)
    assert (batch["dec_row"].long() < torch.clamp(lengths, max=256)[:, None]).all()

    mask = expand_decoder_mask(batch)
    eye = torch.eye(width, dtype=torch.bool)
    assert not mask[:, eye].any()  # the diagonal: no token sees itself
    for b in range(len(n)):
        assert mask[b, 1:, 0].all() and not mask[b, 0, 0]  # position 0 visible to every row but its own
        assert not mask[b, :, n[b]:].any()  # keys beyond the length
        assert mask[b].any(dim=1).all()  # every row, padding rows included, sees something


def test_mask_bytes_per_sample(wiki_samples, vocab):
    long = [s for s in wiki_samples if len(s["ids"]) == 510][:4]
    batch = RetroMAECollator(vocab, max_len=512)(long)
    assert batch["input_ids"].shape[1] == 512
    per_sample = (batch["dec_pool"].numel() * 1 + batch["dec_row"].numel() * 2) / len(long)
    assert per_sample <= 512 * 512 * 8 / 64


def test_compact_mask_equals_official_dense_mask(wiki_samples, vocab):
    """The official collator builds each row as a copy of a sampled pool mask with its own position set to
    masked; rebuild that L x L mask row by row and compare, then compare eq. (3) against it."""
    batch = RetroMAECollator(vocab, max_len=128, seed=9)(wiki_samples[:4])
    width = batch["input_ids"].shape[1]
    pool = unpack_pool(batch["dec_pool"], width)
    lengths = batch["attention_mask"].sum(1)
    dense = torch.zeros(len(lengths), width, width, dtype=torch.bool)
    for b in range(len(lengths)):
        for i in range(width):
            row = pool[b, int(batch["dec_row"][b, i])].clone()
            row[i] = False
            row[int(lengths[b]):] = False
            dense[b, i] = row
    assert torch.equal(expand_decoder_mask(batch), dense)

    torch.manual_seed(0)
    q, k, v = (torch.randn(len(lengths), 2, width, 16, dtype=torch.float64) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / 4.0 + torch.where(dense[:, None], 0.0, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v
    got = two_stream_attention(q, k, v, batch["dec_pool"], batch["dec_row"], lengths)
    torch.testing.assert_close(got, expected)


def test_batches_are_pure_functions_of_their_samples(wiki_samples, vocab):
    collate = DupMAECollator(vocab, max_len=128, seed=1)
    a, b = collate(wiki_samples[:8]), collate(wiki_samples[:8])
    assert all(torch.equal(a[k], b[k]) for k in a)
    next_epoch = [dict(s, epoch=s["epoch"] + 1) for s in wiki_samples[:8]]
    assert not torch.equal(collate(next_epoch)["mlm_labels"], a["mlm_labels"])


def test_pad_samples_carry_no_targets(wiki_samples, vocab):
    samples = [dict(s, pad=(i % 2 == 1)) for i, s in enumerate(wiki_samples[:6])]
    batch = DupMAECollator(vocab, max_len=128)(samples)
    pads = torch.tensor([s["pad"] for s in samples])
    for key in ("mlm_labels", "dec_labels", "bow_targets"):
        assert (batch[key][pads] == -100).all() and (batch[key][~pads] != -100).any(), key


def test_bow_targets_are_the_unique_ordinary_tokens(wiki_samples, vocab):
    batch = DupMAECollator(vocab, max_len=64)(wiki_samples[:3])
    for row, sample in enumerate(wiki_samples[:3]):
        expected = sorted(set(sample["ids"][:62].tolist()))
        got = batch["bow_targets"][row]
        assert got[got != -100].tolist() == expected


@pytest.mark.parametrize("probability", [0.5, 0.3, 0.85])
def test_random_bits_rate(probability):
    from pretrieve.data.masking import random_bits

    bits = random_bits(np.random.default_rng(0), (400, 1001), probability)  # not a multiple of 8
    assert bits.shape == (400, 1001) and bits.dtype == bool
    assert abs(bits.mean() - round(probability * 256) / 256) < 0.003  # ~4 standard deviations
    assert abs(bits[:, :500].mean() - bits[:, 500:].mean()) < 0.006  # no drift along the packed bytes


def _budget(lengths, ratio):
    return np.maximum(1, np.rint(ratio * lengths)).astype(np.int64)


@pytest.mark.parametrize("max_len,ratio", [(64, 0.15), (512, 0.15), (512, 0.30)])
def test_whole_words_fill_the_budget_as_hf_does(wiki_samples, vocab, max_len, ratio):
    """A word that would overflow the budget is skipped and the draw goes on: every text is filled exactly, as by
    HF's collator on the same texts, and no word left unmasked would still fit what the budget has left."""
    batch = MLMCollator(vocab, max_len=max_len, mlm_ratio=ratio, seed=3)(wiki_samples)
    lengths = batch["attention_mask"].sum(1).numpy()
    ids = torch.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"]).numpy()
    masked = (batch["mlm_labels"] != -100).numpy()
    budget = _budget(lengths - 2, ratio)
    filled = masked.sum(1) == budget

    draw, specials = random.Random(0), set(vocab.tokens[i] for i in np.flatnonzero(vocab.special))
    # HF's draw as the released Condenser collator calls it: on the text's own tokens, special tokens skipped
    hf = [sum(hf_whole_word_mask([vocab.tokens[t] for t in row[1:n - 1]], ratio, specials, draw))
          for row, n in zip(ids, lengths)]
    hf_filled = np.array(hf) == budget
    assert hf_filled.all() and filled.mean() == hf_filled.mean()

    words, _ = word_ids(ids, lengths, vocab)
    for row in range(len(ids)):
        size = np.bincount(words[row][words[row] >= 0])
        left = np.unique(words[row][(words[row] >= 0) & ~masked[row]])
        assert (size[left] > budget[row] - masked[row].sum()).all()


def test_a_word_longer_than_the_budget_drawn_first_is_skipped(vocab):
    """One 17-piece word among 20 one-token words, a budget of 6: whatever the order of the draw, every row masks
    6 tokens of the short words (stopping at the first word that overflows left a row drawn that way empty)."""
    text = vocab.backend.encode("pneumonoultramicroscopicsilicovolcanoconiosis " + "the cat sat on a mat " * 3
                                + "and dog", add_special_tokens=False).ids
    assert len(text) == 37
    for seed in range(4):
        batch = MLMCollator(vocab, mlm_ratio=0.15, seed=seed)([{"ids": np.array(text)}] * 256)
        masked = (batch["mlm_labels"] != -100).numpy()
        assert (masked.sum(1) == 6).all() and not masked[:, 1:18].any()


UNK_TEXT = "the cat \u2603 sat on the \U0001F600 mat near the \u2603 dog " * 4


@pytest.mark.parametrize("collator,keys", [(MLMCollator, ["mlm_labels"]), (BoWCollator, ["mlm_labels"]),
                                           (RetroMAECollator, ["mlm_labels"]), (SimLMCollator, ["mlm_labels", "dec_masked"]),
                                           (LexMAECollator, ["mlm_labels", "dec_labels"])])
def test_no_special_token_is_ever_masked(vocab, collator, keys):
    """A text with [UNK]s: no encoder or decoder mask ever holds one, as HF's and the released collators' masks
    never do, and the budget is filled with the other words."""
    ids = np.array(vocab.backend.encode(UNK_TEXT, add_special_tokens=False).ids)
    unk = vocab.backend.token_to_id("[UNK]")
    assert (ids == unk).sum() == 12
    collate = collator(vocab, mlm_ratio=0.6, seed=0)
    batch = collate([{"ids": ids}] * 64)
    at_unk = np.zeros(batch["input_ids"].shape, dtype=bool)
    at_unk[:, 1:len(ids) + 1] = ids == unk
    for key in keys:
        marked = batch[key].numpy()
        marked = marked if marked.dtype == bool else marked != -100
        assert marked.any() and not marked[at_unk].any(), key
    masked = (batch["mlm_labels"] != -100).numpy().sum(1)
    assert (masked == _budget(np.full(64, len(ids) + (2 if collator.budget_counts_cls_sep else 0)), 0.6)).all()
    if collator is RetroMAECollator:  # its decoder's attention hides an [UNK] like a word, as the released mask
        width = batch["input_ids"].shape[1]
        assert not unpack_pool(batch["dec_pool"], width).numpy()[:, :, at_unk[0]].all()


def test_the_budget_counts_cls_and_sep_where_the_released_collator_does(wiki_samples, vocab):
    """bowdpr, RetroMAE and SimLM mask a text holding [CLS] and [SEP] with round(p x all its tokens); Condenser,
    coCondenser and CoT-MAE mask the text before adding them."""
    for collator, counted in ((BoWCollator, 2), (RetroMAECollator, 2), (SimLMCollator, 2), (MLMCollator, 0)):
        batch = collator(vocab, max_len=128, mlm_ratio=0.3, seed=1)(wiki_samples)
        lengths = batch["attention_mask"].sum(1).numpy()
        masked = (batch["mlm_labels"] != -100).numpy().sum(1)
        assert (masked == _budget(lengths - 2 + counted, 0.3)).all(), collator.__name__
