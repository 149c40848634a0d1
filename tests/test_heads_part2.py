"""SEED-Encoder, COSTA, CoT-MAE and CoT-MoTE specifics: masks, spans, neighbours, experts, sparse vectors."""

import os
from itertools import islice

import numpy as np
import pytest
import torch
from support import free_port

from pretrieve.data.cotmae import CoTMAECollator
from pretrieve.data.neighbours import NeighbourBlocks
from pretrieve.data.spans import STOPWORDS
from pretrieve.data.stream import ShardStream
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import get_method
from pretrieve.models.heads.costa import COSTACollator, group_contrastive_loss, span_means
from pretrieve.models.heads.decoder import window_mask
from pretrieve.models.representation import hybrid_scores, sparse_representation

TINY = ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


@pytest.mark.parametrize("window", [2, 3])
def test_seed_window_mask_exact(window):
    lengths = torch.tensor([9, 6])
    mask = window_mask(lengths, 9, window)
    for b, n in enumerate(lengths.tolist()):
        for i in range(9):
            for j in range(9):
                expected = j < n and (j == 0 or i - window < j <= i)
                assert bool(mask[b, i, j]) == expected, (b, i, j)
    assert mask[0, 8].sum() == window + 1  # [CLS] state + the window (itself included)


def test_seed_decoder_predicts_next_ordinary_token(wiki_samples, vocab):
    method = get_method("seed")
    batch = method.collator.from_options(method.options_from({"max_len": 64}), vocab)(wiki_samples[:2])
    ids, labels, n = batch["dec_input_ids"][0], batch["dec_labels"][0], int(batch["attention_mask"][0].sum())
    assert labels[:n - 2].tolist() == ids[1:n - 1].tolist()  # position t predicts ordinary token t + 1
    assert (labels[n - 2:] == -100).all()  # nothing predicts [SEP] or padding


def _costa_batches(samples, vocab, count=8, **options):
    collate = COSTACollator(vocab, max_len=512, **options)
    return [collate([dict(s, index=s["index"] + 1000 * k) for s in samples]) for k in range(count)]


def test_costa_spans_respect_levels_and_lengths(wiki_samples, vocab):
    levels = [None, (4, 16), (16, 64), (64, 128)]
    for batch in _costa_batches(wiki_samples, vocab, count=4):
        bounds, lengths = batch["span_bounds"], batch["attention_mask"].sum(1)
        ids = torch.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"])
        for b in range(len(lengths)):
            for level, span_range in enumerate(levels):
                for start, end in bounds[b, 5 * level:5 * level + 5].tolist():
                    if start < 0:
                        assert span_range is not None and lengths[b] - 2 < span_range[0]
                        continue
                    assert 1 <= start < end <= lengths[b] - 1  # inside the ordinary tokens
                    if span_range is None:  # one whole word, not a stopword
                        tokens = [vocab.tokens[i] for i in ids[b, start:end]]
                        assert not tokens[0].startswith("##") and all(t.startswith("##") for t in tokens[1:])
                        if end < lengths[b] - 1:
                            assert not vocab.tokens[ids[b, end]].startswith("##")
                        assert "".join(tokens) not in STOPWORDS
                    else:
                        assert span_range[0] <= end - start <= span_range[1]


def test_costa_span_lengths_follow_beta_4_2(wiki_samples, vocab):
    long = [s for s in wiki_samples if len(s["ids"]) >= 500]
    fractions = []
    for batch in _costa_batches(long, vocab, count=40):
        for level, (low, high) in ((2, (16, 64)), (3, (64, 128))):
            b = batch["span_bounds"][:, 5 * level:5 * level + 5]
            fractions.append(((b[..., 1] - b[..., 0] - low + 0.5) / (high - low + 1)).flatten())
    x = torch.cat(fractions).numpy()
    assert len(x) > 3000
    x.sort()
    empirical = np.arange(1, len(x) + 1) / len(x)
    cdf = 5 * x ** 4 - 4 * x ** 5  # Beta(4, 2)
    assert np.abs(empirical - cdf).max() < 0.035  # KS distance (critical value at n = 3000: ~0.025 + binning)
    uniform = x  # the same test rejects a uniform draw
    assert np.abs(empirical - uniform).max() > 0.2


def test_group_contrastive_loss_by_formula():
    torch.manual_seed(0)
    texts = torch.randn(2, 4, dtype=torch.float64)
    spans = torch.randn(2, 3, 4, dtype=torch.float64)
    valid = torch.tensor([[True, True, False], [True, False, False]])
    tau = 0.1
    reps = [texts[0], texts[1]] + [spans[i, j] for i in range(2) for j in range(3) if valid[i, j]]
    owner = [None, None] + [i for i in range(2) for j in range(3) if valid[i, j]]
    losses = []
    for i in range(2):
        denominator = sum(torch.exp(texts[i] @ r / tau) for k, r in enumerate(reps) if k != i)
        positives = [r for r, o in zip(reps, owner) if o == i]
        losses.append(-sum(torch.log(torch.exp(texts[i] @ p / tau) / denominator) for p in positives) / len(positives))
    expected = (losses[0] + losses[1]) / 2
    got = group_contrastive_loss(texts, spans, valid, tau)
    assert got.item() == pytest.approx(expected.item(), rel=1e-9)


