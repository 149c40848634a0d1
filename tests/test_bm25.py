"""The BM25 baseline at scale (pretrieve/eval/bm25.py): the index built from a stream in chunks and merged on
disk scores as bm25s's own in-memory index, is whole or absent, and `pretrieve eval` reads the corpus once."""

import json

import bm25s
import numpy as np
import pytest
import Stemmer
from support import SAMPLES

import pretrieve.data.retrieval as retrieval
from pretrieve.data.retrieval import RetrievalDataError, load_beir, stream_corpus
from pretrieve.eval import bm25
from pretrieve.eval.encode import DenseEncoder, EncodeOptions
from pretrieve.eval.evaluate import EvalOptions, run_eval
from pretrieve.eval.vectors import encode_corpus_shards

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def in_memory(texts: list[str], queries: list[str], k: int):
    """(rows, scores) of bm25s's own index held in memory, as the baseline was built before the streamed one."""
    stemmer = Stemmer.Stemmer("english")
    index = bm25s.BM25(k1=bm25.K1, b=bm25.B, method="lucene")
    index.index(bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False), show_progress=False)
    tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
    return index, index.retrieve(tokens, k=k, show_progress=False)


def columns(index: bm25s.BM25) -> dict[str, tuple[list, list]]:
    """stem -> (documents, scores) of its column of the score matrix."""
    data, indices, indptr = (np.asarray(index.scores[key]) for key in ("data", "indices", "indptr"))
    return {stem: (indices[indptr[c]:indptr[c + 1]].tolist(), data[indptr[c]:indptr[c + 1]].tolist())
            for stem, c in index.vocab_dict.items() if c < len(indptr) - 1}


@pytest.mark.parametrize("chunk_docs, merge_entries", [(64, 500), (1, 1 << 22), (10_000, 1)])
def test_the_streamed_index_scores_as_bm25s_in_memory(tmp_path, monkeypatch, chunk_docs, merge_entries):
    data = load_beir(SCIFACT)
    ids = list(data.corpus) + ["empty", "stop-words-only", "again"]
    texts = [data.doc_text(d) for d in data.corpus] + ["", "the and of it", data.doc_text(ids[0])]
    queries = list(data.queries.values()) + ["the of", "zzzunseen", "protein protein PROTEIN cells"]
    monkeypatch.setattr(bm25, "MERGE_ENTRIES", merge_entries)  # many runs, many merge blocks
    assert bm25.build_index(zip(ids, texts), tmp_path / "index", chunk_docs=chunk_docs) == ids
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # the runs and the .tmp folder are gone
    loaded = bm25s.BM25.load(tmp_path / "index", mmap=True)
    assert isinstance(loaded.scores["data"], np.memmap)
    expected_index, (expected_rows, expected_scores) = in_memory(texts, queries, k=100)
    rows, scores = loaded.retrieve(bm25s.tokenize(queries, stopwords="en", stemmer=Stemmer.Stemmer("english"),
                                                  show_progress=False), k=100, show_progress=False)
    np.testing.assert_array_equal(rows, expected_rows)  # the same documents, ties in the same order
    np.testing.assert_array_equal(scores, expected_scores)  # the same float32 scores, bit for bit
    assert columns(loaded) == columns(expected_index)  # the same matrix, up to the numbering of its columns
    assert loaded.scores["indptr"].dtype == expected_index.scores["indptr"].dtype
    assert loaded.scores["indices"].dtype == expected_index.scores["indices"].dtype

    run = bm25.search(tmp_path / "index", ids, dict(enumerate(queries)), k=100, batch=7)  # batches of queries
    assert run == {q: {ids[r]: float(s) for r, s in zip(row, score) if s > 0}
                   for q, (row, score) in enumerate(zip(expected_rows.tolist(), expected_scores.tolist()))}
    assert run[len(queries) - 3] == run[len(queries) - 2] == {}  # stop words only; an unseen word


