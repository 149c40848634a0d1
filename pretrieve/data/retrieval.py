"""Retrieval test collections, BEIR folders and MS MARCO files, read into one in-memory form, or their corpus
streamed.

BEIR: `corpus.jsonl` {"_id", "title", "text"}, `queries.jsonl` {"_id", "text"}, `qrels/<split>.tsv` (a header
line, then query-id, corpus-id, score). MS MARCO: `collection.tsv` (pid, passage) or `msmarco-docs.tsv` (docid,
url, title, body), `queries.<split>.tsv` (qid, text), `qrels.<split>.tsv` in TREC form (qid, 0, docid,
relevance). Only the queries judged in the split are kept. A qrels line naming a document or query that is
not there is an error naming the file and line, or with on_missing="skip" dropped and counted. A qrels line
with more columns than its format's is an error naming it; negative grades (TREC's junk and spam) are read as
0, not relevant, and counted in `skipped`.

At MS MARCO scale (8.8M passages) the texts need not be held: `load_retrieval_set(..., texts=False)` keeps the
document ids alone (what searching precomputed vectors needs), and `stream_corpus` yields (id, text) one
document at a time (what encoding and indexing need); `load_retrieval_set(..., doc_ids=ids)` takes the ids such
a stream read instead of reading the corpus again. Every reader sees the same documents in the same order: a repeated id
with the same title and text counts once, with another text it is an error naming both lines.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from pretrieve.data.corpora import BadRecord, numbered_lines


class RetrievalDataError(ValueError):
    pass


@dataclass
class RetrievalSet:
    name: str
    corpus: dict[str, tuple[str, str] | None]  # doc id -> (title, text); None when read with texts=False
    queries: dict[str, str]  # judged query id -> text
    qrels: dict[str, dict[str, int]]  # query id -> doc id -> relevance
    skipped: dict[str, int] = field(default_factory=dict)  # qrels lines dropped, by reason

    def doc_text(self, doc_id: str) -> str:
        """title + " " + text, the BEIR / MTEB convention."""
        document = self.corpus[doc_id]
        if document is None:
            raise ValueError(f"{self.name}: read without its corpus texts (texts=False); document {doc_id} has none")
        return document_text(*document)


def document_text(title: str, text: str) -> str:
    return f"{title} {text}".strip()


def load_retrieval_set(beir: str | Path | None = None, msmarco: str | Path | None = None, split: str = "test",
                       on_missing: str = "fail", texts: bool = True,
                       doc_ids: Iterable[str] | None = None) -> RetrievalSet:
    """The set; texts=False keeps the corpus's ids only (each maps to None); `doc_ids`, the ids `stream_corpus`
    yielded, stand for the corpus (ids only), which is then not read."""
    if (beir is None) == (msmarco is None):
        raise ValueError("give one of a BEIR folder or an MS MARCO folder")
    return load_beir(beir, split, on_missing, texts, doc_ids) if beir is not None else \
        load_msmarco(msmarco, split, on_missing, texts, doc_ids)


def require_retrieval_files(beir: str | Path | None = None, msmarco: str | Path | None = None,
                            split: str = "test") -> None:
    """The error `load_retrieval_set` would give for a missing file, before a long read of the corpus."""
    if (beir is None) == (msmarco is None):
        raise ValueError("give one of a BEIR folder or an MS MARCO folder")
    if beir is not None:
        _require(Path(beir) / "corpus.jsonl", Path(beir) / "queries.jsonl", Path(beir) / "qrels" / f"{split}.tsv")
    else:
        folder = Path(msmarco)
        _require(_msmarco_collection(folder), folder / f"queries.{split}.tsv", folder / f"qrels.{split}.tsv")


def stream_corpus(beir: str | Path | None = None, msmarco: str | Path | None = None) -> Iterator[tuple[str, str]]:
    """(doc id, title + " " + text) of the set's corpus in file order, read one document at a time; the same
    documents, in the same order, as `load_retrieval_set(...).corpus`. Memory: a hash of each id seen so far
    (`_SeenIds`, at most 32 bytes an id)."""
    if (beir is None) == (msmarco is None):
        raise ValueError("give one of a BEIR folder or an MS MARCO folder")
    path = Path(beir) / "corpus.jsonl" if beir is not None else _msmarco_collection(Path(msmarco))
    _require(path)
    for key, document in _unique_documents(path):
        yield key, document_text(*document)


def load_beir(folder: str | Path, split: str = "test", on_missing: str = "fail", texts: bool = True,
              doc_ids: Iterable[str] | None = None) -> RetrievalSet:
    folder = Path(folder)
    qrels_file = folder / "qrels" / f"{split}.tsv"
    _require(folder / "corpus.jsonl", folder / "queries.jsonl", qrels_file)
    corpus, queries = _read_corpus(folder / "corpus.jsonl", texts, doc_ids), _Unique(folder / "queries.jsonl")
    for number, record in jsonl_records(queries.path):
        queries.add(number, _field(record, "_id", queries.path, number), _field(record, "text", queries.path, number))
    rows = [(number, cols, (0, 1, 2)) for number, cols in _tsv(qrels_file)
            if not (number == 1 and cols[0].lower().startswith("query-id"))]
    return _assemble(folder.name, corpus, queries, qrels_file, rows, on_missing)


def load_msmarco(folder: str | Path, split: str = "dev", on_missing: str = "fail",
                 texts: bool = True, doc_ids: Iterable[str] | None = None) -> RetrievalSet:
    folder = Path(folder)
    queries_file, qrels_file = folder / f"queries.{split}.tsv", folder / f"qrels.{split}.tsv"
    collection = _msmarco_collection(folder)
    _require(collection, queries_file, qrels_file)
    corpus, queries = _read_corpus(collection, texts, doc_ids), _Unique(queries_file)
    for number, cols in _tsv(queries_file):
        if len(cols) != 2:
            raise RetrievalDataError(f"{queries_file}:{number}: expected qid<TAB>text, got {len(cols)} columns")
        queries.add(number, cols[0], cols[1])
    rows = [(number, line.split(), (0, 2, 3)) for number, line in text_lines(qrels_file)]
    return _assemble(folder.name, corpus, queries, qrels_file, rows, on_missing)


def write_msmarco(data: RetrievalSet, folder: str | Path, split: str = "dev") -> Path:
    """The set as MS MARCO passage files (passage = title + " " + text; tabs and newlines become spaces)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def clean(text: str) -> str:
        return " ".join(text.split())

    (folder / "collection.tsv").write_text("".join(f"{d}\t{clean(data.doc_text(d))}\n" for d in data.corpus))
    (folder / f"queries.{split}.tsv").write_text("".join(f"{q}\t{clean(t)}\n" for q, t in data.queries.items()))
    (folder / f"qrels.{split}.tsv").write_text("".join(f"{q}\t0\t{d}\t{rel}\n" for q, docs in data.qrels.items()
                                                       for d, rel in docs.items()))
    return folder


