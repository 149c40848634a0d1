"""Condenser (arXiv 2104.08253 §3.3-3.4, eqs. 6-11) and coCondenser (arXiv 2108.05540 §3.2-3.3, eqs. 6-7, 9,
11-12) written out in plain torch against the `condenser` and `cocondenser` heads and the span collator. Where the
code follows the released code instead of the paper (token means for the MLM terms, the late MLM term in
coCondenser's total), the tests check docs/methods.md's loss, which the released code matches.

The encoder is BERT computed layer by layer from its weights (tests/paper_math.py): the embeddings, the early states
after `skip_from` layers (eq. 6) and the late ones after all (eq. 7), the head's layers over [h^late_cls; h^early]
(eq. 8), the MLM head by hand (eqs. 9-10); the span contrastive loss L^co (eq. 6 of coCondenser) as a loop over the
spans and their candidates; GradCache (coCondenser's eqs. 9, 11-12) and two gloo ranks against one process over the
same spans.
"""

import math
import os
import socket

import numpy as np
import pytest
import torch

from paper_math import bert_layer, embed, hf_layer_weights, key_padding, mean_token_nll
from pretrieve.models.heads.cocondenser import span_contrastive_loss
from test_heads import tiny


def build(method, samples, vocab, **overrides):
    spec, options, model = tiny(method, **overrides)
    model.dropout = 0.0
    head = spec.build(options, model, seed=0).double().eval()
    return head, spec.collator.from_options(options, vocab, seed=0)(samples)


def condenser_by_hand(head, batch, skip_from):
    """Condenser's forward (eqs. 6-8) and MLM losses: (the late states, L_mlm of the head (eq. 9), L^c_mlm of the
    late states (eq. 10)), each a token mean."""
    encoder, heads = head.encoder, head.encoder.config.num_attention_heads
    visible = key_padding(batch["attention_mask"])
    h = embed(encoder, batch["input_ids"])  # embeddings
    for index, layer in enumerate(encoder.model.encoder.layer, start=1):
        h = bert_layer(h, h, visible, heads, hf_layer_weights(layer))
        if index == skip_from:
            early = h  # h^early
    late = h  # h^late
    x = torch.cat([late[:, :1], early[:, 1:]], dim=1)
    for layer in head.head.layers:  # the head over [h^late_cls; h^early]
        x = bert_layer(x, x, visible, heads, hf_layer_weights(layer))
    labels = batch["mlm_labels"]
    return late, mean_token_nll(encoder, x, labels), mean_token_nll(encoder, late, labels)  # the two MLM losses


@pytest.mark.parametrize("skip_from", [1, 2])
def test_condenser_loss_by_hand(skip_from, wiki_samples, vocab):
    """Condenser's L = L_mlm + L^c_mlm (eq. 11): the head over [h^late_cls; h^early] (eqs. 6-8) and its MLM loss
    (eq. 9), the late states' MLM loss (eq. 10), token means as the released code's."""
    head, batch = build("condenser", wiki_samples[:4], vocab, skip_from=skip_from)
    _, head_loss, late_loss = condenser_by_hand(head, batch, skip_from)
    out = head(batch)
    assert out["head"].item() == pytest.approx(head_loss.item(), rel=1e-10)  # eq. 9
    assert out["mlm"].item() == pytest.approx(late_loss.item(), rel=1e-10)  # eq. 10
    assert out["loss"].item() == pytest.approx((head_loss + late_loss).item(), rel=1e-10)  # eq. 11


def test_skip_from_defaults_to_half_the_layers_and_is_checked(vocab, wiki_samples):
    spec, options, model = tiny("condenser", skip_from="null")
    model.num_layers = 4
    assert spec.build(options, model).skip_from == 2
    spec, options, model = tiny("condenser", skip_from=3)
    with pytest.raises(ValueError, match="method.skip_from: 3 is not a layer of this 2-layer encoder"):
        spec.build(options, model)


def span_contrastive_by_loops(reps, pad):
    """coCondenser's eq. 6 for every real span ij:
    -log exp(<h_ij, h_ij'>) / sum_{kl != ij, kl real} exp(<h_ij, h_kl>)."""
    losses = []
    for a in range(len(reps)):
        if pad[a]:
            continue
        candidates = [c for c in range(len(reps)) if c != a and not pad[c]]
        log_z = math.log(sum(math.exp(float(reps[a] @ reps[c])) for c in candidates))
        losses.append(log_z - float(reps[a] @ reps[a ^ 1]))
    return losses


def test_span_contrastive_loss_by_loops():
    """coCondenser's L^co_ij (eq. 6) summed over a batch's real spans, and over one rank's rows of it."""
    torch.manual_seed(0)
    reps = torch.randn(10, 6, dtype=torch.float64)
    pad = torch.tensor([False] * 8 + [True] * 2)  # a stream pad sample's two spans
    by_hand = span_contrastive_by_loops(reps, pad)
    assert span_contrastive_loss(reps, pad, 0, 10).item() == pytest.approx(sum(by_hand), rel=1e-12)
    # this rank's rows 4..7 of the gathered batch: their four terms
    assert span_contrastive_loss(reps, pad, 4, 4).item() == pytest.approx(sum(by_hand[4:8]), rel=1e-12)


