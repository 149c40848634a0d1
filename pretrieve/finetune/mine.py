"""`pretrieve mine`: ANN hard negatives for stage 2 (RetroMAE-2 (ACL 2023) eq. 14; ANCE) and
`pretrieve teacher-scores`: cross-encoder soft labels for stage 3 (eq. 15).

Mining encodes the corpus and the training queries with the stage-1 model, searches (eval.search; with pooling
`dupmae`: eq. 12 through eval.evaluate's vocabulary search, as `pretrieve eval` does; with `sparse`: the
SPLADE vectors through inverted indexes, the corpus streamed as for dense vectors), removes each query's
positives from its ranking, leaves out the top `skip` ranks (likely unjudged positives), and samples
`negatives` of the remaining results down to rank `depth` (CoT-MoTE: 15 negatives from depth 200), from a
generator seeded by (seed, the query's place in the data). The corpus is the set's corpus for MS MARCO / BEIR
data (positives: the documents judged relevant, by id), else every distinct passage of the training file
(positives: the example's own passages).

At MS MARCO scale (8.8M passages, ~500k training queries), the corpus is streamed, never held as text: a set's
corpus is encoded as `pretrieve eval` does, or read as the vectors `pretrieve encode` wrote (`embeddings`,
memory-mapped and searched shard by shard), and only the texts of the positives and picked negatives are read
back, in one more pass. Worker `worker` of `workers` mines the worker-th contiguous share of the queries (every
worker encodes all the queries, so their vectors, and the search's scores, are those of one process) into
OUT.part-<worker>-of-<workers>; the worker that finds every part written concatenates them, in worker order,
into OUT under a lock and removes the parts. The merged file is what one process writes, byte for byte.
OUT.settings.json holds the settings while the parts exist: a worker started with other settings is refused.
Both commands write JSON lines in the fine-tuning format (finetune.examples), through a temporary file and a
rename.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from pretrieve.finetune.examples import Example, write_examples
from pretrieve.utils.output_folder import check_file_output

PASSAGE_MAX_LENGTH = 144  # passage tokens when neither a flag nor the model says (CoT-MoTE's fine-tuning length)


@dataclass
class MineOptions:
    model: str
    out: str
    data: list[str] = field(default_factory=list)
    msmarco: str | None = None
    beir: str | None = None
    split: str = "train"
    on_missing: str = "fail"
    depth: int = 200
    negatives: int = 15
    skip: int = 0
    pooling: str | None = None  # None: what the model says (eval.model_config), else cls
    normalize: bool | None = None  # None: what the model says, else off
    max_length: int | None = None  # passage tokens; None: what the model says, else PASSAGE_MAX_LENGTH
    query_max_length: int = 32  # a query's tokens after its prompt's (the model's query prompt)
    batch_size: int = 64
    index: str = "flat"
    nprobe: int = 32  # ivf / ivfpq
    ef_search: int | None = None  # hnsw
    embeddings: str | None = None  # the corpus vectors `pretrieve encode` wrote (MS MARCO / BEIR, cls / mean)
    worker: int = 0
    workers: int = 1
    seed: int = 42
    overwrite: bool = False  # replace an existing OUT (else refused)
    progress: bool = True


@dataclass
class MiningData:
    """The queries to mine for and the corpus they search."""
    queries: list[str]
    positives: list[list[str]]  # each query's positive document ids
    doc_ids: list[str]
    documents: Callable[[], Iterable[tuple[str, str]]]  # the corpus as (id, text), read again at each call

    def texts(self, wanted: set[str]) -> dict[str, str]:
        return {d: text for d, text in self.documents() if d in wanted}


def mine(opts: MineOptions) -> dict:
    from pretrieve.eval.encode import VOCAB_POOLINGS
    from pretrieve.eval.model_config import resolve_encoding

    _check(opts)
    check_file_output(opts.out, "mined examples", opts.overwrite)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)  # now, not after hours of encoding
    encoding = resolve_encoding(opts.model, opts.pooling, opts.normalize, opts.max_length, PASSAGE_MAX_LENGTH)
    if opts.embeddings and encoding.pooling in VOCAB_POOLINGS:
        raise ValueError(f"--embeddings: vectors of a cls, mean or last encoder; pooling {encoding.pooling} "
                         f"({encoding.source}) searches by its vocabulary vectors, which mining computes itself")
    source = _mining_data(opts)
    settings = {**asdict(opts), "pooling": encoding.pooling, "normalize": encoding.normalize,
                "max_length": encoding.max_length, "progress": None, "worker": None, "overwrite": None, "queries": len(source.queries)}
    part = _part(opts) if opts.workers > 1 else Path(opts.out)
    if opts.workers > 1:
        from pretrieve.utils.run_dir import record_settings

        record_settings(_beside(opts.out, "settings.json"), settings, "mined parts")
    lo, hi = len(source.queries) * opts.worker // opts.workers, len(source.queries) * (opts.worker + 1) // opts.workers
    k = opts.depth + max(map(len, source.positives), default=0)  # over all queries: every worker searches as deep
    short = None
    if not (opts.workers > 1 and part.is_file()):  # a part written before a worker was stopped stands
        rank = _sparse_ranking if encoding.pooling == "sparse" else \
            _vocab_ranking if encoding.pooling in VOCAB_POOLINGS else _dense_ranking
        short = _write_negatives(opts, source, rank(opts, encoding, source, lo, hi, k), lo, hi, part)
    return {"out": opts.out, "queries": hi - lo, "corpus": len(source.doc_ids), "pooling": encoding.pooling,
            "normalize": encoding.normalize, "queries_with_fewer_negatives": short,
            **({"part": str(part), "merged": _merge_parts(opts)} if opts.workers > 1 else {})}


def _check(opts: MineOptions) -> None:
    if opts.depth < 1 or opts.negatives < 1 or not 0 <= opts.skip < opts.depth:
        raise ValueError(f"need depth >= 1, negatives >= 1 and 0 <= skip < depth (got depth {opts.depth}, "
                         f"negatives {opts.negatives}, skip {opts.skip})")
    if bool(opts.data) + (opts.msmarco is not None) + (opts.beir is not None) != 1:
        raise ValueError("give one of --data FILE..., --msmarco DIR or --beir DIR")
    if opts.embeddings and opts.data:
        raise ValueError("--embeddings: vectors of an MS MARCO / BEIR corpus (`pretrieve encode`); with --data the "
                         "corpus is the training file's own passages, encoded here")
    if not 0 <= opts.worker < opts.workers:
        raise ValueError(f"worker {opts.worker} is not in 0..{opts.workers - 1}")


def _mining_data(opts: MineOptions) -> MiningData:
    from pretrieve.data.retrieval import load_retrieval_set, stream_corpus
    from pretrieve.finetune.examples import positive_ids, read_all

    if opts.data:
        examples = read_all(opts.data)
        corpus = list(dict.fromkeys(t for e in examples for t in (*e.pos, *e.neg)))
        row = {t: str(i) for i, t in enumerate(corpus)}
        doc_ids = [str(i) for i in range(len(corpus))]
        return MiningData([e.query for e in examples], [[row[t] for t in e.pos] for e in examples], doc_ids,
                          lambda: zip(doc_ids, corpus))
    data = load_retrieval_set(opts.beir, opts.msmarco, opts.split, opts.on_missing, texts=False)
    positives = positive_ids(data)
    return MiningData([data.queries[q] for q in positives], list(positives.values()), list(data.corpus),
                      lambda: stream_corpus(opts.beir, opts.msmarco))


Ranking = Callable[[int], list[str]]  # query number -> its top documents' ids, best first


def _dense_ranking(opts: MineOptions, encoding, source: MiningData, lo: int, hi: int, k: int) -> Ranking:
    """The rankings of queries lo..hi-1 by the encoder's vectors (held as rows: 500k queries x 215 ranks are
    860 MB of int64, where as strings in dicts they would be gigabytes)."""
    from pretrieve.eval.encode import DenseEncoder
    from pretrieve.eval.search import IndexOptions, top_k
    from pretrieve.eval.vectors import check_same_documents, encode_corpus, open_corpus_vectors

    # query_max_length counts a query's own tokens, after its prompt's (as fine-tuning's query_max_len)
    encoder = DenseEncoder(opts.model, encoding.encode_options(opts.batch_size, opts.query_max_length))
    if opts.embeddings:
        docs = open_corpus_vectors(opts.embeddings, encoder.settings(), source.doc_ids)
    else:
        docs = encode_corpus(encoder, source.documents(), progress=opts.progress, total=len(source.doc_ids))
        check_same_documents(opts.beir or opts.msmarco or "the training data", docs.ids, source.doc_ids)
    queries = encoder.encode(source.queries, desc="encode queries", progress=opts.progress, queries=True)
    _, rows = top_k(docs, queries[lo:hi], k, IndexOptions(opts.index, opts.nprobe, opts.ef_search))
    return lambda i: [source.doc_ids[r] for r in rows[i - lo].tolist() if r >= 0]


def _sparse_ranking(opts: MineOptions, encoding, source: MiningData, lo: int, hi: int, k: int) -> Ranking:
    """As _dense_ranking, by SPLADE vectors: the corpus streamed through the encoder part by part and searched
    through each part's inverted index (eval.sparse_vectors, eval.search.sparse_top_k), its texts never held."""
    from pretrieve.eval.encode import VocabEncoder
    from pretrieve.eval.search import sparse_top_k
    from pretrieve.eval.sparse_vectors import encode_sparse_corpus
    from pretrieve.eval.vectors import check_same_documents

    # query_max_length counts a query's own tokens, after its prompt's (as fine-tuning's query_max_len)
    encoder = VocabEncoder(opts.model, encoding.encode_options(opts.batch_size, opts.query_max_length))
    docs = encode_sparse_corpus(encoder, source.documents(), progress=opts.progress)
    check_same_documents(opts.beir or opts.msmarco or "the training data", docs.ids, source.doc_ids)
    _, queries = encoder.encode(source.queries, documents=False, desc="encode queries", progress=opts.progress)
    _, rows = sparse_top_k(docs, queries[lo:hi], k)
    return lambda i: [source.doc_ids[r] for r in rows[i - lo].tolist() if r >= 0]