def _msmarco_collection(folder: Path) -> Path:
    """collection.tsv (passages) when there is one, else msmarco-docs.tsv (documents)."""
    passages = folder / "collection.tsv"
    return passages if passages.is_file() else folder / "msmarco-docs.tsv"


def _corpus_records(path: Path) -> Iterator[tuple[int, str, tuple[str, str]]]:
    """(line number, doc id, (title, text)) of a corpus.jsonl, collection.tsv or msmarco-docs.tsv."""
    if path.name == "corpus.jsonl":
        for number, record in jsonl_records(path):
            title = _field(record, "title", path, number, optional=True)
            yield number, _field(record, "_id", path, number), (title, _field(record, "text", path, number))
        return
    columns = 2 if path.name == "collection.tsv" else 4  # pid, passage | docid, url, title, body
    for number, cols in _tsv(path):
        if len(cols) != columns:
            raise RetrievalDataError(f"{path}:{number}: expected {columns} tab-separated columns, got {len(cols)}")
        yield number, cols[0], ("", cols[1]) if columns == 2 else (cols[2], cols[3])


def _unique_documents(path: Path) -> Iterator[tuple[str, tuple[str, str]]]:
    """(doc id, (title, text)) in file order; an id repeated with the same document is dropped, with another it
    is an error naming both lines. Only hashes of each id and document are kept (`_SeenIds`), not their text."""
    seen = _SeenIds()
    for number, key, document in _corpus_records(path):
        earlier, digest = seen.digest_of(key), _SeenIds.hash64(document)
        if earlier is None:
            seen.add(key, digest)
            yield key, document
        elif earlier != digest:
            first = next(n for n, k, _ in _corpus_records(path) if k == key)  # read again: errors only
            if first == number:  # not seen: another id has the same 64-bit hash; this one is kept exactly
                seen.exact[key] = digest
                yield key, document
                continue
            raise RetrievalDataError(f"{path}:{number}: id {key!r} again, with other text than at line {first}")


class _SeenIds:
    """The ids a corpus stream has passed, each with its document's hash, in 32 bytes an id at most: an open-addressing
    table of 64-bit hashes (numpy), at most half full. A dict of the id strings took about 130 bytes an id, so
    an encode worker reading MS MARCO's 8.8M passages held 1.1 GB for it. An id whose 64-bit hash an earlier id
    already has (a few in a million at 8.8M ids) is kept by its string in `exact`."""

    def __init__(self, capacity: int = 1 << 16):
        import numpy as np

        self.keys = np.zeros(capacity, dtype=np.uint64)  # 0: an empty slot
        self.digests = np.zeros(capacity, dtype=np.uint64)
        self.size = 0
        self.exact: dict[str, int] = {}

    @staticmethod
    def hash64(value) -> int:
        """Python's hash of `value` as a nonzero unsigned 64-bit number."""
        return (hash(value) & 0xFFFF_FFFF_FFFF_FFFF) or 1

    def _slot(self, key_hash: int) -> int:
        """The slot holding `key_hash`, or the empty slot where it would go (linear probing)."""
        mask = len(self.keys) - 1
        slot = key_hash & mask
        while (held := int(self.keys[slot])) and held != key_hash:
            slot = (slot + 1) & mask
        return slot

    def digest_of(self, key: str) -> int | None:
        """The document hash (`hash64`) noted with `key`, None for an id not seen; for an id that shares its
        64-bit hash with an earlier one, that one's (the caller tells them apart by reading the file again)."""
        if key in self.exact:
            return self.exact[key]
        slot = self._slot(self.hash64(key))
        return int(self.digests[slot]) if self.keys[slot] else None

    def add(self, key: str, digest: int) -> None:
        """Note `key` (not seen before) with its document's `hash64`."""
        if 2 * (self.size + 1) > len(self.keys):
            self._grow()
        key_hash = self.hash64(key)
        slot = self._slot(key_hash)
        self.keys[slot], self.digests[slot] = key_hash, digest
        self.size += 1

    def _grow(self) -> None:
        import numpy as np

        keys, digests = self.keys[self.keys != 0], self.digests[self.keys != 0]
        self.keys = np.zeros(2 * len(self.keys), dtype=np.uint64)
        self.digests = np.zeros_like(self.keys)
        for start in range(0, len(keys), 4096):  # as Python ints a chunk at a time: no list of them all
            for key_hash, digest in zip(keys[start:start + 4096].tolist(), digests[start:start + 4096].tolist()):
                slot = self._slot(key_hash)
                self.keys[slot], self.digests[slot] = key_hash, digest


