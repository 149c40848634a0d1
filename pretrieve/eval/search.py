"""First-stage retrieval: dense search shard by shard, and the BM25 baseline with bm25s.

Dense: inner product over the vectors (cosine when they are normalized), searched one block of documents at a
time (at most BLOCK_BYTES of vectors, within one shard), each query keeping a running top k merged with every
block's: no index holds the corpus, and memory-mapped shards are read once per search. `flat` is exact: a
block's scores come from one BLAS product [query batch, block] (at most SCORE_FLOATS of them at once), in
float64 rounded to float32, and each query's top k is ranked by score, then by corpus row (the earlier
document first). BLAS sums in an order that depends on the matrix shapes, which moves a float32 product by an
ulp between two batchings but a float64 one by ~1e-16, below float32's resolution: so a pair's score, and a
query's top k, are the same whatever the shards, blocks and query batches (a test checks them against one flat
index; float32 products would swap documents scoring within an ulp, as faiss's own do). On a machine with
faiss GPUs, `flat` blocks are searched there instead, each block sharded over the GPUs (co.shard, not a copy
per GPU); faiss then decides which of several documents tied at the k-th score stay in. The approximate
indexes, built per block for users who accept approximation: `hnsw` (graph, M = 32, efSearch = max(128, k)),
`ivf` (sqrt(N) lists, `nprobe` 32 searched, vectors kept exact) and `ivfpq` (the same lists, 8-bit PQ codes,
4-bit below 9,984 documents); `index_recall` measures one against `flat` (eval reports it).
Sparse: vocabulary-weight vectors (SPLADE-style, DupMAE's OT vector) as CSR rows; their inner products are
the inverted-index scores, searched part by part as dense blocks are (`sparse_search`). Hybrid: dense + weighted sparse, exact over the corpus or over the union of the
dense and sparse candidates of each query, re-scored exactly.
BM25, the lexical baseline, is eval.bm25.
`pair_scorer` scores chosen (query, document) pairs exactly as these searches do (eval.contrastive uses it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from pretrieve.eval.sparse_vectors import SparseVectors
from pretrieve.eval.vectors import ShardedVectors
from pretrieve.optional import FAISS, require

INDEXES = ("flat", "ivf", "ivfpq", "hnsw")
BLOCK_BYTES = 1 << 28  # document vectors searched at once (256 MiB)
SCORE_FLOATS = 1 << 25  # query x document scores computed at once (256 MiB in float64)

TopK = tuple[np.ndarray, np.ndarray]  # scores [queries, k] float32 (-inf: none), rows [queries, k] int64 (-1)


@dataclass(frozen=True)
class IndexOptions:
    kind: str = "flat"  # one of INDEXES
    nprobe: int = 32  # ivf, ivfpq: lists searched per query
    ef_search: int | None = None  # hnsw: candidates kept while searching (None: max(128, k))
    hnsw_m: int = 32  # hnsw: graph neighbours per vector

    def __post_init__(self):
        if self.kind not in INDEXES:
            raise ValueError(f"index: {self.kind!r} is not one of {', '.join(INDEXES)}")


def dense_search(doc_vectors: np.ndarray | ShardedVectors, doc_ids: list[str], query_vectors: np.ndarray,
                 query_ids: list[str], k: int = 1000, index: str | IndexOptions = "flat",
                 block_rows: int | None = None) -> dict[str, dict[str, float]]:
    """{query id: {doc id: score}} of each query's top k documents by inner product, best first; `doc_ids`
    names the rows of `doc_vectors` (an array, or shards)."""
    docs = doc_vectors if isinstance(doc_vectors, ShardedVectors) else ShardedVectors([doc_vectors], doc_ids)
    scores, rows = top_k(docs, query_vectors, k, index, block_rows)
    return {qid: {doc_ids[r]: float(s) for r, s in zip(row, score) if r >= 0}
            for qid, row, score in zip(query_ids, rows.tolist(), scores.tolist())}


def top_k(docs: ShardedVectors, query_vectors: np.ndarray, k: int, index: str | IndexOptions = "flat",
          block_rows: int | None = None) -> TopK:
    """Each query's top min(k, documents) (scores, global rows), block by block (`block_rows` documents at a
    time, default BLOCK_BYTES of them), ranked by score and then row."""
    index = index if isinstance(index, IndexOptions) else IndexOptions(index)
    exact = index.kind == "flat" and not faiss_gpus()  # else faiss, which takes float32
    dtype = np.dtype(np.float64 if exact else np.float32)
    queries = np.ascontiguousarray(query_vectors, dtype=dtype)
    k = min(k, len(docs))
    best_scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    best_rows = np.full((len(queries), k), -1, dtype=np.int64)
    for start, block in docs.blocks(block_rows or max(1, BLOCK_BYTES // (dtype.itemsize * max(1, docs.dim))), dtype):
        search = partial(exact_top_k, block=block, k=k) if exact else _faiss_search(block, k, index)
        batch = max(2, SCORE_FLOATS // len(block))
        for first in range(0, len(queries), batch):
            scores, rows = search(queries[first:first + batch])
            found = (np.where(rows >= 0, scores, -np.inf), np.where(rows >= 0, rows + start, -1))
            part = slice(first, first + batch)
            best_scores[part], best_rows[part] = _merge((best_scores[part], best_rows[part]), found, k)
    return best_scores, best_rows


def _merge(a: TopK, b: TopK, k: int) -> TopK:
    """The top k of two top lists of the same queries (disjoint rows), by score and then row."""
    scores, rows = np.concatenate([a[0], b[0]], axis=1), np.concatenate([a[1], b[1]], axis=1)
    order = np.lexsort((rows, -scores), axis=1)[:, :k]
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(rows, order, axis=1)


def exact_top_k(queries: np.ndarray, block: np.ndarray, k: int) -> TopK:
    """The top min(k, len(block)) (scores, rows) of each query in one block, by score and then row."""
    return top_k_of_scores((queries @ block.T).astype(np.float32), k)  # float64 operands (top_k): module docstring


def top_k_of_scores(scores: np.ndarray, k: int) -> TopK:
    """The top min(k, columns) (scores, columns) of each row of `scores` [queries, documents], by score and then
    column: every column scoring at least the k-th best score is a candidate, so ties at the k-th place go to the
    earliest."""
    n = scores.shape[1]
    k = min(k, n)
    if n > k:
        kth = np.partition(scores, n - k, axis=1)[:, n - k]  # each query's k-th best score
        query, row = np.nonzero(scores >= kth[:, None])
    else:
        query, row = np.repeat(np.arange(len(scores)), n), np.tile(np.arange(n), len(scores))
    score = scores[query, row]
    order = np.lexsort((row, -score, query))  # by query, then score (best first), then row
    query, row, score = query[order], row[order], score[order]
    keep = np.arange(len(query)) - np.searchsorted(query, query) < k  # a query's first k candidates
    return score[keep].reshape(-1, k), row[keep].reshape(-1, k)


def faiss_gpus() -> int:
    """GPUs faiss can use here (0 with a CPU-only faiss build, or without faiss: exact search needs none)."""
    import importlib.util

    if importlib.util.find_spec("faiss") is None:
        return 0
    import faiss

    return faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0


def _faiss_search(block: np.ndarray, k: int, index: IndexOptions) -> Callable[[np.ndarray], TopK]:
    """queries -> (scores, rows within the block) of their top min(k, len(block)) by a faiss index of the block."""
    built = _faiss_index(block, k, index)
    return lambda queries: built.search(queries, min(k, len(block)))


def _faiss_index(block: np.ndarray, k: int, index: IndexOptions):
    faiss = require(FAISS, f"the {index.kind} index")

    dim, count = block.shape[1], len(block)
    if index.kind == "flat":  # on GPUs, each holding a share of the block (not a copy each)
        built = faiss.IndexFlatIP(dim)
        built.add(block)
        options = faiss.GpuMultipleClonerOptions()
        options.shard = True
        return faiss.index_cpu_to_all_gpus(built, co=options)
    if index.kind == "hnsw":
        built = faiss.IndexHNSWFlat(dim, index.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        built.hnsw.efSearch = index.ef_search or max(128, k)
    else:
        lists = max(1, int(math.sqrt(count)))
        if index.kind == "ivf":
            codes = "Flat"
        else:
            sub = next(m for m in (dim // 4, dim // 2, dim, 1) if m >= 1 and dim % m == 0)
            codes = f"PQ{sub}x{8 if count >= 39 * 256 else 4}"  # k-means wants ~39 points per centroid
        built = faiss.index_factory(dim, f"IVF{lists},{codes}", faiss.METRIC_INNER_PRODUCT)
        built.train(block)
        built.nprobe = min(index.nprobe, lists)
    built.add(block)
    return built


def index_recall(approximate: dict[str, dict[str, float]], exact: dict[str, dict[str, float]]) -> float:
    """Mean over the queries of `exact` of the share of each one's exact top k that `approximate` found."""
    shares = [len(approximate.get(q, {}).keys() & docs.keys()) / len(docs) for q, docs in exact.items() if docs]
    return float(np.mean(shares)) if shares else 1.0


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
    """Top k by the inner product of sparse vocabulary vectors (documents: CSR [D, V] or SparseVectors' parts;
    queries: CSR [Q, V]), ranked by score and then row; documents sharing no term with the query are left out.
    Part by part, each part's inverted index (its transpose: a posting list of documents per term) is
    multiplied by a batch of queries, at most SCORE_FLOATS scores at once, and each query keeps a running top
    k: memory holds the documents' vectors and one [query batch, part] of scores, never [Q, D]."""
    docs = doc_weights if isinstance(doc_weights, SparseVectors) else SparseVectors([doc_weights.tocsr()], doc_ids)
    scores, rows = sparse_top_k(docs, query_weights, k)
    return {qid: {doc_ids[r]: float(s) for r, s in zip(row, score) if r >= 0}
            for qid, row, score in zip(query_ids, rows.tolist(), scores.tolist())}


def sparse_top_k(docs: SparseVectors, query_weights, k: int) -> TopK:
    """sparse_search's (scores, global rows) of each query's top min(k, documents); a query sharing a term with
    fewer documents keeps -inf / -1 in the places left."""
    queries = query_weights.tocsr()
    k = min(k, len(docs))
    best_scores = np.full((queries.shape[0], k), -np.inf, dtype=np.float32)
    best_rows = np.full((queries.shape[0], k), -1, dtype=np.int64)
    for start, part in docs.blocks():
        inverted = part.T.tocsr()  # [V, n]: row t lists the part's documents holding term t
        batch = max(1, SCORE_FLOATS // max(1, part.shape[0]))
        for first in range(0, queries.shape[0], batch):
            scores, rows = top_k_of_scores((queries[first:first + batch] @ inverted).toarray().astype(
                np.float32, copy=False), k)  # float32 rows already: no copy
            found = (np.where(scores > 0, scores, -np.inf), np.where(scores > 0, rows + start, -1))
            part_rows = slice(first, first + batch)
            best_scores[part_rows], best_rows[part_rows] = _merge((best_scores[part_rows], best_rows[part_rows]),
                                                                  found, k)
    return best_scores, best_rows


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
