"""`pretrieve eval`: score one encoder (or BM25) on one retrieval set and write the evaluation outputs.

OUT/metrics.json (the metrics of eval.metrics plus what was run), OUT/run.trec (top `depth` per query, in
trec_eval's order) and OUT/per_query.jsonl (docs/design.md, "Evaluation output"), each written through a temporary
file and a rename. `--bm25` with a model also writes the BM25 baseline to OUT/bm25/ (baseline_table puts the
two side by side). With `contrastive_entropy` (K), metrics.json and per_query.jsonl add the model's contrastive
entropy against K fixed sampled negatives (eval.contrastive, Fang et al. 2024; docs/design.md, "Validation and study
metrics"), computed on the vectors the search used.

Dense and sparse retrieval and BM25 never hold the corpus's texts, and the corpus is read once: streamed through
the encoder (eval.vectors.encode_corpus, eval.sparse_vectors.encode_sparse_corpus; vectors in memory) and, with
`bm25`, through BM25's index writer at the same time (eval.bm25: an index on disk in OUT[/bm25]/bm25-index while
the evaluation runs, searched memory-mapped), the set's document ids taken from that stream. With `embeddings`
(dense poolings only) and no `bm25` only the ids are read: `pretrieve encode`'s shards are memory-mapped and
searched block by block. The hybrid and dupmae poolings hold the texts (their candidates need the dense and
sparse halves at once), and BM25 beside them indexes those. An approximate `index`
(ivf, ivfpq, hnsw) adds `index_recall@<depth>` to metrics.json: the share of the exact top `depth` it found,
over up to RECALL_QUERIES of the queries (evenly spaced) searched again with `flat`. `dim` searches a dense
model's vectors cut to their first N coordinates (a Matryoshka model's prefix, eval.encode), recorded in
metrics.json.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from pretrieve.data.retrieval import RetrievalSet, load_retrieval_set, require_retrieval_files, stream_corpus
from pretrieve.eval import bm25
from pretrieve.eval.bm25 import IndexWriter
from pretrieve.eval.contrastive import ContrastiveEntropy, check_options, contrastive_entropy
from pretrieve.eval.encode import DenseEncoder, EncodeOptions, VocabEncoder
from pretrieve.eval.metrics import evaluate, trec_run_lines
from pretrieve.eval.model_config import resolve_encoding
from pretrieve.eval.options import EvalOptions
from pretrieve.eval.search import (IndexOptions, dense_search, hybrid_search, index_recall, pair_scorer,
                                   sparse_search)
from pretrieve.eval.sparse_vectors import encode_sparse_corpus
from pretrieve.eval.vectors import encode_corpus, open_corpus_vectors
from pretrieve.models.poolings import DENSE_POOLINGS, PROMPT_POOLINGS, VOCAB_POOLINGS
from pretrieve.utils.output_folder import check_whole_output
from pretrieve.utils.run_dir import write_atomic

EXACT_HYBRID_DOCS = 100_000  # up to here hybrid / DupMAE scores are exact over the corpus; beyond, candidates
RECALL_QUERIES = 1_000  # queries an approximate index's recall against flat is measured on
BM25_INDEX = "bm25-index"  # BM25's index, in its output folder while the evaluation runs
# what an evaluation's folder holds: its files, the BM25 baseline, MTEB's results (eval.mteb_eval.RESULTS), the
# farm's record of its MLflow run
OUTPUTS = ("metrics.json", "run.trec", "per_query.jsonl", "bm25", BM25_INDEX, "mteb", "mlflow.json")
FARM_LOG = "eval.log"  # a farm job's log, in the job's output folder from before its evaluation starts


def check_eval_folder(out: str | Path, overwrite: bool) -> None:
    """OUT before any work: new, empty, or an earlier evaluation (OUTPUTS alone, a metrics.json among them
    pretrieve's), which `overwrite` removes now; anything else is refused, naming it (utils/output_folder.py). A
    farm's job log and a stopped evaluation's temporary files (.NAME.tmp) are left as they are."""
    def is_earlier(folder: Path) -> bool:
        metrics = folder / "metrics.json"
        return all(p.name in OUTPUTS or kept(p.name) for p in folder.iterdir()) and (
            not metrics.is_file() or "retriever" in _json_object(metrics))

    def kept(name: str) -> bool:
        return name == FARM_LOG or (name.startswith(".") and name.endswith(".tmp"))

    check_whole_output(out, "pretrieve eval output", is_earlier, overwrite, kept)
    for name in OUTPUTS:  # metrics.json first: a stop during the removal leaves no finished-looking folder
        path = Path(out) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def run_eval(opts: EvalOptions) -> dict:
    """Evaluate; returns the model's metrics.json content (BM25's when there is no model)."""
    if opts.model is None and not opts.bm25:
        raise ValueError("give --model DIR, or --bm25 for the BM25 baseline")
    if opts.mteb is not None and opts.model is None:
        raise ValueError("--mteb evaluates a model: give --model DIR")
    if opts.contrastive_entropy is not None and opts.model is None:
        raise ValueError("--contrastive-entropy scores a model's own similarities: give --model DIR (BM25 scores "
                         "share no scale with a softmax over inner products, so the BM25 baseline has none)")
    check_eval_folder(opts.out, opts.overwrite)
    encoding = None
    if opts.model is not None:
        encoding = resolve_encoding(opts.model, opts.pooling, opts.normalize, opts.max_length,
                                    query_prompt=opts.query_prompt, passage_prompt=opts.passage_prompt)
        opts = replace(opts, pooling=encoding.pooling, normalize=encoding.normalize, max_length=encoding.max_length,
                       query_prompt=encoding.query_prompt, passage_prompt=encoding.passage_prompt)
    if opts.dim is not None and (opts.model is None or opts.pooling not in (*DENSE_POOLINGS, *PROMPT_POOLINGS)):
        raise ValueError(f"--dim {opts.dim}: cuts a dense model's vectors to their first coordinates (Matryoshka); "
                         + ("give --model DIR" if opts.model is None else
                            f"pooling {opts.pooling} is not dense (give --pooling cls, mean or last)"))
    if opts.embeddings and opts.pooling in VOCAB_POOLINGS:
        raise ValueError(f"--embeddings: vectors of a cls, mean or last encoder (`pretrieve encode`); pooling "
                         f"{opts.pooling} searches by vocabulary vectors, which eval computes itself: drop --embeddings")
    if opts.mteb is not None:
        return _mteb(opts, encoding)
    if opts.contrastive_entropy is not None:  # the settings now; K against the corpus once its size is known
        check_options(opts.contrastive_entropy, opts.ce_temperature)
    out = Path(opts.out)
    bm25_out = out / "bm25" if opts.model is not None else out
    with IndexWriter(bm25_out / BM25_INDEX) if opts.bm25 else nullcontext() as bm25_index:
        data, vectors = read_set_once(opts, bm25_index)
        if opts.contrastive_entropy is not None:
            check_options(opts.contrastive_entropy, opts.ce_temperature, data.qrels, len(data.corpus))
        result = _model(opts, data, vectors, encoding.source) if opts.model is not None else None
        if opts.bm25:
            started = time.perf_counter()
            index = bm25_index.finish()
            try:
                run = bm25.search(index, bm25_index.ids, data.queries, k=opts.depth)
            finally:
                shutil.rmtree(index)
            bm25_result = _write(bm25_out, data, run, {**_describe(opts, data, dense=False), "retriever": "bm25",
                                                       "k1": bm25.K1, "b": bm25.B,
                                                       "seconds": round(time.perf_counter() - started, 1)})
            result = result or bm25_result
    return result


def _mteb(opts: EvalOptions, encoding) -> dict:
    """`--mteb`: MTEB searches and scores with the model's dense vectors; what only pretrieve's search does is
    refused, naming the flag."""
    from pretrieve.optional import MTEB, require

    require(MTEB, "pretrieve eval --mteb")
    given = [flag for flag, on in (("--beir / --msmarco", opts.beir or opts.msmarco),
                                   ("--bm25", opts.bm25), ("--embeddings", opts.embeddings),
                                   ("--contrastive-entropy", opts.contrastive_entropy is not None),
                                   (f"--index {opts.index}", opts.index != "flat")) if on]
    if given:
        raise ValueError(f"--mteb: MTEB encodes, searches (exactly) and scores a model's dense vectors itself; drop "
                         f"{', '.join(given)}")
    if encoding.pooling not in (*DENSE_POOLINGS, *PROMPT_POOLINGS):
        raise ValueError(f"--mteb: pooling {encoding.pooling} ({encoding.source}) is not a dense pooling; MTEB "
                         "scores dense vectors (give --pooling cls, mean, last or llama2vec)")
    from pretrieve.eval.mteb_eval import run_mteb

    return run_mteb(opts, encoding)


def read_set_once(opts: EvalOptions, bm25_index: IndexWriter | None = None):
    """(the retrieval set, the dense corpus vectors when they are encoded here, else None), reading the corpus
    once: the texts held for the hybrid and dupmae poolings, else streamed through the dense or sparse encoder and
    `bm25_index` (those that need it), the set's ids taken from the stream; only the ids when nothing needs the
    texts."""
    # sparse streams as dense does; hybrid and dupmae hold the texts (their candidates need both halves at once)
    held = opts.model is not None and opts.pooling in VOCAB_POOLINGS and opts.pooling != "sparse"
    encoder = None
    if opts.model is not None and opts.pooling == "sparse":
        encoder = vocab_encoder(opts)
    elif opts.model is not None and not held and not opts.embeddings:
        encoder = DenseEncoder(opts.model, encode_options(opts))
    if held or (encoder is None and bm25_index is None):
        data = load_retrieval_set(opts.beir, opts.msmarco, opts.split, opts.on_missing, texts=held)
        if bm25_index is not None:
            for doc_id in data.corpus:
                bm25_index.add(doc_id, data.doc_text(doc_id))
        return data, None
    require_retrieval_files(opts.beir, opts.msmarco, opts.split)  # before the long read, not after it
    documents = stream_corpus(opts.beir, opts.msmarco)
    if bm25_index is not None:
        documents = _indexing(documents, bm25_index)
    if encoder is None:
        ids, vectors = [doc_id for doc_id, _ in documents], None
    elif isinstance(encoder, VocabEncoder):
        docs = encode_sparse_corpus(encoder, documents, progress=opts.progress)
        ids, vectors = docs.ids, (encoder, docs)
    else:
        docs = encode_corpus(encoder, documents, progress=opts.progress)
        ids, vectors = docs.ids, (encoder, docs)
    return load_retrieval_set(opts.beir, opts.msmarco, opts.split, opts.on_missing, doc_ids=ids), vectors


def vocab_encoder(opts: EvalOptions) -> VocabEncoder:
    return VocabEncoder(opts.model, encode_options(opts), top_k=opts.vocab_top_k)


def encode_options(opts: EvalOptions) -> EncodeOptions:
    return EncodeOptions(opts.pooling, opts.max_length, opts.batch_size, opts.normalize,
                         query_prompt=opts.query_prompt or "", passage_prompt=opts.passage_prompt or "", dim=opts.dim)


def _indexing(documents, index: IndexWriter):
    """The (id, text) stream, each document added to `index` as it passes."""
    for doc_id, text in documents:
        index.add(doc_id, text)
        yield doc_id, text


def _model(opts: EvalOptions, data: RetrievalSet, vectors, encoding_from: str) -> dict:
    """Search with the model, write OUT's files; its metrics.json content."""
    started = time.perf_counter()
    doc_ids, query_ids = list(data.corpus), list(data.queries)
    query_texts, info = [data.queries[q] for q in query_ids], {}
    if opts.pooling == "sparse":  # the corpus as read_set_once encoded it while streaming
        encoder, docs = vectors
        opts = replace(opts, vocab_top_k=encoder.top_k)
        _, queries = encoder.encode(query_texts, documents=False, desc="encode queries", progress=opts.progress)
        run = sparse_search(docs, doc_ids, queries, query_ids, k=opts.depth)
        score = pair_scorer(None, None, docs, queries)
    elif opts.pooling in VOCAB_POOLINGS:
        encoder = vocab_encoder(opts)
        opts = replace(opts, vocab_top_k=encoder.top_k)
        vocab = encode_vocab(encoder, [data.doc_text(d) for d in doc_ids], query_texts, progress=opts.progress)
        run = search_vocab(vocab, doc_ids, query_ids, opts.depth, opts.sparse_weight, opts.candidates)
        score = pair_scorer(vocab.dense_docs, vocab.dense_queries, vocab.sparse_docs, vocab.sparse_queries,
                            opts.sparse_weight)
    else:
        run, score, info = _dense(opts, doc_ids, query_ids, query_texts, vectors)
    contrastive = None
    if opts.contrastive_entropy is not None:
        contrastive = contrastive_entropy(data.qrels, doc_ids, query_ids, score, opts.contrastive_entropy,
                                          opts.ce_temperature, opts.ce_seed)
    retriever = "dense" if opts.pooling in DENSE_POOLINGS else opts.pooling
    return _write(Path(opts.out), data, run, {**_describe(opts, data), "retriever": retriever, **info,
                                              "encoding_from": encoding_from,
                                              "seconds": round(time.perf_counter() - started, 1)}, contrastive)


