"""Collators and the compact decoder mask on real text: ratios, whole words, the eq. (5) rules, padding."""

import numpy as np
import pytest
import torch

from pretrieve.data.collators import DupMAECollator, MLMCollator, RetroMAECollator
from pretrieve.data.masking import ordinary_positions
from pretrieve.kernels.reference import expand_decoder_mask, two_stream_attention, unpack_pool


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
