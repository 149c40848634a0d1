"""The BM25 baseline at MS MARCO scale: an index built from a stream of documents in bounded memory, written to
disk in bm25s's format, and searched memory-mapped, a batch of queries at a time.

The score is bm25s's: its "lucene" BM25 with k1 = 0.9 and b = 0.4 (Anserini's defaults, which BEIR-style
comparisons use) over the tokens of `bm25s.tokenize` (lower-cased words without English stop words,
Snowball-stemmed); a document is its title + " " + text.

bm25s's own `BM25.index` holds every document's tokens as Python lists and sorts the whole score matrix in
memory: 3.3 GB at 1M passages, about 30 GB at MS MARCO's 8.8M. `IndexWriter` builds the same matrix in two
passes that each hold one part of it:

1. while the documents stream past, each chunk of CHUNK_DOCS is tokenized (`bm25s.tokenize`), its stems get
   corpus-wide ids (first seen, first numbered; a chunk's new stems in sorted order), and its (term, document,
   term frequency) triples go to disk sorted by term, then document: a run. Only the document frequencies, the
   document lengths and the stem -> id table stay in memory;
2. when the stream ends, the idf of each term and the average length are known, and the runs are merged a block
   of terms (at most MERGE_ENTRIES entries) at a time into the CSC score matrix, each entry
   idf(term) x tfc(tf, length, average length) by bm25s's own scoring functions, appended to the .npy files
   `bm25s.BM25.load` reads.

The result differs from `BM25.index`'s only in the numbering of the columns (it numbers the stems in the order
of a set): a column holds the same documents in the same order with the same float32 scores, and a query's
score of a document adds its terms' entries in the query's token order either way, so the scores, top k and
ties are the same floats (tests/test_bm25.py checks them against `BM25.index`). `search` loads the index with
`mmap=True`: the kernel pages its columns in as queries touch them, and QUERY_BATCH queries are scored at a
time, their results turned into the run before the next batch.

An index folder is whole or absent: it is built in a `.tmp` sibling, renamed when complete, and a failure
removes the partial one.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

K1, B = 0.9, 0.4
CHUNK_DOCS = 50_000  # documents tokenized at once
MERGE_ENTRIES = 1 << 22  # score-matrix entries merged at once (~80 MiB of working arrays)
QUERY_BATCH = 1_000  # queries scored at once
_RUN = np.dtype([("term", np.int32), ("doc", np.int32), ("tf", np.int32)])  # one entry of a run file


def _tokenize(texts: list[str], return_ids: bool = True):
    import bm25s
    import Stemmer

    return bm25s.tokenize(texts, stopwords="en", stemmer=Stemmer.Stemmer("english"), return_ids=return_ids,
                          show_progress=False)


class IndexWriter:
    """`add` (doc id, text) pairs in row order, then `finish()`; as a context manager, an exception (or a
    missing `finish`) removes the partial index. `ids` are the documents added, in row order."""

    def __init__(self, folder: str | Path, k1: float = K1, b: float = B, chunk_docs: int = CHUNK_DOCS):
        self.folder = Path(folder)
        self.tmp = self.folder.with_name(self.folder.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)  # a killed build's leftovers
        self.k1, self.b, self.chunk_docs = k1, b, chunk_docs
        self.ids: list[str] = []
        self.vocab: dict[str, int] = {}  # stem -> term id (column)
        self.df = np.zeros(0, dtype=np.int64)  # documents holding each term
        self.lengths: list[np.ndarray] = []  # tokens per document, a chunk at a time
        self.runs: list[tuple[Path, np.ndarray, np.ndarray]] = []  # (file, its terms, where each starts + its end)
        self.pending: list[str] = []

    def add(self, doc_id: str, text: str) -> None:
        self.ids.append(doc_id)
        self.pending.append(text)
        if len(self.pending) >= self.chunk_docs:
            self._flush()

    def _flush(self) -> None:
        """Tokenize the pending chunk and write its run."""
        if not self.pending:
            return
        self.tmp.mkdir(parents=True, exist_ok=True)  # with the first run: nothing on disk before a document
        first = len(self.ids) - len(self.pending)
        tokens, chunk_vocab = _tokenize(self.pending)
        self.pending = []
        for stem in sorted(chunk_vocab):  # new stems numbered in sorted order: the same ids on every run
            self.vocab.setdefault(stem, len(self.vocab))
        to_term = np.zeros(len(chunk_vocab), dtype=np.int64)
        to_term[list(chunk_vocab.values())] = [self.vocab[stem] for stem in chunk_vocab]
        lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
        terms = to_term[np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=int(lengths.sum()))]
        docs = np.repeat(np.arange(first, first + len(tokens), dtype=np.int64), lengths)
        pairs, tf = np.unique(terms << 32 | docs, return_counts=True)  # sorted by term, then document
        run = np.empty(len(pairs), dtype=_RUN)
        run["term"], run["doc"], run["tf"] = pairs >> 32, pairs & 0xFFFF_FFFF, tf
        path = self.tmp / f"run-{len(self.runs):05d}.bin"
        run.tofile(path)
        run_terms, starts = np.unique(run["term"], return_index=True)
        self.runs.append((path, run_terms, np.append(starts, len(run))))
        self.df = np.concatenate([self.df, np.zeros(len(self.vocab) - len(self.df), dtype=np.int64)])
        self.df[run_terms] += np.diff(self.runs[-1][2])
        self.lengths.append(lengths.astype(np.int32))

    def finish(self) -> Path:
        """Merge the runs into the score matrix; the folder, complete."""
        import bm25s
        from bm25s.scoring import _select_idf_scorer, _select_tfc_scorer

        self._flush()
        if not self.ids:
            raise ValueError(f"{self.folder}: no documents to index")
        if len(self.ids) >= 1 << 31:
            raise ValueError(f"{self.folder}: {len(self.ids)} documents; the index's int32 rows hold fewer than 2**31")
        n, lengths = len(self.ids), np.concatenate(self.lengths)
        average = lengths.astype(np.int64).mean()  # as bm25s: the mean of an int64 array
        idf_of = _select_idf_scorer("lucene")
        idf = np.array([idf_of(df, N=n) if df else 0.0 for df in self.df.tolist()], dtype=np.float32)
        tfc = _select_tfc_scorer("lucene")
        indptr = np.zeros(len(self.df) + 1, dtype=np.int64)
        np.cumsum(self.df, out=indptr[1:])
        with _npy(self.tmp / "data.csc.index.npy", np.float32, indptr[-1]) as data, \
                _npy(self.tmp / "indices.csc.index.npy", np.int32, indptr[-1]) as indices:
            cursors = [0] * len(self.runs)
            start = 0
            while start < len(self.df):  # terms [start, stop): at most MERGE_ENTRIES entries, or one term
                stop = max(start + 1, int(np.searchsorted(indptr, indptr[start] + MERGE_ENTRIES, side="right")) - 1)
                block = np.concatenate([self._read(i, stop, cursors) for i in range(len(self.runs))])
                block = block[np.argsort(block["term"], kind="stable")]  # runs are in document order: stable keeps it
                scores = idf[block["term"]] * tfc(tf_array=block["tf"].astype(np.float32), l_d=lengths[block["doc"]],
                                                  l_avg=average, k1=self.k1, b=self.b)
                data.write(scores.astype(np.float32).tobytes())
                indices.write(block["doc"].tobytes())
                start = stop
        np.save(self.tmp / "indptr.csc.index.npy", indptr)
        vocab = {**self.vocab, "": len(self.vocab)}  # bm25s's empty token, past the matrix's columns as there
        (self.tmp / "vocab.index.json").write_text(json.dumps(vocab, ensure_ascii=False))
        params = {"k1": self.k1, "b": self.b, "delta": 0.5, "method": "lucene", "idf_method": "lucene",
                  "dtype": "float32", "int_dtype": "int32", "num_docs": n, "version": bm25s.__version__,
                  "backend": "numpy"}
        (self.tmp / "params.index.json").write_text(json.dumps(params, indent=1))
        for path, _, _ in self.runs:
            path.unlink()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.tmp.rename(self.folder)
        return self.folder

    def _read(self, run: int, stop: int, cursors: list[int]) -> np.ndarray:
        """Run `run`'s entries from its cursor up to term `stop` (read, not mapped: nothing stays resident)."""
        path, terms, starts = self.runs[run]
        end = int(starts[np.searchsorted(terms, stop)])  # starts ends with the run's length
        begin, cursors[run] = cursors[run], end
        return np.fromfile(path, dtype=_RUN, count=end - begin, offset=begin * _RUN.itemsize)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.abort()  # after finish() there is nothing left to remove


