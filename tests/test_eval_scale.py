"""Evaluation and mining at MS MARCO scale, on the bundled SciFact sample with a tiny random encoder: the corpus
streamed (never all its texts or tokens in memory), vectors written as float32 / float16 shards and read
memory-mapped, exact search shard by shard equal to one flat index, and mining split over workers equal to one
process."""

import json
import shutil

import numpy as np
import pytest
import torch
from support import SAMPLES

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import RetrievalDataError, load_beir, load_retrieval_set, stream_corpus, write_msmarco
from pretrieve.eval.encode import DenseEncoder, EncodeOptions
from pretrieve.eval.search import dense_search, faiss_gpus, top_k
from pretrieve.eval.vectors import ShardedVectors, encode_corpus_shards, open_corpus_vectors
from pretrieve.finetune.examples import read_examples
from pretrieve.finetune.mine import MineOptions, mine
from pretrieve.models.representation import POOLINGS

pytestmark = pytest.mark.system

SCIFACT = SAMPLES / "beir" / "scifact-sample"
FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"


def whole_list_vectors(encoder: DenseEncoder, texts: list[str]) -> np.ndarray:
    """The vectors of the earlier encoder, the reference: every text tokenized in one call, sorted by length
    over the whole list, batched longest first."""
    options = encoder.options
    ids = encoder.tokenizer(texts, truncation=True, max_length=options.max_length)["input_ids"]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = np.empty((len(texts), encoder.dim), dtype=np.float32)
    for start in range(0, len(order), options.batch_size):
        rows = order[start:start + options.batch_size]
        batch = encoder.tokenizer.pad({"input_ids": [ids[i] for i in rows]}, return_tensors="pt")
        with torch.inference_mode():
            vectors = POOLINGS[options.pooling](encoder.model(**batch).last_hidden_state, batch["attention_mask"])
        out[rows] = torch.nn.functional.normalize(vectors, dim=-1).numpy()
    return out


class CountingTokenizer:
    """The encoder's own tokenizer, noting how many texts each call gets and how far the corpus had been read."""

    def __init__(self, tokenizer, read: list[int]):
        self.tokenizer, self.read, self.calls = tokenizer, read, []

    def __call__(self, texts, **kwargs):
        self.calls.append((len(texts), self.read[0]))
        return self.tokenizer(texts, **kwargs)

    def pad(self, *args, **kwargs):
        return self.tokenizer.pad(*args, **kwargs)


def counted(documents, read: list[int]):
    for document in documents:
        read[0] += 1
        yield document


def test_streaming_encode_gives_the_whole_list_vectors_window_by_window(tmp_path, tiny_encoder):
    data = load_beir(SCIFACT)
    doc_ids = list(data.corpus)
    texts = [data.doc_text(d) for d in doc_ids]
    encoder = DenseEncoder(tiny_encoder, EncodeOptions("mean", 64, 16, normalize=True))
    reference = whole_list_vectors(encoder, texts)
    # one window over every text (the default window, 64 batches, holds the 500): bit for bit the earlier vectors
    np.testing.assert_array_equal(encoder.encode(texts, progress=False), reference)

    read = [0]
    encoder.tokenizer = CountingTokenizer(encoder.tokenizer, read)
    encoder.options.window = 48
    windowed = np.empty_like(reference)
    for rows, vectors in encoder.vectors(counted(texts, read), progress=False):
        windowed[rows] = vectors
    assert [size for size, _ in encoder.tokenizer.calls] == [48] * 10 + [20]  # never the corpus in one call
    assert encoder.tokenizer.calls[0][1] == 48  # the first batch is encoded after reading one window, not all
    # other batch-mates move a coordinate by float32 rounding only (CPU matrix products blocked by shape)
    np.testing.assert_allclose(windowed, reference, rtol=0, atol=1e-6)

    # shards over two workers, float16 as asked: each shard's vectors are its texts' own, cast
    encoder.tokenizer, encoder.options.window = encoder.tokenizer.tokenizer, None
    out = tmp_path / "vectors"
    for worker in (1, 0):
        read[0] = 0
        shards, documents = encode_corpus_shards(encoder, counted(stream_corpus(beir=SCIFACT), read), out,
                                                 shard_size=128, worker=worker, workers=2, dtype="float16",
                                                 progress=False)
        assert documents == read[0] == 500 and [s.name for s in shards] == \
            [f"corpus-{n:05d}" for n in range(worker, 4, 2)]
    loaded = open_corpus_vectors(out, encoder.settings(), doc_ids)
    assert all(isinstance(part, np.memmap) and part.dtype == np.float16 for part in loaded.parts)
    assert [len(part) for part in loaded.parts] == [128, 128, 128, 116] and loaded.ids == doc_ids
    for number, start in enumerate(range(0, 500, 128)):
        np.testing.assert_array_equal(loaded.parts[number],
                                      whole_list_vectors(encoder, texts[start:start + 128]).astype(np.float16))
    np.testing.assert_array_equal(loaded[np.array([499, 0, 130])],
                                  np.asarray(loaded.parts[3][115:116].tolist() + loaded.parts[0][:1].tolist() +
                                             loaded.parts[1][2:3].tolist(), dtype=np.float32))
    with pytest.raises(ValueError, match="vectors made with"):  # other settings than the folder's
        encode_corpus_shards(encoder, stream_corpus(beir=SCIFACT), out, shard_size=128, dtype="float32")
    with pytest.raises(ValueError, match=r"row 1 holds document .*vectors of another corpus"):
        open_corpus_vectors(out, encoder.settings(), [doc_ids[0], *doc_ids[2:]])
    (out / "corpus-00002.ids").unlink()  # as a killed worker leaves it
    with pytest.raises(ValueError, match="shard corpus-00002 is missing"):
        open_corpus_vectors(out, encoder.settings(), doc_ids)


