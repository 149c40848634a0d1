"""First-stage retrieval: dense search with faiss, and the BM25 baseline with bm25s.

Dense: inner product over the vectors (cosine when they are normalized). `flat` is exact; `hnsw` (graph,
M = 32, efSearch = max(128, k)) and `ivfpq` (IVF with sqrt(N) lists, 8-bit PQ codes, 4-bit below 9,984
documents, 32 lists probed) trade
recall for speed on large corpora. On a machine with faiss GPUs the flat index runs there.
Sparse: vocabulary-weight vectors (SPLADE-style, DupMAE's OT vector) as CSR rows; their inner products are
the inverted-index scores. Hybrid: dense + weighted sparse, exact over the corpus or over the union of the
dense and sparse candidates of each query, re-scored exactly.
BM25: bm25s over lower-cased words without English stop words, Snowball-stemmed, k1 = 0.9 and b = 0.4
(Anserini's defaults, which BEIR-style comparisons use); title + " " + text as the document.
`pair_scorer` scores chosen (query, document) pairs exactly as these searches do (eval.contrastive uses it).
"""

from __future__ import annotations

import math

import numpy as np

from pretrieve.optional import FAISS, require

INDEXES = ("flat", "hnsw", "ivfpq")


def dense_search(doc_vectors: np.ndarray, doc_ids: list[str], query_vectors: np.ndarray, query_ids: list[str],
                 k: int = 1000, index: str = "flat") -> dict[str, dict[str, float]]:
    """{query id: {doc id: score}} of each query's top k documents by inner product."""
    faiss = require(FAISS, "dense retrieval")
    if index not in INDEXES:
        raise ValueError(f"index: {index!r} is not one of {', '.join(INDEXES)}")
    dim = doc_vectors.shape[1]
    docs = np.ascontiguousarray(doc_vectors, dtype=np.float32)
    if index == "flat":
        built = faiss.IndexFlatIP(dim)
        if hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0:
            built = faiss.index_cpu_to_all_gpus(built)
    elif index == "hnsw":
        built = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
        built.hnsw.efSearch = max(128, k)
    else:
        lists = max(1, int(math.sqrt(len(docs))))
        sub = next(m for m in (dim // 4, dim // 2, dim, 1) if m >= 1 and dim % m == 0)
        bits = 8 if len(docs) >= 39 * 256 else 4  # k-means wants ~39 points per centroid
        built = faiss.index_factory(dim, f"IVF{lists},PQ{sub}x{bits}", faiss.METRIC_INNER_PRODUCT)
        built.train(docs)
        built.nprobe = min(32, lists)
    built.add(docs)
    scores, rows = built.search(np.ascontiguousarray(query_vectors, dtype=np.float32), min(k, len(docs)))
    return {qid: {doc_ids[r]: float(s) for r, s in zip(row, score) if r >= 0}
            for qid, row, score in zip(query_ids, rows, scores)}


def pair_scorer(dense_docs: np.ndarray | None, dense_queries: np.ndarray | None, sparse_docs=None,
                sparse_queries=None, sparse_weight: float = 1.0):
    """score(query row, document rows [m]) -> [m] float64: dense . dense (+ sparse_weight * sparse . sparse), the
    score dense_search / sparse_search / hybrid_search rank by, for the given pairs only. Dense vectors None:
    sparse alone (as sparse_search, which takes no weight); sparse None: dense alone."""
    if dense_docs is None:
        sparse_weight = 1.0

    def score(query: int, rows: np.ndarray) -> np.ndarray:
        scores = np.zeros(len(rows))
        if dense_docs is not None:
            scores += dense_docs[rows] @ dense_queries[query]
        if sparse_docs is not None:
            scores += sparse_weight * (sparse_docs[rows] @ sparse_queries[query].T).toarray().ravel()
        return scores

    return score


def bm25_search(docs: dict[str, str], queries: dict[str, str], k: int = 1000, k1: float = 0.9,
                b: float = 0.4) -> dict[str, dict[str, float]]:
    """{query id: {doc id: BM25 score}} of each query's top k documents with a positive score."""
    import bm25s
    import Stemmer

    stemmer = Stemmer.Stemmer("english")
    doc_ids, query_ids = list(docs), list(queries)
    retriever = bm25s.BM25(k1=k1, b=b, method="lucene")
    retriever.index(bm25s.tokenize(list(docs.values()), stopwords="en", stemmer=stemmer, show_progress=False),
                    show_progress=False)
    tokens = bm25s.tokenize([queries[q] for q in query_ids], stopwords="en", stemmer=stemmer, show_progress=False)
    rows, scores = retriever.retrieve(tokens, k=min(k, len(doc_ids)), show_progress=False)
    return {qid: {doc_ids[r]: float(s) for r, s in zip(row, score) if s > 0}
            for qid, row, score in zip(query_ids, rows, scores)}


def sparse_matrix(vectors: np.ndarray, top_k: int | None = None):
    """[N, vocab] weights as a CSR matrix (the inverted index's rows), keeping each row's `top_k` largest."""
    from scipy import sparse

    weights = np.asarray(vectors, dtype=np.float32)
    if top_k is not None and top_k < weights.shape[1]:
        keep = np.argpartition(-weights, top_k - 1, axis=1)[:, :top_k]
        kept = np.zeros_like(weights)
        np.put_along_axis(kept, keep, np.take_along_axis(weights, keep, axis=1), axis=1)
        weights = kept
    return sparse.csr_matrix(weights)


def sparse_search(doc_weights, doc_ids: list[str], query_weights, query_ids: list[str],
                  k: int = 1000) -> dict[str, dict[str, float]]:
    """Top k by the inner product of sparse vocabulary vectors (CSR [D, V] and [Q, V]): the inverted-index
    product, computed exactly by scipy's sparse matmul; documents sharing no term with the query are left out."""
    scores = (query_weights @ doc_weights.T).tocsr()
    run = {}
    for row, qid in enumerate(query_ids):
        start, stop = scores.indptr[row], scores.indptr[row + 1]
        cols, vals = scores.indices[start:stop], scores.data[start:stop]
        top = np.argsort(-vals, kind="stable")[:k]
        run[qid] = {doc_ids[cols[i]]: float(vals[i]) for i in top if vals[i] > 0}
    return run


def hybrid_search(dense_docs: np.ndarray, dense_queries: np.ndarray, sparse_docs, sparse_queries,
                  doc_ids: list[str], query_ids: list[str], k: int = 1000, sparse_weight: float = 1.0,
                  candidates: int | None = None) -> dict[str, dict[str, float]]:
    """Top k by dense . dense + sparse_weight * sparse . sparse: CoT-MoTE's hybrid score, and DupMAE's eq. (12)
    when the document side holds only its top-k OT entries. `candidates=None` scores every document exactly
    (corpora that fit); otherwise each query's dense top `candidates` and sparse top `candidates` are united
    and re-scored exactly, which misses a document only if it is in neither list."""
    if candidates is None:
        scores = dense_queries @ dense_docs.T + sparse_weight * (sparse_queries @ sparse_docs.T).toarray()
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return {qid: {doc_ids[j]: float(scores[i, j]) for j in top[i]} for i, qid in enumerate(query_ids)}
    dense_run = dense_search(dense_docs, doc_ids, dense_queries, query_ids, k=candidates)
    sparse_run = sparse_search(sparse_docs, doc_ids, sparse_queries, query_ids, k=candidates)
    row_of = {d: i for i, d in enumerate(doc_ids)}
    run = {}
    for i, qid in enumerate(query_ids):
        pool = np.array(sorted({row_of[d] for d in dense_run[qid]} | {row_of[d] for d in sparse_run[qid]}))
        scores = dense_docs[pool] @ dense_queries[i] + sparse_weight * (sparse_docs[pool] @ sparse_queries[i].T) \
            .toarray().ravel()
        top = np.argsort(-scores, kind="stable")[:k]
        run[qid] = {doc_ids[pool[j]]: float(scores[j]) for j in top}
    return run
