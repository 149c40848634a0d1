"""First-stage retrieval: dense search with faiss, and the BM25 baseline with bm25s.

Dense: inner product over the vectors (cosine when they are normalized). `flat` is exact; `hnsw` (graph,
M = 32, efSearch = max(128, k)) and `ivfpq` (IVF with sqrt(N) lists, 8-bit PQ codes, 4-bit below 9,984
documents, 32 lists probed) trade
recall for speed on large corpora. On a machine with faiss GPUs the flat index runs there.
BM25: bm25s over lower-cased words without English stop words, Snowball-stemmed, k1 = 0.9 and b = 0.4
(Anserini's defaults, which BEIR-style comparisons use); title + " " + text as the document.
"""

from __future__ import annotations

import math

import numpy as np

INDEXES = ("flat", "hnsw", "ivfpq")


def dense_search(doc_vectors: np.ndarray, doc_ids: list[str], query_vectors: np.ndarray, query_ids: list[str],
                 k: int = 1000, index: str = "flat") -> dict[str, dict[str, float]]:
    """{query id: {doc id: score}} of each query's top k documents by inner product."""
    import faiss

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
