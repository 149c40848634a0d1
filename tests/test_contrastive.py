"""The contrastive method: its collator, InfoNCE with in-batch, symmetric and the pairs' own negatives against
the formula written out by hand, false-negative masking and its counts, the learnt temperature, and GradCache
in one process (the DeepSpeed and multi-rank equalities: tests/test_grad_cache.py)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrieve.config import load_config
from pretrieve.models.heads.contrastive import ContrastiveCollator, ContrastiveOptions, PairMeta, pair_loss
from pretrieve.pretrain_config import method_options, model_options

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def tiny_contrastive(**overrides):
    config = load_config(CONFIGS / "tiny-contrastive.yaml", [f"method.{k}={v}" for k, v in overrides.items()])
    method, options = method_options(config)
    return method, options, model_options(config)


def pair_samples(n: int, negs: int = 0, seed: int = 0) -> list[dict]:
    """Hand-built pair-stream samples: random token ids, one document per pair."""
    rng = np.random.default_rng(seed)
    ids = lambda: rng.integers(2000, 9000, size=int(rng.integers(3, 20)))  # noqa: E731
    return [{"query": ids(), "pos": ids(), "negs": [ids() for _ in range(negs)], "source": "t", "doc": f"d{i}",
             "epoch": 0, "shard": 0, "index": i} for i in range(n)]


def test_collator_pairs_negatives_and_hashes(vocab):
    samples = pair_samples(3, negs=1)
    samples[1]["pos"] = samples[0]["pos"].copy()  # the same passage text twice
    samples[2]["negs"] = []  # fewer negatives than asked
    samples[2]["doc"] = "d0"
    samples[2]["pad"] = True
    batch = ContrastiveCollator(vocab, max_len=16, query_max_len=8, negatives=2)(samples)
    assert batch["q_input_ids"].shape[1] <= 8 and batch["p_input_ids"].shape[1] <= 16
    for prefix, texts in (("q", [s["query"] for s in samples]), ("p", [s["pos"] for s in samples])):
        ids, mask = batch[f"{prefix}_input_ids"], batch[f"{prefix}_attention_mask"]
        for row, text in enumerate(texts):
            n = int(mask[row].sum())
            assert ids[row, 0] == vocab.cls_id and ids[row, n - 1] == vocab.sep_id
            assert ids[row, 1:n - 1].tolist() == list(text[:n - 2])
            assert (ids[row, n:] == vocab.pad_id).all()
    assert batch["n_input_ids"].shape[0] == 6
    assert batch["n_valid"].tolist() == [True, False, True, False, False, False]
    assert batch["p_hash"][0] == batch["p_hash"][1] != batch["p_hash"][2]
    assert batch["doc_hash"][0] == batch["doc_hash"][2] != batch["doc_hash"][1]
    assert batch["pad"].tolist() == [False, False, True]
    assert ContrastiveCollator.count(batch)[0] == 3


def _by_hand(q, d, temperature, q_docs, d_docs, d_texts, q_texts, symmetric, margin=None, d_off=()):
    """The loss written out with loops: q->d over every passage but the masked ones, and d->q."""
    def cos(a, b):
        return float(a @ b / (a.norm() * b.norm()))

    def direction(anchors, candidates, a_docs, c_docs, c_texts, a_texts_pos, off):
        total, masked = 0.0, {"masked_text": 0, "masked_doc": 0, "masked_margin": 0}
        for i, a in enumerate(anchors):
            pos = cos(a, candidates[i])
            denominator = 0.0
            for j, c in enumerate(candidates):
                s = cos(a, c)
                if j != i:
                    if j in off:
                        continue
                    if c_texts[j] == a_texts_pos[i]:
                        masked["masked_text"] += 1
                        continue
                    if c_docs[j] is not None and c_docs[j] == a_docs[i]:
                        masked["masked_doc"] += 1
                        continue
                    if margin is not None and s > pos + margin:
                        masked["masked_margin"] += 1
                        continue
                denominator += math.exp(s / temperature)
            total += -math.log(math.exp(pos / temperature) / denominator)
        return total / len(anchors), masked

    qd, masked = direction(q, d, q_docs, d_docs, d_texts, d_texts, set(d_off))
    if not symmetric:
        return qd, masked
    dq, more = direction(d[:len(q)], q, q_docs, q_docs, q_texts, q_texts, set())
    return (qd + dq) / 2, {k: masked[k] + more[k] for k in masked}


@pytest.mark.parametrize("symmetric", [False, True])
def test_loss_equals_the_formula_with_masks_and_counts(symmetric):
    torch.manual_seed(0)
    b, negs = 4, 1
    q = torch.randn(b, 6, dtype=torch.float64)
    d = torch.randn(b + b * negs, 6, dtype=torch.float64)  # positives, then one negative per pair
    d[5] = d[1]  # pair 1's negative has pair 1's own positive text: masked for pair 1, not a false negative of 0
    q_docs, d_docs = [10, 11, 10, 12], [10, 11, 10, 12, None, None, None, None]  # pairs 0 and 2 share a document
    d_texts = [100, 101, 102, 103, 104, 101, 106, 107]
    q_texts = [200, 201, 202, 203]
    d_off = (7,)  # pair 3 has no negative
    options = ContrastiveOptions(temperature=0.1, symmetric=symmetric, negatives=1)
    meta = PairMeta(torch.tensor(q_texts), torch.tensor(q_docs), torch.zeros(b, dtype=torch.bool),
                    torch.tensor(d_texts), torch.tensor([-1 if x is None else x for x in d_docs]),
                    torch.tensor([i in d_off for i in range(8)]))
    qn, dn = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(d, dim=-1)
    out = pair_loss(qn[:b], dn[:b], meta, 0, 0, torch.tensor(10.0, dtype=torch.float64), options, qn, dn)
    expected, masked = _by_hand(q, d, 0.1, q_docs, d_docs, d_texts, q_texts, symmetric, d_off=d_off)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-9)
    assert {k: int(out[k]) for k in masked} == masked
    assert masked["masked_text"] >= 1 and masked["masked_doc"] >= 2  # the masks were exercised
    # the margin filter: every candidate above the positive by more than 0.05 is left out, and counted
    options = ContrastiveOptions(temperature=0.1, symmetric=symmetric, negatives=1, mask_margin=0.05)
    out = pair_loss(qn[:b], dn[:b], meta, 0, 0, torch.tensor(10.0, dtype=torch.float64), options, qn, dn)
    expected, masked = _by_hand(q, d, 0.1, q_docs, d_docs, d_texts, q_texts, symmetric, margin=0.05, d_off=d_off)
    assert out["loss"].item() == pytest.approx(expected, rel=1e-9)
    assert {k: int(out[k]) for k in masked} == masked and masked["masked_margin"] > 0


def test_pad_samples_are_neither_anchors_nor_candidates():
    torch.manual_seed(1)
    q, d = torch.randn(3, 4), torch.randn(3, 4)
    options = ContrastiveOptions(temperature=0.5, normalize=False)
    meta = lambda pad: PairMeta(torch.arange(len(pad)), torch.arange(len(pad)), pad,  # noqa: E731
                                torch.arange(len(pad)) + 5, torch.arange(len(pad)), pad)
    scale = torch.tensor(2.0)
    padded = pair_loss(q, d, meta(torch.tensor([False, False, True])), 0, 0, scale, options, q, d)
    alone = pair_loss(q[:2], d[:2], meta(torch.zeros(2, dtype=torch.bool)), 0, 0, scale, options, q[:2], d[:2])
    assert padded["loss"].item() == pytest.approx(alone["loss"].item(), rel=1e-6)


@pytest.mark.parametrize("symmetric", [False, True])
def test_ranks_with_uneven_anchors_average_to_the_global_mean(symmetric):
    """An epoch's tail: 15 pairs on 2 ranks of 8, the second rank's last sample a pad (a copy of a real pair).
    The ranks' losses and accuracies, averaged as DeepSpeed and the engine average them, are the 15 pairs' mean
    on one rank, not the mean of the ranks' means ((1/8 + 1/7) / 2 instead of 2/15). The pad's row masks its twin
    as a false negative of the same text, which is not counted."""
    torch.manual_seed(2)
    q = torch.nn.functional.normalize(torch.randn(16, 8, dtype=torch.float64), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(16, 8, dtype=torch.float64), dim=-1)
    q[15], d[15] = q[3], d[3]  # the stream's pad repeats a real pair
    text, pad = torch.arange(16), torch.zeros(16, dtype=torch.bool)
    text[15], pad[15] = 3, True
    meta = PairMeta(text + 100, torch.arange(16), pad, text, torch.arange(16), pad)
    options, scale = ContrastiveOptions(temperature=0.1, symmetric=symmetric), torch.tensor(10.0, dtype=torch.float64)
    ranks = [pair_loss(q[r * 8:r * 8 + 8], d[r * 8:r * 8 + 8], meta, r * 8, r * 8, scale, options, q, d, world_size=2)
             for r in (0, 1)]
    one = pair_loss(q[:15], d[:15], PairMeta(*(t[:15] for t in (text + 100, torch.arange(16), pad, text,
                                                                   torch.arange(16), pad))),
                    0, 0, scale, options, q[:15], d[:15])
    for key in ("loss", "qd", "accuracy"):
        assert (ranks[0][key] + ranks[1][key]).item() / 2 == pytest.approx(one[key].item(), rel=1e-12), key
    assert sum(int(r["masked_text"]) for r in ranks) == int(one["masked_text"]) == 0  # no duplicate among the 15


def test_head_trains_on_pairs_with_negatives_and_learnt_temperature(vocab):
    method, options, model = tiny_contrastive(negatives=2, symmetric=True, learn_temperature=True)
    head = method.build(options, model, seed=0)
    batch = method.collator.from_options(options, vocab)(pair_samples(6, negs=3))
    out = head(batch)
    assert {"loss", "qd", "dq", "accuracy", "masked_text", "masked_doc", "masked_margin", "temperature"} <= set(out)
    out["loss"].backward()
    assert head.log_scale.grad is not None and head.log_scale.grad != 0
    assert head.encoder.mlm_bias.grad is None  # the MLM head takes no part
    grads = [p.grad for p in head.encoder.model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head.train()
    first = None
    for _ in range(8):
        optimizer.zero_grad()
        loss = head(batch)["loss"]
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    assert loss.item() < first


def _grads(head) -> dict:
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", [True, False])
def test_grad_cache_equals_the_batch_under_one_graph(vocab, dropout):
    """GradCache (chunks of 3 of 8 pairs + 2 negatives each) gives the loss and every gradient of the same
    chunks encoded under one graph, dropout on; without dropout, of the whole batch in one encoder call."""
    method, options, model = tiny_contrastive(negatives=2, symmetric=True, learn_temperature=True)
    model.dropout = 0.1 if dropout else 0.0
    batch = method.collator.from_options(options, vocab)(pair_samples(8, negs=2))

    def run(chunk, cache):
        head = method.build(options, model, seed=0)
        head.train()
        head.chunk, head.grad_cache = chunk, cache
        torch.manual_seed(5)
        out = head(batch)
        out["loss"].backward()
        return out, _grads(head), torch.get_rng_state()

    cached, cached_grads, rng_after = run(3, True)
    reference, reference_grads, rng_reference = run(3, False) if dropout else run(None, True)
    torch.testing.assert_close(cached["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
    assert cached_grads.keys() == reference_grads.keys() and len(cached_grads) > 10
    for name in cached_grads:
        torch.testing.assert_close(cached_grads[name], reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if dropout:  # the step leaves the random state where the first encodings left it
        assert torch.equal(rng_after, rng_reference)


def test_pretrain_refuses_text_manifests_naming_the_key(wiki_shards):
    from pretrieve.pretrain_config import experiment
    from pretrieve.utils.options import ConfigError

    config = load_config(CONFIGS / "tiny-contrastive.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]"])
    with pytest.raises(ConfigError, match=r"data\.manifests\[0\]: .* holds text shards, but method contrastive "
                                          r"trains on pairs"):
        experiment(config)


def test_flops_match_the_deepspeed_profiler(vocab):
    from deepspeed.profiling.flops_profiler import get_model_profile

    from pretrieve.engine.flops import forward_flops

    method, options, model = tiny_contrastive(negatives=1)
    head = method.build(options, model, seed=0).eval()
    batch = method.collator.from_options(options, vocab)(pair_samples(4, negs=1))
    with torch.no_grad():
        _, macs, _ = get_model_profile(head, kwargs={"batch": batch}, print_profile=False, as_string=False,
                                       warm_up=0)
    # the score matrices (pairs x candidates x h) are left out of the formula: well under 1%
    assert forward_flops(method, options, head.encoder.config, batch) == pytest.approx(2 * macs, rel=0.01)