def _dense(opts: EvalOptions, doc_ids: list[str], query_ids: list[str], query_texts: list[str], vectors=None):
    """(run, pair scorer, extra metrics) of a cls / mean encoder: `vectors` (encoder, corpus vectors) as
    `read_set_once` encoded them, or the vectors of `opts.embeddings`."""
    if vectors is not None:
        encoder, docs = vectors
    else:
        encoder = DenseEncoder(opts.model, encode_options(opts))
        docs = open_corpus_vectors(opts.embeddings, encoder.settings(), doc_ids)
    queries = encoder.encode(query_texts, desc="encode queries", progress=opts.progress, queries=True)
    index = IndexOptions(opts.index, opts.nprobe, opts.ef_search)
    run = dense_search(docs, doc_ids, queries, query_ids, k=opts.depth, index=index)
    info = {}
    if opts.index != "flat":
        sample = np.unique(np.linspace(0, len(query_ids) - 1, min(RECALL_QUERIES, len(query_ids))).astype(int))
        exact = dense_search(docs, doc_ids, queries[sample], [query_ids[i] for i in sample], k=opts.depth)
        info = {f"index_recall@{opts.depth}": round(index_recall(run, exact), 6), "index_recall_queries": len(sample)}
    return run, pair_scorer(docs, queries), info