def test_corpus_streams_and_loads_without_texts(tmp_path):
    folder = tmp_path / "beir"
    shutil.copytree(SCIFACT, folder)
    corpus = folder / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join([*lines, lines[0]]) + "\n")  # a document given twice, the same: counted once
    data = load_beir(folder)
    assert list(stream_corpus(beir=folder)) == [(d, data.doc_text(d)) for d in data.corpus]
    ids_only = load_retrieval_set(beir=folder, texts=False)
    assert list(ids_only.corpus) == list(data.corpus) and set(ids_only.corpus.values()) == {None}
    assert ids_only.qrels == data.qrels and ids_only.queries == data.queries
    record = json.loads(lines[0])
    with pytest.raises(ValueError, match="read without its corpus texts"):
        ids_only.doc_text(record["_id"])
    marco = write_msmarco(data, tmp_path / "marco", "dev")
    assert list(stream_corpus(msmarco=marco)) == [(d, " ".join(data.doc_text(d).split())) for d in data.corpus]

    corpus.write_text("\n".join([*lines, json.dumps({**record, "text": "other"})]) + "\n")
    for read in (lambda: list(stream_corpus(beir=folder)), lambda: load_retrieval_set(beir=folder, texts=False)):
        with pytest.raises(RetrievalDataError, match=rf"corpus.jsonl:501: id '{record['_id']}' again, with other "
                                                     "text than at line 1"):
            read()


def test_ids_that_share_a_hash_are_told_apart(tmp_path, monkeypatch):
    """The ids seen are kept as 64-bit hashes; ids whose hashes collide (here: every id has the same one) still
    stream once each, a repeat is still dropped, and a repeat with other text is still an error."""
    from pretrieve.data import retrieval

    folder = tmp_path / "beir"
    shutil.copytree(SCIFACT, folder)
    corpus = folder / "corpus.jsonl"
    lines = corpus.read_text().splitlines()[:40]
    corpus.write_text("\n".join([*lines, lines[3]]) + "\n")
    expected = list(stream_corpus(beir=folder))
    assert len(expected) == 40
    plain = retrieval._SeenIds.hash64
    monkeypatch.setattr(retrieval._SeenIds, "hash64", staticmethod(lambda v: 7 if isinstance(v, str) else plain(v)))
    assert list(stream_corpus(beir=folder)) == expected
    record = json.loads(lines[3])
    corpus.write_text("\n".join([*lines, json.dumps({**record, "text": "other"})]) + "\n")
    with pytest.raises(RetrievalDataError, match=rf"corpus.jsonl:41: id '{record['_id']}' again, with other text "
                                                 "than at line 4"):
        list(stream_corpus(beir=folder))


def test_the_ids_seen_grow_a_table_of_hashes():
    from pretrieve.data.retrieval import _SeenIds

    seen = _SeenIds(capacity=4)
    for i in range(1000):  # grows 4 -> 2048 slots on the way
        seen.add(f"doc{i}", _SeenIds.hash64(("", f"text {i}")))
    assert len(seen.keys) == 2048 and seen.size == 1000 and not seen.exact
    assert all(seen.digest_of(f"doc{i}") == _SeenIds.hash64(("", f"text {i}")) for i in range(1000))
    assert seen.digest_of("doc1000") is None