def test_cocondenser_total_loss_by_hand(wiki_samples, vocab):
    """coCondenser's total: the mean of eq. 6 over the real spans (eq. 7's 1/2n) plus the head's (eq. 5) and the
    late layers' (Condenser's eq. 10) MLM losses as token means, the released code's form of eq. 7."""
    samples = wiki_samples[:4] + [dict(wiki_samples[4], pad=True)]
    head, batch = build("cocondenser", samples, vocab, grad_cache="null")
    late, head_loss, late_loss = condenser_by_hand(head, batch, 1)
    co = span_contrastive_by_loops(late[:, 0].detach(), batch["pad"])
    out = head(batch)
    assert len(co) == 8 and batch["pad"].tolist() == [False] * 8 + [True] * 2
    assert out["co"].item() == pytest.approx(sum(co) / len(co), rel=1e-10)
    assert out["head"].item() == pytest.approx(head_loss.item(), rel=1e-10)
    assert out["mlm"].item() == pytest.approx(late_loss.item(), rel=1e-10)
    assert out["loss"].item() == pytest.approx(head_loss.item() + late_loss.item() + sum(co) / len(co), rel=1e-10)


def test_span_collator_cuts_two_disjoint_spans_of_each_block(wiki_samples, vocab):
    spec, options, _ = tiny("cocondenser", span_len=40)
    samples = wiki_samples[:6] + [dict(wiki_samples[6], ids=wiki_samples[6]["ids"][:1])]
    collate = spec.collator.from_options(options, vocab, seed=0)
    batch = collate(samples)
    assert batch["input_ids"].shape[0] == 2 * len(samples)
    first_pair = []
    for i, sample in enumerate(samples):
        ids, pieces = np.asarray(sample["ids"]), []
        for row in (2 * i, 2 * i + 1):
            n = int(batch["attention_mask"][row].sum())
            labels, inputs = batch["mlm_labels"][row, 1:n - 1], batch["input_ids"][row, 1:n - 1]
            piece = torch.where(labels != -100, labels, inputs).numpy()  # the span before masking
            assert 1 <= len(piece) <= 40
            starts = [s for s in range(len(ids) - len(piece) + 1) if np.array_equal(ids[s:s + len(piece)], piece)]
            assert starts, (i, row)
            pieces.append((starts[0], starts[0] + len(piece)))
        (a, b), (c, d) = sorted(pieces)
        assert b <= c or len(ids) == 1  # disjoint windows of the block
        first_pair.append(pieces[0])
    assert collate(samples)["input_ids"].equal(batch["input_ids"])  # a pure function of the samples
    again = spec.collator.from_options(options, vocab, seed=1)(samples)
    assert not again["input_ids"].equal(batch["input_ids"])


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_grad_cache_gives_the_one_graph_loss_and_gradients(dropout, wiki_samples, vocab):
    """GradCache (coCondenser §3.3: v_ij = dL^co/dh_ij cached, eq. 9; each chunk back-propagated with it, eqs.
    11-12) in chunks of 3 spans equals the same chunks under one graph (dropout masks drawn per chunk); without
    dropout it also equals one pass over the whole batch: the MLM terms are normalised once."""
    results = {}
    for variant in ("whole", "one graph", "cache"):
        spec, options, model = tiny("cocondenser", grad_cache="null" if variant == "whole" else "{chunk: 3}")
        model.dropout = dropout
        head = spec.build(options, model, seed=0).double().train()
        head.grad_cache = variant == "cache"
        batch = spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
        torch.manual_seed(5)
        out = head(batch)
        out["loss"].backward()
        results[variant] = (out, {n: p.grad for n, p in head.named_parameters() if p.requires_grad})
    pairs = [("one graph", "cache")] + ([("whole", "cache")] if dropout == 0 else [])
    for a, b in pairs:
        for part in ("loss", "head", "mlm", "co"):
            assert results[a][0][part].item() == pytest.approx(results[b][0][part].item(), rel=1e-10), (a, b, part)
        for name, grad in results[a][1].items():
            torch.testing.assert_close(results[b][1][name], grad, rtol=1e-8, atol=1e-12, msg=name)


def _two_ranks(rank, port, reps, pad, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from pretrieve.models.infonce import gather_candidates

        mine = reps[rank * 4:rank * 4 + 4].clone().requires_grad_(True)
        everyone, first = gather_candidates(mine)
        loss = span_contrastive_loss(everyone, gather_candidates(pad[rank * 4:rank * 4 + 4])[0], first, 4)
        loss.backward()
        results[rank] = (loss.item(), mine.grad.clone())
    finally:
        dist.destroy_process_group()


# two spawned gloo processes, seconds to start: make test-system
@pytest.mark.system
def test_cross_rank_negatives_are_the_one_process_batch():
    """Two gloo ranks of two documents (four spans) each, gathered: the ranks' sums of eq. 6 add up to the
    one-process sum over all eight spans (every other span of the global batch a candidate), and each rank's
    gradients are that sum's for its own spans."""
    import torch.multiprocessing as mp

    torch.manual_seed(2)
    reps, pad = torch.randn(8, 6, dtype=torch.float64), torch.tensor([False] * 6 + [True] * 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_two_ranks, args=(port, reps, pad, results), nprocs=2, join=True, start_method="spawn")
    whole = reps.clone().requires_grad_(True)
    total = span_contrastive_loss(whole, pad, 0, 8)
    total.backward()
    assert results[0][0] + results[1][0] == pytest.approx(total.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]), whole.grad)


def test_cocondenser_counts_each_block_once_though_it_is_two_spans(wiki_samples, vocab):
    """A sample is a block: the run's samples seen (the card's, MLflow's samples_per_s) count blocks, not the
    two span rows each block becomes."""
    from pretrieve.pretrain import count_texts

    spec, options, _ = tiny("cocondenser")
    collate = spec.collator.from_options(options, vocab, seed=0)
    batch = collate(wiki_samples[:4])
    samples, tokens, positions = getattr(collate, "count", count_texts)(batch)  # as the pre-training job counts
    assert len(batch["input_ids"]) == 8 and samples == 4
    assert (tokens, positions) == (int(batch["attention_mask"].sum()), batch["attention_mask"].numel())