@dataclass
class VocabVectors:
    """A VocabEncoder's output: dense [N, d] (None for `sparse`) and CSR [N, vocab] rows, documents and queries."""
    dense_docs: np.ndarray | None
    sparse_docs: object
    dense_queries: np.ndarray | None
    sparse_queries: object


def encode_vocab(encoder: VocabEncoder, doc_texts, query_texts, progress: bool = True) -> VocabVectors:
    dense_docs, sparse_docs = encoder.encode(doc_texts, documents=True, desc="encode corpus", progress=progress)
    dense_queries, sparse_queries = encoder.encode(query_texts, documents=False, desc="encode queries",
                                                   progress=progress)
    return VocabVectors(dense_docs, sparse_docs, dense_queries, sparse_queries)


def search_vocab(vectors: VocabVectors, doc_ids, query_ids, k: int, sparse_weight: float = 1.0,
                 candidates: int | None = None) -> dict:
    """{query id: {doc id: score}}, the top k by the encoder's pooling (sparse, hybrid or DupMAE's eq. 12): sparse
    alone when there are no dense vectors, else the hybrid score; `candidates`: re-score each query's dense +
    sparse top N instead of the whole corpus (default: exact up to EXACT_HYBRID_DOCS documents, max(1,000, k)
    candidates beyond)."""
    if candidates is None and len(doc_ids) > EXACT_HYBRID_DOCS:
        candidates = max(1000, k)
    if vectors.dense_docs is None:
        return sparse_search(vectors.sparse_docs, doc_ids, vectors.sparse_queries, query_ids, k=k)
    return hybrid_search(vectors.dense_docs, vectors.dense_queries, vectors.sparse_docs, vectors.sparse_queries,
                         doc_ids, query_ids, k=k, sparse_weight=sparse_weight, candidates=candidates)