def _read_corpus(path: Path, texts: bool, doc_ids: Iterable[str] | None = None) -> dict[str, tuple[str, str] | None]:
    if doc_ids is not None:  # read already, by a stream
        return dict.fromkeys(doc_ids)
    if texts:
        return dict(_unique_documents(path))
    return dict.fromkeys(key for key, _ in _unique_documents(path))


def _assemble(name, corpus, queries, qrels_file, rows, on_missing) -> RetrievalSet:
    if on_missing not in ("fail", "skip"):
        raise ValueError(f"on_missing: {on_missing!r} is not fail or skip")
    qrels: dict[str, dict[str, int]] = {}
    skipped: dict[str, int] = {}
    for number, cols, (qcol, dcol, rcol) in rows:
        width = max(qcol, dcol, rcol) + 1  # BEIR: 3 columns; TREC: 4. More is a file of another format
        if len(cols) != width or not cols[rcol].strip().lstrip("-").isdigit():
            raise RetrievalDataError(f"{qrels_file}:{number}: expected {width} columns with query id, document id "
                                     f"and an integer relevance, got {cols!r}")
        qid, did = cols[qcol].strip(), cols[dcol].strip()
        missing = "query not in queries" if qid not in queries else "document not in corpus" if did not in corpus \
            else None
        if missing:
            if on_missing == "fail":
                raise RetrievalDataError(f"{qrels_file}:{number}: {missing} ({qid} -> {did}); "
                                         "pass on_missing=skip (--on-missing skip) to drop and count such lines")
            skipped[missing] = skipped.get(missing, 0) + 1
            continue
        grade = int(cols[rcol])
        if grade < 0:  # TREC's junk / spam grades: not relevant, as trec_eval's relevance threshold reads them
            skipped["negative grade read as 0"] = skipped.get("negative grade read as 0", 0) + 1
        qrels.setdefault(qid, {})[did] = max(grade, 0)
    if not qrels:
        raise RetrievalDataError(f"{qrels_file}: no judgements")
    return RetrievalSet(name, corpus, {q: queries[q] for q in qrels}, qrels, skipped)


def _require(*paths: Path) -> None:
    for path in paths:
        if not path.is_file():
            raise RetrievalDataError(f"{path}: not found")


def text_lines(path: Path):
    """(line number, text) of the non-blank lines, through the corpus readers' line reader (.gz / .bz2)."""
    for number, (where, line) in enumerate(numbered_lines(path), 1):
        if isinstance(line, BadRecord):
            raise RetrievalDataError(f"{where}: {line.detail}")
        if line.strip():
            yield number, line


def jsonl_records(path: Path):
    for number, line in text_lines(path):
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise RetrievalDataError(f"{path}:{number}: not JSON ({e.msg})") from None


def _tsv(path: Path):
    for number, line in text_lines(path):
        yield number, line.split("\t")


def _field(record, key: str, path: Path, number: int, optional: bool = False) -> str:
    """record[key] as a string: `_id` may be a number; a text must be a string (an optional one may be absent
    or null, read as empty)."""
    if not isinstance(record, dict) or (key not in record and not optional):
        raise RetrievalDataError(f"{path}:{number}: no {key!r} field")
    value = record.get(key)
    if key == "_id" and isinstance(value, (str, int)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) or (optional and value is None):
        return value or ""
    raise RetrievalDataError(f"{path}:{number}: {key!r} is {value!r}, not a string")


class _Unique(dict):
    """id -> value of one file; an id given twice with different values is an error naming both lines (with
    the same value it is kept once: no judgement changes)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.lines = path, {}

    def add(self, number: int, key: str, value) -> None:
        if key in self and self[key] != value:
            raise RetrievalDataError(f"{self.path}:{number}: id {key!r} again, with other text than at line "
                                     f"{self.lines[key]}")
        self.lines.setdefault(key, number)
        self[key] = value
