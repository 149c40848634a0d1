"""Retrieval test collections, BEIR folders and MS MARCO files, read into one in-memory form.

BEIR: `corpus.jsonl` {"_id", "title", "text"}, `queries.jsonl` {"_id", "text"}, `qrels/<split>.tsv` (a header
line, then query-id, corpus-id, score). MS MARCO: `collection.tsv` (pid, passage) or `msmarco-docs.tsv` (docid,
url, title, body), `queries.<split>.tsv` (qid, text), `qrels.<split>.tsv` in TREC form (qid, 0, docid,
relevance). Only the queries judged in the split are kept. A qrels line naming a document or query that is
not there is an error naming the file and line, or with on_missing="skip" dropped and counted. A qrels line
with more columns than its format's is an error naming it; negative grades (TREC's junk and spam) are read as
0, not relevant, and counted in `skipped`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pretrieve.data.corpora import BadRecord, numbered_lines


class RetrievalDataError(ValueError):
    pass


@dataclass
class RetrievalSet:
    name: str
    corpus: dict[str, tuple[str, str]]  # doc id -> (title, text)
    queries: dict[str, str]  # judged query id -> text
    qrels: dict[str, dict[str, int]]  # query id -> doc id -> relevance
    skipped: dict[str, int] = field(default_factory=dict)  # qrels lines dropped, by reason

    def doc_text(self, doc_id: str) -> str:
        """title + " " + text, the BEIR / MTEB convention."""
        title, text = self.corpus[doc_id]
        return f"{title} {text}".strip()


def load_retrieval_set(beir: str | Path | None = None, msmarco: str | Path | None = None, split: str = "test",
                       on_missing: str = "fail") -> RetrievalSet:
    if (beir is None) == (msmarco is None):
        raise ValueError("give one of a BEIR folder or an MS MARCO folder")
    return load_beir(beir, split, on_missing) if beir is not None else load_msmarco(msmarco, split, on_missing)


def load_beir(folder: str | Path, split: str = "test", on_missing: str = "fail") -> RetrievalSet:
    folder = Path(folder)
    qrels_file = folder / "qrels" / f"{split}.tsv"
    _require(folder / "corpus.jsonl", folder / "queries.jsonl", qrels_file)
    corpus, queries = _Unique(folder / "corpus.jsonl"), _Unique(folder / "queries.jsonl")
    for number, record in jsonl_records(corpus.path):
        title = _field(record, "title", corpus.path, number, optional=True)
        text = _field(record, "text", corpus.path, number)
        corpus.add(number, _field(record, "_id", corpus.path, number), (title, text))
    for number, record in jsonl_records(queries.path):
        queries.add(number, _field(record, "_id", queries.path, number), _field(record, "text", queries.path, number))
    rows = [(number, cols, (0, 1, 2)) for number, cols in _tsv(qrels_file)
            if not (number == 1 and cols[0].lower().startswith("query-id"))]
    return _assemble(folder.name, corpus, queries, qrels_file, rows, on_missing)


def load_msmarco(folder: str | Path, split: str = "dev", on_missing: str = "fail") -> RetrievalSet:
    folder = Path(folder)
    queries_file, qrels_file = folder / f"queries.{split}.tsv", folder / f"qrels.{split}.tsv"
    passages, documents = folder / "collection.tsv", folder / "msmarco-docs.tsv"
    collection = passages if passages.is_file() else documents
    _require(collection, queries_file, qrels_file)
    corpus, queries = _Unique(collection), _Unique(queries_file)
    for number, cols in _tsv(collection):
        if collection == passages and len(cols) == 2:
            corpus.add(number, cols[0], ("", cols[1]))
        elif collection == documents and len(cols) == 4:
            corpus.add(number, cols[0], (cols[2], cols[3]))
        else:
            raise RetrievalDataError(f"{collection}:{number}: expected {2 if collection == passages else 4} "
                                     f"tab-separated columns, got {len(cols)}")
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