def _vocab_ranking(opts: MineOptions, encoding, source: MiningData, lo: int, hi: int, k: int) -> Ranking:
    """As _dense_ranking, by DupMAE's eq. (12) (or hybrid); the corpus's texts are held to encode them."""
    from dataclasses import replace

    from pretrieve.eval.encode import VocabEncoder
    from pretrieve.eval.evaluate import encode_vocab, search_vocab

    encoder = VocabEncoder(opts.model, encoding.encode_options(opts.batch_size, opts.query_max_length))
    vectors = encode_vocab(encoder, [text for _, text in source.documents()], source.queries, opts.progress)
    ours = replace(vectors, dense_queries=None if vectors.dense_queries is None else vectors.dense_queries[lo:hi],
                   sparse_queries=vectors.sparse_queries[lo:hi])
    run = search_vocab(ours, source.doc_ids, [str(i) for i in range(lo, hi)], k)
    return lambda i: sorted(run[str(i)], key=lambda d: -run[str(i)][d])


def _write_negatives(opts: MineOptions, source: MiningData, ranking: Ranking, lo: int, hi: int, path: Path) -> int:
    """Sample each query's negatives, read their texts and the positives', write the examples to PATH; returns
    how many queries got fewer than `negatives`."""
    picks = []
    for i in range(lo, hi):
        positives = set(source.positives[i])
        pool = [d for d in ranking(i) if d not in positives][opts.skip:opts.depth]
        picks.append(random.Random(f"{opts.seed}/{i}").sample(pool, min(opts.negatives, len(pool))))
    texts = source.texts({d for i in range(lo, hi) for d in (*source.positives[i], *picks[i - lo])})
    write_examples(path, (Example(source.queries[i], [texts[d] for d in source.positives[i]],
                                  [texts[d] for d in picks[i - lo]]) for i in range(lo, hi)))
    return sum(len(p) < opts.negatives for p in picks)