def test_span_means():
    hidden = torch.arange(2 * 6 * 3, dtype=torch.float64).reshape(2, 6, 3)
    bounds = torch.tensor([[[1, 4], [-1, -1]], [[2, 3], [0, 6]]])
    means = span_means(hidden, bounds)
    assert torch.equal(means[0, 0], hidden[0, 1:4].mean(0)) and torch.equal(means[1, 1], hidden[1].mean(0))
    assert torch.equal(means[1, 0], hidden[1, 2])


def _gather_worker(rank, world, port, texts, spans, valid, results):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from pretrieve.models.infonce import gather_across_ranks

        part = slice(rank * 2, rank * 2 + 2)
        local_texts = texts[part].clone().requires_grad_(True)
        loss = group_contrastive_loss(gather_across_ranks(local_texts), gather_across_ranks(spans[part]),
                                      gather_across_ranks(valid[part]), 0.1, first_anchor=rank * 2, anchors=2)
        loss.backward()
        results[rank] = (loss.item(), local_texts.grad.clone())
    finally:
        dist.destroy_process_group()


@pytest.mark.system  # two spawned gloo processes
def test_costa_loss_all_gather_two_gloo_processes():
    """Two ranks with two texts each, gathered: the mean of their losses is the one-process loss of all four
    texts, and each rank's text gradients are that loss's gradients (scaled by the rank count)."""
    import torch.multiprocessing as mp

    torch.manual_seed(1)
    texts, spans = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 5, 8, dtype=torch.float64)
    valid = torch.rand(4, 5) > 0.3
    valid[:, 0] = True
    port = int(free_port())
    results = mp.Manager().dict()
    mp.start_processes(_gather_worker, args=(2, port, texts, spans, valid, results), nprocs=2, join=True,
                       start_method="spawn")
    full_texts = texts.clone().requires_grad_(True)
    full = group_contrastive_loss(full_texts, spans, valid, 0.1)
    full.backward()
    assert (results[0][0] + results[1][0]) / 2 == pytest.approx(full.item(), rel=1e-9)
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]) / 2, full_texts.grad)


