"""Sparse retrieval in bounded memory: the corpus's vectors are encoded part by part from the stream (no texts
held), and searched part by part through each part's inverted index, a batch of queries at a time, each keeping
a running top k; the result is the exact ranking (score, then row) whatever the parts and batches."""

import numpy as np
import pytest
from scipy import sparse
from support import SAMPLES, write_beir

from pretrieve.eval import search
from pretrieve.eval.search import sparse_search
from pretrieve.eval.sparse_vectors import SparseVectors


def _weights(rng, rows, vocab, nonzero):
    weights = np.zeros((rows, vocab), dtype=np.float32)
    for row in weights:
        row[rng.choice(vocab, nonzero, replace=False)] = rng.integers(1, 4, nonzero) / 4  # ties on purpose
    return weights


def _exact(queries: np.ndarray, docs: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Each query's top k (row, score) by score and then row, documents scoring 0 (no shared term) left out."""
    scores = queries.astype(np.float64) @ docs.T.astype(np.float64)
    return [[(int(r), float(row[r])) for r in np.lexsort((np.arange(len(row)), -row))[:k] if row[r] > 0]
            for row in scores]


def test_part_by_part_search_is_the_exact_ranking_whatever_the_parts_and_batches(monkeypatch):
    rng = np.random.default_rng(0)
    docs, queries = _weights(rng, 500, 300, 6), _weights(rng, 40, 300, 3)
    queries[7] = 0  # a query with no term
    doc_ids, query_ids = [f"d{i}" for i in range(500)], [f"q{i}" for i in range(40)]
    expected = _exact(queries, docs, 10)
    whole = sparse_search(sparse.csr_matrix(docs), doc_ids, sparse.csr_matrix(queries), query_ids, k=10)
    monkeypatch.setattr(search, "SCORE_FLOATS", 64)  # 1 query at a time against parts of 128 documents
    parts = SparseVectors([sparse.csr_matrix(docs[i:i + 128]) for i in range(0, 500, 128)], doc_ids)
    split = sparse_search(parts, doc_ids, sparse.csr_matrix(queries), query_ids, k=10)
    assert split == whole
    for qid, top in zip(query_ids, expected):
        assert [(doc_ids.index(d), s) for d, s in whole[qid].items()] == top  # quarters: exact in float32
    assert whole["q7"] == {} and all(len(whole[q]) == 10 for q in query_ids if q != "q7")

    rows = [499, 3, 130, 3, 256]
    assert (parts[rows] != sparse.csr_matrix(docs[rows])).nnz == 0  # rows across parts, in the order asked
    with pytest.raises(ValueError, match="3 ids for 500 sparse vectors"):
        SparseVectors(parts.parts, doc_ids[:3])


def test_a_streamed_corpus_is_encoded_as_the_whole_list_and_eval_holds_no_texts(tmp_path, monkeypatch):
    """encode_sparse_corpus over a stream, 7 documents a part, gives VocabEncoder's rows for the whole list;
    `eval --pooling sparse` reads the corpus without its texts and ranks as a search over the whole list."""
    import torch

    from pretrieve.data.retrieval import load_beir, stream_corpus
    from pretrieve.eval import evaluate
    from pretrieve.eval.encode import EncodeOptions, VocabEncoder
    from pretrieve.eval.evaluate import EvalOptions, run_eval
    from pretrieve.eval.sparse_vectors import encode_sparse_corpus
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method

    torch.manual_seed(0)
    method = get_method("lexmae")
    model = export(method.build(method.options_from({"max_len": 64}),
                                ModelOptions(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)),
                   tmp_path / "export")
    data = load_beir(SAMPLES / "beir" / "scifact-sample")
    query_ids = list(data.queries)[:5]
    doc_ids = sorted({d for q in query_ids for d in data.qrels[q]} | set(list(data.corpus)[:25]))
    mini = write_beir(tmp_path / "mini", data, query_ids, doc_ids)

    encoder = VocabEncoder(model, EncodeOptions("sparse", 48, 4), top_k=40)
    streamed = encode_sparse_corpus(encoder, stream_corpus(str(mini), None), progress=False, shard_size=7)
    assert len(streamed.parts) == -(-len(doc_ids) // 7)
    texts = dict(stream_corpus(str(mini), None))
    _, whole = encoder.encode([texts[d] for d in streamed.ids], documents=True, progress=False)
    assert abs(streamed.stacked() - whole).max() < 1e-6 and streamed.stacked().nnz == 40 * len(doc_ids)

    asked = []
    loader = evaluate.load_retrieval_set
    monkeypatch.setattr(evaluate, "load_retrieval_set", lambda *a, **kw: asked.append(kw) or loader(*a, **kw))
    result = run_eval(EvalOptions(out=str(tmp_path / "eval"), model=str(model), beir=str(mini), pooling="sparse",
                                  max_length=48, batch_size=4, vocab_top_k=40, depth=10, progress=False))
    assert result["retriever"] == "sparse" and not any(kw.get("texts") for kw in asked)
    with pytest.raises(ValueError, match="--embeddings: vectors of a cls, mean or last encoder"):  # not ignored
        run_eval(EvalOptions(out=str(tmp_path / "refused"), model=str(model), beir=str(mini), pooling="sparse",
                             embeddings=str(tmp_path / "vectors"), progress=False))
    _, queries = encoder.encode([data.queries[q] for q in query_ids], documents=False, progress=False)
    expected = sparse_search(whole, streamed.ids, queries, query_ids, k=10)
    lines = [line.split() for line in (tmp_path / "eval" / "run.trec").read_text().splitlines()]
    for qid in query_ids:
        got = [(doc, float(score)) for q, _, doc, _, score, _ in lines if q == qid]
        assert [d for d, _ in got] == list(expected[qid]) and \
            [s for _, s in got] == pytest.approx(list(expected[qid].values()), rel=1e-5)