_CONTRASTIVE_OPTIONS = ("contrastive_entropy", "ce_temperature", "ce_seed")  # recorded by ContrastiveEntropy.metrics


def _describe(opts: EvalOptions, data: RetrievalSet, dense: bool = True) -> dict:
    encoder_only = ("model", "pooling", "max_length", "normalize", "dim", "batch_size", "index", "nprobe", "ef_search",
                    "vocab_top_k", "sparse_weight", "candidates")
    info = {k: v for k, v in asdict(opts).items()
            if k not in ("out", "progress", "overwrite", "bm25", "embeddings", *_CONTRASTIVE_OPTIONS)
            and (dense or k not in encoder_only)}
    if info.get("model"):  # absolute: the record names the model wherever it is read (`pretrieve track`)
        info["model"] = str(Path(info["model"]).resolve())
    return {**info, "dataset": data.name, "documents": len(data.corpus), "queries": len(data.queries),
            "skipped_qrels": data.skipped}


TABLE_METRICS = ("ndcg@10", "mrr@10", "recall@100")


def baseline_table(out: str | Path) -> str:
    """The model of OUT beside its BM25 baseline in OUT/bm25 (`eval --model ... --bm25`), one aligned row each:
    system, TABLE_METRICS, the metrics.json it came from."""
    out = Path(out)
    rows = [["system", *TABLE_METRICS, "path"]]
    for path in (out / "metrics.json", out / "bm25" / "metrics.json"):
        metrics = json.loads(path.read_text())
        system = "bm25" if metrics["retriever"] == "bm25" else f"model ({metrics['retriever']})"
        rows.append([system, *(f"{metrics[k]:.4f}" for k in TABLE_METRICS), str(path)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _write(out: Path, data: RetrievalSet, run: dict, info: dict, contrastive: ContrastiveEntropy | None = None) -> dict:
    means, per_query = evaluate(data.qrels, run)
    if contrastive is not None:
        for qid, value in contrastive.per_query.items():
            per_query[qid]["contrastive_entropy"] = value
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "run.trec", "".join(line + "\n" for line in trec_run_lines(run, info["retriever"])))
    write_atomic(out / "per_query.jsonl", "".join(json.dumps({"query_id": q, **m}) + "\n"
                                                   for q, m in per_query.items()))
    result = {**{k: round(v, 6) for k, v in means.items()}, **(contrastive.metrics() if contrastive else {}), **info}
    write_atomic(out / "metrics.json", json.dumps(result, indent=1) + "\n")  # last: its presence means done
    return result