def test_a_failed_build_leaves_no_index_and_a_killed_ones_leftovers_are_replaced(tmp_path):
    data = load_beir(SCIFACT)
    folder = tmp_path / "beir"
    folder.mkdir()
    lines = [json.dumps({"_id": d, "title": t, "text": x}) for d, (t, x) in data.corpus.items()]
    (folder / "corpus.jsonl").write_text("\n".join(lines[:300] + ["{not json"] + lines[300:]) + "\n")
    with pytest.raises(RetrievalDataError, match="corpus.jsonl:301: not JSON"):
        bm25.build_index(stream_corpus(beir=folder), tmp_path / "index", chunk_docs=64)  # after 4 runs
    assert list(tmp_path.iterdir()) == [folder]  # neither the index nor its .tmp folder

    (tmp_path / "index.tmp").mkdir()
    (tmp_path / "index.tmp" / "run-00000.bin").write_bytes(b"from a build that was killed")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "data.csc.index.npy").write_bytes(b"an older index")
    ids = bm25.build_index(((d, data.doc_text(d)) for d in data.corpus), tmp_path / "index", chunk_docs=64)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["beir", "index"]
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == [
        "data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy", "params.index.json", "vocab.index.json"]
    assert bm25s.BM25.load(tmp_path / "index", mmap=True).scores["num_docs"] == len(ids) == 500

    with pytest.raises(ValueError, match="no documents to index"):
        bm25.build_index([], tmp_path / "none")
    assert not (tmp_path / "none").exists() and not (tmp_path / "none.tmp").exists()


@pytest.fixture
def corpus_reads(monkeypatch) -> list[str]:
    """The corpus files read, one entry per pass over one (every reader goes through _corpus_records)."""
    reads, records = [], retrieval._corpus_records

    def counted(path):
        reads.append(path.name)
        return records(path)

    monkeypatch.setattr(retrieval, "_corpus_records", counted)
    return reads


def test_eval_reads_the_corpus_once_and_bm25_beside_the_model_changes_neither(tmp_path, tiny_encoder, corpus_reads):
    common = {"beir": str(SCIFACT), "max_length": 64, "depth": 50, "progress": False}
    model = {"model": str(tiny_encoder), "pooling": "mean", "normalize": True}
    runs = {}
    for name, options in (("model", model), ("bm25", {"bm25": True}), ("both", {**model, "bm25": True})):
        corpus_reads.clear()
        run_eval(EvalOptions(out=str(tmp_path / name), **common, **options))
        assert corpus_reads == ["corpus.jsonl"], name  # one pass, feeding the encoder and BM25's index alike
        runs[name] = (tmp_path / name / "run.trec").read_text()
    assert runs["both"] == runs["model"] and (tmp_path / "both" / "bm25" / "run.trec").read_text() == runs["bm25"]
    assert sorted(p.name for p in (tmp_path / "bm25").iterdir()) == ["metrics.json", "per_query.jsonl", "run.trec"]
    assert sorted(p.name for p in (tmp_path / "both" / "bm25").iterdir()) == [
        "metrics.json", "per_query.jsonl", "run.trec"]  # the index is gone once searched
    assert json.loads((tmp_path / "both" / "bm25" / "metrics.json").read_text())["documents"] == 500

    vectors = tmp_path / "vectors"  # precomputed vectors: the ids alone, and the texts once for BM25 beside them
    encoder = DenseEncoder(str(tiny_encoder), EncodeOptions("mean", 64, normalize=True))
    encode_corpus_shards(encoder, stream_corpus(beir=SCIFACT), vectors, shard_size=128, progress=False)
    for name, options in (("embeddings", model), ("embeddings-bm25", {**model, "bm25": True})):
        corpus_reads.clear()
        run_eval(EvalOptions(out=str(tmp_path / name), embeddings=str(vectors), **common, **options))
        assert corpus_reads == ["corpus.jsonl"], name
        assert (tmp_path / name / "run.trec").read_text() == runs["model"]
    assert (tmp_path / "embeddings-bm25" / "bm25" / "run.trec").read_text() == runs["bm25"]
