"""Readers for raw corpora: each yields `Document`s and `BadRecord`s in file order.

A reader never decides what to do with a bad record: it reports it with its location (`file:line` or
`file:row`), and `prepare` either stops with that message or skips and counts it (`--on-error skip`).
Document text keeps paragraph breaks as "\\n" so the packer can treat them as sentence boundaries.
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

SOURCES = ("wikipedia", "books", "msmarco-passage", "msmarco-doc", "beir", "jsonl")
ARROW_SUFFIXES = (".parquet", ".arrow")


class CorpusError(ValueError):
    """A raw input that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str
    where: str  # "file:line", for messages about this document
    queries: tuple[str, ...] = ()  # pseudo-queries of the document (jsonl `queries` field), for CoT-MAE


@dataclass(frozen=True)
class BadRecord:
    reason: str  # bad_utf8 | bad_json | bad_row | missing_field | empty
    where: str
    detail: str


Record = Document | BadRecord


@dataclass(frozen=True)
class ReaderOptions:
    text_field: str = "text"
    id_field: str = "id"
    title_field: str | None = "title"
    queries_field: str | None = "queries"  # jsonl / parquet: optional list of pseudo-queries per document
    books_format: str = "file"  # file: paragraphs separated by blank lines | lines: one sentence per line


def read_corpus(source: str, inputs: Iterable[str | os.PathLike], options: ReaderOptions = ReaderOptions()) -> Iterator[Record]:
    """All records of `inputs` (files or directories) read as `source`, in a deterministic order."""
    if source not in SOURCES:
        raise CorpusError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    files = list_input_files(source, inputs)
    for path in files:
        if path.name.endswith(ARROW_SUFFIXES):
            yield from _read_arrow(path, options)
        elif source == "books":
            yield from _read_book(path, options)
        elif source == "msmarco-passage":
            yield from _read_tsv(path, 2, lambda f: (f[0], f[1]))
        elif source == "msmarco-doc":
            yield from _read_tsv(path, 4, lambda f: (f[0], _join_title(f[2], f[3])))
        elif source == "beir":
            yield from _read_jsonl(path, ReaderOptions(text_field="text", id_field="_id", title_field="title"))
        elif source == "wikipedia":
            yield from _read_jsonl(path, ReaderOptions(text_field="text", id_field="id", title_field="title"))
        else:
            yield from _read_jsonl(path, options)


# Which files a directory input contributes, per source (explicitly named files are always read).
DIRECTORY_PATTERNS = {
    "wikipedia": ("wiki_*", "*.jsonl", "*.jsonl.gz", "*.jsonl.bz2", "*.parquet", "*.arrow"),
    "books": ("*.txt",),
    "msmarco-passage": ("*.tsv",),
    "msmarco-doc": ("*.tsv",),
    "beir": ("corpus.jsonl", "corpus.jsonl.gz"),
    "jsonl": ("*.jsonl", "*.jsonl.gz", "*.jsonl.bz2", "*.parquet", "*.arrow"),
}


def list_input_files(source: str, inputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand directories (sorted recursive walk, hidden files ignored); every named input must exist."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise CorpusError("no input given")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise CorpusError(f"input not found: {', '.join(missing)}")
    files: list[Path] = []
    for p in paths:
        if not p.is_dir():
            files.append(p)
            continue
        found = sorted(
            {f for pattern in DIRECTORY_PATTERNS[source] for f in p.rglob(pattern)
             if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)}
        )
        if not found:
            raise CorpusError(f"{p}: directory holds no {source} files ({' '.join(DIRECTORY_PATTERNS[source])})")
        files.extend(found)
    return files