def _beside(out: str, suffix: str) -> Path:
    return Path(f"{out}.{suffix}")


def _part(opts: MineOptions, worker: int | None = None) -> Path:
    return _beside(opts.out, f"part-{opts.worker if worker is None else worker:05d}-of-{opts.workers:05d}")


def _merge_parts(opts: MineOptions) -> bool:
    """Concatenate the parts into OUT once all are written; True if this call did. The lock (POSIX, dropped by
    the kernel if its holder dies) makes one of several workers finishing together do it."""
    parts = [_part(opts, worker) for worker in range(opts.workers)]
    with open(_beside(opts.out, "lock"), "a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        if not all(part.is_file() for part in parts):
            return False
        out = Path(opts.out)
        tmp = out.with_name(f".{out.name}.tmp")
        with open(tmp, "wb") as merged:
            for part in parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, merged)
        os.replace(tmp, out)
        for part in parts:
            part.unlink()
        _beside(opts.out, "settings.json").unlink(missing_ok=True)
    _beside(opts.out, "lock").unlink(missing_ok=True)
    return True


@dataclass
class TeacherOptions:
    model: str  # a cross-encoder export (`pretrieve finetune` with finetune.model=cross)
    data: list[str]
    out: str
    max_length: int = 176
    batch_size: int = 64
    overwrite: bool = False  # replace an existing OUT (else refused)
    progress: bool = True


def teacher_scores(opts: TeacherOptions) -> dict:
    """Score every (query, passage) pair of the data with the cross-encoder; write them as pos/neg_scores."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pretrieve.finetune.examples import read_all
    from pretrieve.models.encoder import check_weights
    from pretrieve.progress import track

    check_weights(opts.model)
    check_file_output(opts.out, "scored examples", opts.overwrite)
    examples = read_all(opts.data)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model = AutoModelForSequenceClassification.from_pretrained(opts.model, local_files_only=True).to(device).eval()
    if model.config.num_labels != 1:
        raise ValueError(f"{opts.model}: a cross-encoder export has one output label, this model has "
                         f"{model.config.num_labels}")
    pairs = [(i, text) for i, e in enumerate(examples) for text in (*e.pos, *e.neg)]
    scores: list[float] = []
    with torch.inference_mode():
        for start in track(range(0, len(pairs), opts.batch_size), desc="teacher scores", unit="batch",
                           enabled=opts.progress, leave=False):
            chunk = pairs[start:start + opts.batch_size]
            batch = tokenizer([examples[i].query for i, _ in chunk], [t for _, t in chunk], truncation=True,
                              max_length=opts.max_length, padding=True, return_tensors="pt").to(device)
            scores.extend(model(**batch).logits.squeeze(-1).float().tolist())
    cursor = 0
    scored = []
    for e in examples:
        pos = scores[cursor:cursor + len(e.pos)]
        neg = scores[cursor + len(e.pos):cursor + len(e.pos) + len(e.neg)]
        cursor += len(e.pos) + len(e.neg)
        scored.append(Example(e.query, e.pos, e.neg, pos, neg))
    write_examples(opts.out, scored)
    return {"out": opts.out, "queries": len(scored), "pairs": len(pairs)}