def exact_ranking(docs: np.ndarray, queries: np.ndarray, k: int):
    """Each query's top k rows of one matrix product, by score and then row."""
    scores = queries.astype(np.float64) @ docs.astype(np.float64).T
    rows = np.lexsort((np.broadcast_to(np.arange(len(docs)), scores.shape), -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


def test_sharded_search_gives_the_top_k_of_one_flat_index(tmp_path):
    import faiss

    rng = np.random.default_rng(0)
    # small integers: exact scores, many ties, so the order among equal scores is tested too
    docs = rng.integers(-2, 3, (3000, 8)).astype(np.float32)
    queries = rng.integers(-2, 3, (50, 8)).astype(np.float32)
    ids = [f"d{i}" for i in range(3000)]
    scores, rows = exact_ranking(docs, queries, 40)
    flat = faiss.IndexFlatIP(8)
    flat.add(docs)
    faiss_scores, faiss_rows = flat.search(queries, 40)
    np.testing.assert_array_equal(faiss_scores, scores)  # the same top 40 scores as one faiss flat index
    assert faiss_gpus() == 0 and (faiss_rows != rows).any()  # ties: faiss's order is not the row order
    shards = ShardedVectors([docs[:1000], docs[1000:1001], docs[1001:]], ids)
    for block_rows in (None, 1, 7, 999):
        found = top_k(shards, queries, 40, block_rows=block_rows)
        np.testing.assert_array_equal(found[1], rows)
        np.testing.assert_array_equal(found[0], scores.astype(np.float32))

    # real-valued float16 vectors, memory-mapped shards: the same run whatever the shards, blocks, query batches
    docs = rng.standard_normal((2000, 32)).astype(np.float16)
    queries = rng.standard_normal((30, 32)).astype(np.float32)
    ids, query_ids = [f"d{i}" for i in range(2000)], [f"q{i}" for i in range(30)]
    one = dense_search(docs, ids, queries, query_ids, k=100)
    for start, stop in ((0, 700), (700, 2000)):
        np.save(tmp_path / f"part-{start}.npy", docs[start:stop])
    parts = [np.load(tmp_path / f"part-{start}.npy", mmap_mode="r") for start in (0, 700)]
    assert dense_search(ShardedVectors(parts, ids), ids, queries, query_ids, k=100, block_rows=333) == one
    single = dense_search(ShardedVectors(parts, ids), ids, queries[7:8], ["q7"], k=100, block_rows=50)
    assert single == {"q7": one["q7"]}
    expected_scores, expected_rows = exact_ranking(docs, queries, 100)
    for i, qid in enumerate(query_ids):
        assert list(one[qid]) == [ids[r] for r in expected_rows[i]]
        assert list(one[qid].values()) == expected_scores[i].astype(np.float32).tolist()


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, tiny_encoder):
    """The SciFact sample's corpus encoded by `pretrieve encode` (mean, normalized, 64 tokens), float32 and
    float16, and the settings."""
    out = tmp_path_factory.mktemp("encoded")
    settings = ["--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
                "--max-length", "64"]
    for dtype in ("float32", "float16"):
        assert cli(["encode", *settings, "--dtype", dtype, "--out", str(out / dtype)]) == 0
    return out, settings


def test_eval_searches_shards_without_corpus_texts_and_reports_index_recall(tmp_path, encoded, capsys):
    vectors, settings = encoded
    folder = tmp_path / "beir"
    shutil.copytree(SCIFACT, folder)
    settings = [*settings[:2], "--beir", str(folder), *settings[4:], "--depth", "50"]
    capsys.readouterr()
    assert cli(["eval", *settings, "--out", str(tmp_path / "direct")]) == 0
    run = (tmp_path / "direct" / "run.trec").read_text()
    # read once, the corpus's size is not known while it streams: the progress line counts its 500 documents
    # without a total, not towards the 100,000 of a whole shard
    shown = capsys.readouterr().err
    assert "encode shard 0: 500 text" in shown and "/100000" not in shown
    corpus = folder / "corpus.jsonl"  # the texts blanked, the ids kept: the vectors alone are searched
    corpus.write_text("".join(json.dumps({**json.loads(line), "title": "", "text": ""}) + "\n"
                              for line in corpus.read_text().splitlines()))
    assert cli(["eval", *settings, "--embeddings", str(vectors / "float32"), "--out", str(tmp_path / "shards")]) == 0
    assert (tmp_path / "shards" / "run.trec").read_text() == run
    assert cli(["eval", *settings, "--out", str(tmp_path / "blank")]) == 0  # while encoding them changes the run
    assert (tmp_path / "blank" / "run.trec").read_text() != run

    assert cli(["eval", *settings, "--embeddings", str(vectors / "float16"), "--index", "hnsw",
                "--out", str(tmp_path / "hnsw")]) == 0
    exact = json.loads((tmp_path / "shards" / "metrics.json").read_text())
    metrics = json.loads((tmp_path / "hnsw" / "metrics.json").read_text())
    assert metrics["index"] == "hnsw" and metrics["index_recall_queries"] == 100
    assert 0.9 <= metrics["index_recall@50"] <= 1.0 and "index_recall@50" not in exact
    assert metrics["ndcg@10"] == pytest.approx(exact["ndcg@10"], abs=0.02)  # float16, approximate
    capsys.readouterr()


def test_mine_with_embeddings_over_workers_gives_the_negatives_of_one_process(tmp_path, encoded, tiny_encoder):
    vectors, _ = encoded
    common = dict(model=str(tiny_encoder), beir=str(SCIFACT), split="test", depth=30, negatives=4, skip=1,
                  pooling="mean", normalize=True, max_length=64, progress=False)
    alone = tmp_path / "alone.jsonl"
    assert mine(MineOptions(out=str(alone), **common))["queries_with_fewer_negatives"] == 0
    split = tmp_path / "split" / "hard.jsonl"
    for worker, merged in ((2, False), (0, False), (1, True)):  # in any order; the last part completes the file
        result = mine(MineOptions(out=str(split), embeddings=str(vectors / "float32"), worker=worker, workers=3,
                                  **common))
        assert result["merged"] is merged and result["queries"] in (33, 34)
        assert split.is_file() is merged
    assert split.read_bytes() == alone.read_bytes()
    assert sorted(p.name for p in split.parent.iterdir()) == ["hard.jsonl"]  # parts, settings and lock removed

    data = load_beir(SCIFACT)
    examples = read_examples(alone)
    assert [e.query for e in examples] == [data.queries[q] for q in data.qrels]
    for example, qid in zip(examples, data.qrels):
        assert example.pos == [data.doc_text(d) for d, rel in data.qrels[qid].items() if rel > 0]
        assert len(example.neg) == 4 and not set(example.neg) & set(example.pos)

    with pytest.raises(ValueError, match="hard.jsonl: exists; pass --overwrite"):  # a finished file stays
        mine(MineOptions(out=str(split), worker=0, workers=2, **common))
    mine(MineOptions(out=str(split), worker=0, workers=2, overwrite=True, **{**common, "negatives": 3}))
    with pytest.raises(ValueError, match="mined parts made with"):  # a worker started with other settings
        mine(MineOptions(out=str(split), worker=1, workers=2, overwrite=True, **common))
    with pytest.raises(ValueError, match="vectors made with"):  # vectors of other settings than the model's
        mine(MineOptions(out=str(tmp_path / "x.jsonl"), embeddings=str(vectors / "float32"),
                         **{**common, "max_length": 32}))
    with pytest.raises(ValueError, match="--embeddings: vectors of an MS MARCO / BEIR corpus"):
        mine(MineOptions(model=str(tiny_encoder), out=str(tmp_path / "y.jsonl"), data=[str(FLAG)],
                         embeddings=str(vectors / "float32")))


def test_mine_of_training_passages_over_workers_gives_the_negatives_of_one_process(tmp_path, tiny_encoder, capsys):
    common = ["mine", "--model", str(tiny_encoder), "--data", str(FLAG), "--depth", "12", "--negatives", "5",
              "--max-length", "48"]
    assert cli([*common, "--out", str(tmp_path / "alone.jsonl")]) == 0
    for worker in ("1", "0"):
        assert cli([*common, "--worker", worker, "--workers", "2", "--out", str(tmp_path / "split.jsonl")]) == 0
    assert (tmp_path / "split.jsonl").read_bytes() == (tmp_path / "alone.jsonl").read_bytes()
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [p.get("merged") for p in printed] == [None, False, True]