def test_cotmae_neighbours_stay_in_their_document(wiki_shards, books_shards, vocab):
    lookup = NeighbourBlocks()
    seen = with_neighbour = 0
    for shards in (wiki_shards, books_shards):
        for sample in ShardStream([shards / "manifest.json"], shuffle_buffer=1):
            seen += 1
            found = lookup.candidates(sample)
            with_neighbour += bool(found)
            for _, meta in found:
                assert (meta["doc"], meta["source"]) == (sample["doc"], sample["source"])
                assert abs(meta["block"] - sample["block"]) == 1
    assert seen > 700 and with_neighbour > 0.8 * seen

    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], shuffle_buffer=64)), 16))
    batch = CoTMAECollator(vocab, max_len=512, decoder_objective="clm", context="neighbour")(samples)
    for row, sample in enumerate(samples):
        ids = sample["ids"]  # a one-block document: its two halves are each other's neighbours
        options = [ids for ids, _ in lookup.candidates(sample)] or [ids[:(len(ids) + 1) // 2], ids[(len(ids) + 1) // 2:]]
        n = int(batch["ctx_attention_mask"][row].sum())
        context = batch["ctx_input_ids"][row, 1:n - 1].numpy()
        assert any(np.array_equal(context, ids[:510]) for ids in options)
        assert not batch["ctx_from_self"][row]


def test_mote_experts_are_independent_and_start_equal(tmp_path, wiki_samples, vocab):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64)
    BertModel(config).save_pretrained(tmp_path / "bert")
    method = get_method("cotmote")
    options = method.options_from({"max_len": 64})
    head = method.build(options, ModelOptions(init_from=str(tmp_path / "bert"))).eval()
    batch = method.collator.from_options(options, vocab)(wiki_samples[:4])
    encoder = head.encoder
    rows = len(batch["input_ids"])  # each anchor and its context
    query, passage = torch.ones(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long)
    mixed = torch.arange(rows) % 2

    def encode(kind):
        with torch.no_grad():
            return encoder(batch["input_ids"], batch["attention_mask"], kind)

    q0, p0 = encode(query), encode(passage)
    assert torch.equal(q0, p0)  # both experts start as the checkpoint's FFN
    with torch.no_grad():
        encoder.query_experts[0]["intermediate"].dense.weight.add_(0.5)
    q1, p1 = encode(query), encode(passage)
    assert torch.equal(p1, p0) and not torch.allclose(q1, q0)
    m = encode(mixed)
    assert torch.equal(m[mixed == 1], q1[mixed == 1]) and torch.equal(m[mixed == 0], p1[mixed == 0])
    with torch.no_grad():
        encoder.model.encoder.layer[1].output.dense.weight.add_(0.5)  # the passage expert
    q2, p2 = encode(query), encode(passage)
    with torch.no_grad():
        encoder.model.encoder.layer[1].output.dense.weight.sub_(0.5)
    assert not torch.allclose(p2, p1) and torch.equal(q2, q1)

    from pretrieve.models.export import export, load_export

    out = export(head, tmp_path / "export")
    resumed = load_export(out).eval()
    with torch.no_grad():
        assert torch.equal(resumed.encoder(batch["input_ids"], batch["attention_mask"], query), q1)


def test_sparse_and_hybrid_representations():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    sparse = sparse_representation(logits, mask)
    for b in range(2):
        for v in range(7):
            expected = max(np.log(1 + max(logits[b, i, v].item(), 0.0)) for i in range(int(mask[b].sum())))
            assert sparse[b, v].item() == pytest.approx(expected, rel=1e-6)
    dense = torch.randn(2, 3, dtype=torch.float64)
    scores = hybrid_scores(dense, dense, sparse.double(), sparse.double(), sparse_weight=0.5)
    assert scores[0, 1].item() == pytest.approx((dense[0] @ dense[1] + 0.5 * sparse[0].double() @ sparse[1].double()).item())


def test_cotmae_decodes_pseudo_queries_when_the_corpus_has_them(tmp_path, vocab):
    from test_cotmae_released import jsonl_samples

    by_doc = jsonl_samples(tmp_path, [{"id": "d1", "contents": "A passage about tides. The moon pulls the sea.",
                                       "queries": ["what causes tides", "moon and sea"]},
                                      {"id": "d2", "contents": "Another passage without any queries at all."}])
    backend_ids = [vocab.tokens.index(t) for t in ("what", "causes", "tides")]
    assert by_doc["d1"]["queries"][0] == backend_ids and "queries" not in by_doc["d2"]

    clm = {"max_len": 64, "decoder_objective": "clm"}
    batch = CoTMAECollator(vocab, context="auto", **clm)([by_doc["d1"], by_doc["d2"]])
    # d2, a one-block document without queries, decodes its other half, not itself
    assert batch["ctx_is_query"].tolist() == [True, False] and batch["ctx_from_self"].tolist() == [False, False]
    n = int(batch["ctx_attention_mask"][0].sum())
    assert batch["ctx_input_ids"][0, 1:n - 1].tolist() in [q for q in by_doc["d1"]["queries"]]
    neighbour_only = CoTMAECollator(vocab, context="neighbour", **clm)([by_doc["d1"]])
    assert not neighbour_only["ctx_is_query"].any()
    with pytest.raises(ValueError, match="no pseudo-queries"):
        CoTMAECollator(vocab, context="query", **clm)([by_doc["d2"]])


def test_bad_queries_field_is_a_bad_row(tmp_path):
    from pretrieve.data.corpora import BadRecord, read_corpus

    src = tmp_path / "c.jsonl"
    src.write_text('{"id": "1", "text": "fine", "queries": "not a list"}\n')
    (record,) = read_corpus("jsonl", [src])
    assert isinstance(record, BadRecord) and record.reason == "bad_row" and "queries" in record.detail


@pytest.mark.parametrize("backbone", ["bert", "modernbert"])
def test_a_deep_copy_of_a_mote_encoder_routes_through_its_own_experts(backbone):
    """The routing is part of the modules: a copy of the encoder (deepcopy, as an EMA or a teacher copy is made)
    sends its queries through its own query experts and its passages through its own layers, never through the
    original's."""
    import copy

    from pretrieve.models.encoder import Encoder

    encoder = Encoder(ModelOptions(backbone=backbone, vocab_size=1000, hidden_size=32, num_layers=2, num_heads=2,
                                   intermediate_size=64, pad_token_id=0).hf_config()).eval()
    encoder.add_query_experts()
    twin = copy.deepcopy(encoder)
    calls = []
    for name, enc in (("original", encoder), ("copy", twin)):
        for expert in enc.query_experts:
            for module in expert.values():
                module.register_forward_hook(lambda *args, name=name: calls.append((name, "query")))
        for layer in enc.backbone.layers(enc.model):
            for part in enc.backbone.feed_forward_modules:
                getattr(layer, part).register_forward_hook(lambda *args, name=name: calls.append((name, "passage")))
    ids = torch.randint(5, 1000, (4, 12))
    mask, mixed = torch.ones_like(ids), torch.tensor([1, 0, 1, 0])
    with torch.no_grad():
        out = twin(ids, mask, mixed)
        assert set(calls) == {("copy", "query"), ("copy", "passage")}
        assert torch.equal(out, encoder(ids, mask, mixed))  # equal weights, equal routes
        for expert in twin.query_experts:  # the copy's query experts alone change its query outputs
            for parameter in expert.parameters():
                parameter.add_(0.5)
        changed, original = twin(ids, mask, mixed), encoder(ids, mask, mixed)
    assert torch.equal(changed[mixed == 0], original[mixed == 0])
    assert not torch.allclose(changed[mixed == 1], original[mixed == 1])