def _open_binary(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        return bz2.open(path, "rb")
    return open(path, "rb")


def numbered_lines(path: Path) -> Iterator[tuple[str, str | BadRecord]]:
    """(location, decoded line without newline | BadRecord) per line; a broken archive is a CorpusError."""
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                try:
                    yield where, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    yield where, BadRecord("bad_utf8", where, f"invalid UTF-8 at byte {e.start}")
    except (EOFError, OSError, gzip.BadGzipFile) as e:
        raise CorpusError(f"{path}: cannot read ({e}); the file is truncated or not a {path.suffix or 'text'} file") from e


def _join_title(title: str | None, text: str) -> str:
    title = (title or "").strip()
    if not title or text.lstrip().split("\n", 1)[0].strip() == title:  # WikiExtractor may keep the title line
        return text
    return f"{title}\n{text}"


def _document(doc_id: str, text: str, where: str) -> Record:
    if not text or text.isspace():
        return BadRecord("empty", where, "empty or whitespace-only text")
    return Document(str(doc_id), text, where)


def _read_jsonl(path: Path, options: ReaderOptions) -> Iterator[Record]:
    for where, line in numbered_lines(path):
        if isinstance(line, BadRecord):
            yield line
            continue
        if not line.strip():
            continue  # blank line between records: not a record
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            yield BadRecord("bad_json", where, f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        yield _from_mapping(obj, options, where)


def _from_mapping(obj, options: ReaderOptions, where: str) -> Record:
    if not isinstance(obj, dict):
        return BadRecord("bad_json", where, f"expected a JSON object, got {type(obj).__name__}")
    text = obj.get(options.text_field)
    if not isinstance(text, str):
        return BadRecord("missing_field", where, f"no string field {options.text_field!r} (keys: {', '.join(obj)})")
    doc_id = obj.get(options.id_field)
    if doc_id is None:
        doc_id = where.rsplit("/", 1)[-1]  # "file:line" keeps ids unique when the corpus has none
    title = obj.get(options.title_field) if options.title_field else None
    queries = obj.get(options.queries_field, ()) if options.queries_field else ()
    if not isinstance(queries, (list, tuple)) or not all(isinstance(q, str) for q in queries):
        return BadRecord("bad_row", where, f"field {options.queries_field!r} must be a list of strings")
    record = _document(doc_id, _join_title(title if isinstance(title, str) else None, text), where)
    if isinstance(record, Document) and queries:
        record = Document(record.doc_id, record.text, record.where, tuple(q for q in queries if q.strip()))
    return record


def _read_tsv(path: Path, num_fields: int, to_doc: Callable[[list[str]], tuple[str, str]]) -> Iterator[Record]:
    for where, line in numbered_lines(path):
        if isinstance(line, BadRecord):
            yield line
            continue
        if not line.strip():
            continue
        fields = line.split("\t", num_fields - 1)
        if len(fields) != num_fields:
            yield BadRecord("bad_row", where, f"expected {num_fields} tab-separated fields, found {len(fields)}")
            continue
        doc_id, text = to_doc(fields)
        yield _document(doc_id, text, where)


def _read_book(path: Path, options: ReaderOptions) -> Iterator[Record]:
    """One document per file. `file`: hard-wrapped paragraphs separated by blank lines; `lines`: one sentence a line."""
    paragraphs: list[str] = []
    current: list[str] = []
    for _, line in numbered_lines(path):
        if isinstance(line, BadRecord):
            yield line  # the line is dropped from the book; the rest of the book is kept
            continue
        line = line.strip()
        if options.books_format == "lines":
            if line:
                paragraphs.append(line)
        elif line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    yield _document(path.stem, "\n".join(paragraphs), f"{path}:1")


def _read_arrow(path: Path, options: ReaderOptions) -> Iterator[Record]:
    """HF `datasets` parquet or arrow files with `title`/`text` columns (and `id` when present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        else:
            try:
                batches = iter(pa.ipc.open_stream(path))  # what `datasets.save_to_disk` writes
            except pa.ArrowInvalid:
                batches = iter(pa.ipc.open_file(path))
        row = 0
        for batch in batches:
            for obj in batch.to_pylist():
                row += 1
                yield _from_mapping(obj, options, f"{path}:row {row}")
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: cannot read as {path.suffix[1:]} ({e})") from e