class _npy:
    """A .npy file of `count` values of `dtype`, its header written first and the values appended."""

    def __init__(self, path: Path, dtype, count: int):
        self.path, self.header = path, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                        "fortran_order": False, "shape": (int(count),)}
        self.size = int(count) * np.dtype(dtype).itemsize

    def __enter__(self):
        self.file = open(self.path, "wb")
        np.lib.format.write_array_header_1_0(self.file, self.header)
        self.start = self.file.tell()
        return self.file

    def __exit__(self, kind, *exc):
        written = self.file.tell() - self.start
        self.file.close()
        if kind is None and written != self.size:
            raise RuntimeError(f"{self.path}: wrote {written} bytes of {self.size}")


def build_index(documents: Iterable[tuple[str, str]], folder: str | Path, k1: float = K1, b: float = B,
                chunk_docs: int = CHUNK_DOCS) -> list[str]:
    """Index the (doc id, text) stream into FOLDER, whole or not at all; the ids in row order."""
    with IndexWriter(folder, k1, b, chunk_docs) as writer:
        for doc_id, text in documents:
            writer.add(doc_id, text)
        writer.finish()
    return writer.ids


def search(folder: str | Path, doc_ids: list[str], queries: dict[str, str], k: int = 1000,
           batch: int = QUERY_BATCH) -> dict[str, dict[str, float]]:
    """{query id: {doc id: BM25 score}} of each query's top k documents with a positive score, from the index
    in FOLDER (memory-mapped) whose rows `doc_ids` name."""
    import bm25s

    index = bm25s.BM25.load(folder, mmap=True)
    query_ids, run = list(queries), {}
    for first in range(0, len(query_ids), batch):
        part = query_ids[first:first + batch]
        tokens = _tokenize([queries[q] for q in part])
        rows, scores = index.retrieve(tokens, k=min(k, len(doc_ids)), show_progress=False)
        for qid, row, score in zip(part, rows.tolist(), scores.tolist()):
            run[qid] = {doc_ids[r]: s for r, s in zip(row, score) if s > 0}
    return run


def bm25_search(docs: dict[str, str], queries: dict[str, str], k: int = 1000, k1: float = K1,
                b: float = B) -> dict[str, dict[str, float]]:
    """`search` over {doc id: text} held in memory, through an index in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="bm25-") as tmp:
        ids = build_index(docs.items(), Path(tmp) / "index", k1, b)
        return search(Path(tmp) / "index", ids, queries, k)
