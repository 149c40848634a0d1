"""The worker pool of `pretrieve prepare`: chunks of records in, each record's samples out, in input order.

Each of `workers` processes tokenizes (HF fast tokenizer, one thread each) and packs (packing.py) the records
of a chunk; with `workers` 0 the main process does it. A record travels as a `Pending` and comes back as the
record of its kind: `DocumentBlocks` (a document's packed blocks), `PairSamples` (a pair record's samples) or
`Skipped` (a bad record, or a document with no tokens). Packing's random draws are seeded by the record index,
so the results do not depend on the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from pretrieve.data import pairs
from pretrieve.data.corpora import BadRecord, Cursor, Document
from pretrieve.data.packing import pack_sentences, sentence_starts, sentence_token_bounds
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.tokenizer import load_backend


class Pending(NamedTuple):
    """A record on its way to a worker: its index over the input and the cursor that reads it again."""
    index: int
    cursor: Cursor
    record: Document | pairs.PairRecord | BadRecord


class DocumentBlocks(NamedTuple):
    """A document tokenized and packed into blocks; `queries` its pseudo-queries as token ids."""
    index: int
    cursor: Cursor
    doc_id: str
    blocks: list[np.ndarray]
    truncated: int  # 1 when passage packing cut the document
    queries: list[list[int]]


class PairSamples(NamedTuple):
    """A pair record's samples, each (token ids, meta)."""
    index: int
    cursor: Cursor
    doc_id: str
    samples: list[tuple[np.ndarray, dict]]
    truncated: int  # texts cut to a block's length


class Skipped(NamedTuple):
    """A record that gives no samples: `reason` is what `--on-error skip` counts it under."""
    index: int
    cursor: Cursor
    reason: str
    where: str
    detail: str


Result = DocumentBlocks | PairSamples | Skipped


class WorkerConfig(NamedTuple):
    tokenizer: str
    max_tokens: int  # a block's tokens, special tokens not counted
    packing: str
    short_seq_prob: float
    seed: int
    spans: pairs.SpanOptions


def tokenized(work: Iterator[list[Pending]], opts: PrepareOptions) -> Iterator[Result]:
    """Each record's result, in input order."""
    config = WorkerConfig(opts.tokenizer, opts.max_len - 2, opts.resolved_packing(), opts.short_seq_prob,
                          opts.seed, opts.span_options())
    with _progress(opts) as bar:
        if opts.workers <= 0:
            _init_worker(config)
            results = map(_process_chunk, work)
            pool = None
        else:
            pool = multiprocessing.get_context("fork").Pool(opts.workers, initializer=_init_worker, initargs=(config,))
            results = pool.imap(_process_chunk, work)
        try:
            for chunk_result in results:
                for result in chunk_result:
                    if not isinstance(result, Skipped):
                        bar.update(1)
                    yield result
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()


def _progress(opts: PrepareOptions):
    """A bar on a terminal, a line every 30 s otherwise (a SLURM log); none with progress=False."""
    from pretrieve.progress import Progress

    return Progress(None, f"prepare {opts.source}", unit="docs", enabled=opts.progress is not False)


_WORKER: dict = {}


def _init_worker(config: WorkerConfig) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; parallelism comes from the pool
    _WORKER.update(config._asdict(), backend=load_backend(config.tokenizer))


def _process_chunk(chunk: list[Pending]) -> list[Result]:
    docs = [item for item in chunk if isinstance(item.record, Document)]  # (pairs tokenize per record: _pair_result)
    encodings = _WORKER["backend"].encode_batch([item.record.text for item in docs], add_special_tokens=False)
    encoded = {item.index: enc for item, enc in zip(docs, encodings)}
    queries = [q for item in docs for q in item.record.queries]
    query_ids = iter(_WORKER["backend"].encode_batch(queries, add_special_tokens=False) if queries else ())
    results = []
    for index, cursor, record in chunk:
        if isinstance(record, BadRecord):
            results.append(Skipped(index, cursor, record.reason, record.where, record.detail))
            continue
        if isinstance(record, pairs.PairRecord):
            results.append(_pair_result(index, cursor, record))
            continue
        # pseudo-queries as token id lists (JSON), each cut to a block's length
        query_tokens = [next(query_ids).ids[:_WORKER["max_tokens"]] for _ in record.queries]
        enc = encoded[index]
        ids = np.asarray(enc.ids, dtype=np.int32)
        if len(ids) == 0:
            results.append(Skipped(index, cursor, "empty", record.where, "no tokens after tokenization"))
            continue
        blocks, truncated = _blocks(ids, record.text, enc, index)
        results.append(DocumentBlocks(index, cursor, record.doc_id, blocks, truncated, [q for q in query_tokens if q]))
    return results


def _pair_result(index: int, cursor: Cursor, record: pairs.PairRecord) -> PairSamples:
    backend, max_tokens = _WORKER["backend"], _WORKER["max_tokens"]
    if record.text is None:
        samples, truncated = pairs.text_pair_samples(backend, record.pairs, max_tokens)
    else:
        enc = backend.encode(record.text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        ends = sentence_token_bounds(enc, sentence_starts(record.text)) if len(ids) else np.zeros(0, np.int64)
        samples, truncated = pairs.span_pair_samples(ids, ends, max_tokens, _WORKER["spans"], index), 0
    return PairSamples(index, cursor, record.doc_id, samples, truncated)


def _blocks(ids: np.ndarray, text: str, enc, index: int) -> tuple[list[np.ndarray], int]:
    max_tokens = _WORKER["max_tokens"]
    if _WORKER["packing"] == "passage":
        return [ids[:max_tokens]], int(len(ids) > max_tokens)
    ends = sentence_token_bounds(enc, sentence_starts(text))
    prob = _WORKER["short_seq_prob"]
    rng = np.random.default_rng([_WORKER["seed"], index]) if prob > 0 else None
    return [ids[a:b] for a, b in pack_sentences(ends, max_tokens, prob, rng)], 0
