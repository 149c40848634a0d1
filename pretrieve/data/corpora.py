"""Readers for raw corpora: each yields `Document`s and `BadRecord`s in file order.

A reader never decides what to do with a bad record: it reports it with its location (`file:line` or
`file:row`), and `prepare` either stops with that message or skips and counts it (`--on-error skip`).
Document text keeps paragraph breaks as "\\n" so the packer can treat them as sentence boundaries.

Records are numbered over the whole input (`read_records`): a non-blank line of a JSON-lines or TSV file (a line
that is not UTF-8 too), a row of a parquet / arrow file, a book (after its lines that are not UTF-8). Records a
caller does not want are counted without being parsed, and reading can start again at a `Cursor` without
parsing what comes before it: plain files seek to the byte, `.gz` / `.bz2` decompress up to it (their formats
have no random access), parquet starts at the row group holding it, arrow skips whole record batches, a book
is read again from its start.

A Hugging Face dataset (`hf_datasets.HFDataset`) is an input of its own: its rows are records, read with the
field mapping of `ReaderOptions` (fields.py), and a cursor's `file` / `offset` are the stream's shard and the row
in it. An input at a URL (`hf://datasets/...`, `https://`, `s3://`) is read as a local file, through fsspec
(url_inputs.py).
"""

from __future__ import annotations

import bz2
import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import Callable, Generator, Iterable, Iterator, NamedTuple

from pretrieve.data import hf_datasets, remote
from pretrieve.data.fields import MISSING, FieldError, field_value
from pretrieve.data.hf_datasets import HFDataset
from pretrieve.data.url_inputs import UrlFile, UrlInputError, list_url_files

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


class Cursor(NamedTuple):  # a tuple: one is made per record
    """Where reading can start again: the input file (index in the file list), inside it the byte offset in the
    decompressed text and the lines before it (text files) or the row (arrow / parquet: `offset`), and the
    index of the record read first from there."""
    file: int = 0
    offset: int = 0
    line: int = 0
    record: int = 0


@dataclass(frozen=True)
class ReaderOptions:
    text_field: str = "text"
    id_field: str = "id"
    title_field: str | None = "title"
    queries_field: str | None = "queries"  # jsonl / parquet: optional list of pseudo-queries per document
    books_format: str = "file"  # file: paragraphs separated by blank lines | lines: one sentence per line
    # pairs (--pair-method records): the query, the positive(s) and the negatives
    query_field: str = "query"
    pos_field: str = "pos"
    neg_field: str = "neg"


def read_corpus(source: str, inputs: Iterable[str | os.PathLike], options: ReaderOptions = ReaderOptions()) -> Iterator[Record]:
    """All records of `inputs` (files or directories) read as `source`, in a deterministic order."""
    if source not in SOURCES:
        raise CorpusError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    for _, _, record in read_records(source, list_input_files(source, inputs), options):
        yield record


def read_records(source: str, files: list[Path] | HFDataset, options: ReaderOptions = ReaderOptions(),
                 start: Cursor = Cursor(), wanted: Callable[[int], bool] | None = None
                 ) -> Iterator[tuple[int, Cursor, Record | None]]:
    """(index, cursor, record) of every record of `files` from `start` on; the cursor re-reads the record. A
    record whose index `wanted` refuses comes as None, counted but not parsed."""
    if isinstance(files, HFDataset):  # every source's rows are documents of the field mapping
        return read_rows(files, lambda row, where: _from_mapping(row, options, where), start, wanted)
    return _read_files(source, files, options, start, wanted)


def read_rows(dataset: HFDataset, to_record: Callable[[dict, str], object], start: Cursor = Cursor(),
              wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, Cursor, object]]:
    """`read_records` over a Hugging Face dataset's rows: `to_record(row, "dataset:shard K row R")` makes each
    record. Rows that `wanted` refuses are read (a stream has no other way past them) but not converted. With
    `rows_per_document` > 1, a group of rows is one document after a record for each of its bad rows (dropped
    from the document, as a book's lines that are not UTF-8); every record's cursor is the group's first row."""
    wanted = wanted or _every_record
    index = start.record
    for shard, row, group in hf_datasets.rows(dataset, start.file, start.offset):
        cursor = Cursor(shard, row, 0, index)
        where = [f"{dataset}:shard {shard} row {row + k + 1}" for k in range(len(group))]
        if dataset.rows_per_document == 1:
            records = [to_record(group[0], where[0]) if wanted(index) else None]
        else:
            records = _one_document([to_record(obj, at) for obj, at in zip(group, where)])
        for record in records:
            yield index, cursor, record if wanted(index) else None
            index += 1


def _one_document(records: list[Record]) -> list[Record]:
    """The bad records of a group of rows, then one document of the others' texts as its lines."""
    documents = [r for r in records if isinstance(r, Document)]
    joined = [Document(documents[0].doc_id, "\n".join(d.text for d in documents), documents[0].where)] \
        if documents else []
    return [r for r in records if isinstance(r, BadRecord)] + joined


def _read_files(source: str, files: list[Path], options: ReaderOptions, start: Cursor,
                wanted: Callable[[int], bool] | None) -> Iterator[tuple[int, Cursor, Record | None]]:
    wanted = wanted or _every_record
    next_index = start.record
    for k, path in enumerate(files[start.file:], start.file):
        cursor = start if k == start.file else Cursor(k, 0, 0, next_index)
        next_index = yield from _file_records(source, path, cursor, wanted, options)


def read_line_records(files: list[Path], parse: Callable[[str, str], object], start: Cursor = Cursor(),
                      wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, Cursor, object]]:
    """`read_records` for a line format of the caller's: `parse(line, "file:line")` makes each record."""
    wanted = wanted or _every_record
    next_index = start.record
    for k, path in enumerate(files[start.file:], start.file):
        cursor = start if k == start.file else Cursor(k, 0, 0, next_index)
        next_index = yield from _line_records(path, cursor, wanted, parse)


def _every_record(index: int) -> bool:
    return True


Records = Generator[tuple[int, Cursor, Record | None], None, int]  # returns the index after its last record


def _file_records(source: str, path: Path, cursor: Cursor, wanted: Callable[[int], bool],
                  options: ReaderOptions) -> Records:
    if path.name.endswith(ARROW_SUFFIXES):
        return _arrow_records(path, cursor, wanted, options)
    if source == "books":
        return _book_records(path, cursor, wanted, options)
    if source == "msmarco-passage":
        parse = partial(_tsv_record, num_fields=2, to_doc=lambda f: (f[0], f[1]))
    elif source == "msmarco-doc":
        parse = partial(_tsv_record, num_fields=4, to_doc=lambda f: (f[0], _join_title(f[2], f[3])))
    elif source == "beir":
        parse = partial(_json_record, options=ReaderOptions(text_field="text", id_field="_id", title_field="title"))
    elif source == "wikipedia":
        parse = partial(_json_record, options=ReaderOptions(text_field="text", id_field="id", title_field="title"))
    else:
        parse = partial(_json_record, options=options)
    return _line_records(path, cursor, wanted, parse)


# Which files a directory input contributes, per source (explicitly named files are always read).
DIRECTORY_PATTERNS = {
    "wikipedia": ("wiki_*", "*.jsonl", "*.jsonl.gz", "*.jsonl.bz2", "*.parquet", "*.arrow"),
    "books": ("*.txt",),
    "msmarco-passage": ("*.tsv",),
    "msmarco-doc": ("*.tsv",),
    "beir": ("corpus.jsonl", "corpus.jsonl.gz"),
    "jsonl": ("*.jsonl", "*.jsonl.gz", "*.jsonl.bz2", "*.parquet", "*.arrow"),
}


def list_input_files(source: str, inputs: Iterable[str | os.PathLike]) -> list[Path | UrlFile]:
    """Expand directories (sorted recursive walk, hidden files ignored) and URLs (url_inputs.py); every named
    input must exist."""
    inputs = list(inputs)
    if not inputs:
        raise CorpusError("no input given")
    paths = [p if remote.is_remote(p) else Path(remote.local_path(p)) for p in inputs]
    missing = [str(p) for p in paths if isinstance(p, Path) and not p.exists()]
    if missing:
        raise CorpusError(f"input not found: {', '.join(missing)}")
    files: list[Path | UrlFile] = []
    for p in paths:
        if not isinstance(p, Path):
            try:
                files.extend(list_url_files(str(p), DIRECTORY_PATTERNS[source]))
            except UrlInputError as e:
                raise CorpusError(str(e)) from e
            continue
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


def _open_binary(path: Path | UrlFile):
    raw = path.open() if isinstance(path, UrlFile) else path
    if path.suffix == ".gz":
        return gzip.open(raw, "rb")
    if path.suffix == ".bz2":
        return bz2.open(raw, "rb")
    return raw if isinstance(path, UrlFile) else open(path, "rb")


def file_size(path: Path | UrlFile) -> int:
    return path.bytes if isinstance(path, UrlFile) else path.stat().st_size


def numbered_lines(path: Path) -> Iterator[tuple[str, str | BadRecord]]:
    """(location, decoded line without newline | BadRecord) per line; a broken archive is a CorpusError."""
    for lineno, _, raw in _raw_lines(path, 0, 0):
        where = f"{path}:{lineno}"
        yield where, _decoded(raw, where)


def _raw_lines(path: Path, offset: int, lines_before: int) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw line) from `offset` (decompressed bytes; .gz / .bz2 decompress up to it)."""
    try:
        with _open_binary(path) as f:
            if offset:
                f.seek(offset)
            for lineno, raw in enumerate(f, lines_before + 1):
                yield lineno, offset, raw
                offset += len(raw)
    except (EOFError, OSError, gzip.BadGzipFile) as e:
        raise CorpusError(f"{path}: cannot read ({e}); the file is truncated or not a {path.suffix or 'text'} file") from e


def _decoded(raw: bytes, where: str) -> str | BadRecord:
    try:
        return raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        return BadRecord("bad_utf8", where, f"invalid UTF-8 at byte {e.start}")


def _line_records(path: Path, cursor: Cursor, wanted: Callable[[int], bool],
                  parse: Callable[[str, str], Record]) -> Records:
    """A record per non-blank line (blank lines between records are none); a line that is not UTF-8 is one."""
    index, file = cursor.record, cursor.file
    for lineno, offset, raw in _raw_lines(path, cursor.offset, cursor.line):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            line = None
        if line is not None and not line.strip():
            continue
        if not wanted(index):
            record = None
        elif line is None:
            record = _decoded(raw, f"{path}:{lineno}")
        else:
            record = parse(line.rstrip("\r\n"), f"{path}:{lineno}")
        yield index, Cursor(file, offset, lineno - 1, index), record
        index += 1
    return index


def _join_title(title: str | None, text: str) -> str:
    title = (title or "").strip()
    if not title or text.lstrip().split("\n", 1)[0].strip() == title:  # WikiExtractor may keep the title line
        return text
    return f"{title}\n{text}"


def _document(doc_id: str, text: str, where: str) -> Record:
    if not text or text.isspace():
        return BadRecord("empty", where, "empty or whitespace-only text")
    return Document(str(doc_id), text, where)


def _json_record(line: str, where: str, options: ReaderOptions) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadRecord("bad_json", where, f"malformed JSON ({e.msg} at column {e.colno})")
    return _from_mapping(obj, options, where)


def _from_mapping(obj, options: ReaderOptions, where: str) -> Record:
    if not isinstance(obj, dict):
        return BadRecord("bad_json", where, f"expected a JSON object, got {type(obj).__name__}")
    try:
        text, doc_id, title, queries = (
            field_value(obj, column) if column else None
            for column in (options.text_field, options.id_field, options.title_field, options.queries_field))
    except FieldError as e:
        return BadRecord("bad_row", where, str(e))
    if not isinstance(text, str):
        return BadRecord("missing_field", where, f"no string field {options.text_field!r} (keys: {', '.join(obj)})")
    if doc_id is None or doc_id is MISSING:
        doc_id = where.rsplit("/", 1)[-1]  # "file:line" keeps ids unique when the corpus has none
    queries = () if queries is None or queries is MISSING else queries
    if not isinstance(queries, (list, tuple)) or not all(isinstance(q, str) for q in queries):
        return BadRecord("bad_row", where, f"field {options.queries_field!r} must be a list of strings")
    record = _document(doc_id, _join_title(title if isinstance(title, str) else None, text), where)
    if isinstance(record, Document) and queries:
        record = Document(record.doc_id, record.text, record.where, tuple(q for q in queries if q.strip()))
    return record


def _tsv_record(line: str, where: str, num_fields: int, to_doc: Callable[[list[str]], tuple[str, str]]) -> Record:
    fields = line.split("\t", num_fields - 1)
    if len(fields) != num_fields:
        return BadRecord("bad_row", where, f"expected {num_fields} tab-separated fields, found {len(fields)}")
    doc_id, text = to_doc(fields)
    return _document(doc_id, text, where)


def _book_records(path: Path, cursor: Cursor, wanted: Callable[[int], bool], options: ReaderOptions) -> Records:
    """One document per file, after a record for each line that is not UTF-8 (the line is dropped from the book,
    the rest kept). `file`: hard-wrapped paragraphs separated by blank lines; `lines`: one sentence a line.
    Every record's cursor is the book's start: a book is read whole."""
    start = Cursor(cursor.file, 0, 0, cursor.record)
    index = cursor.record
    paragraphs: list[str] = []
    current: list[str] = []
    for _, line in numbered_lines(path):
        if isinstance(line, BadRecord):
            yield index, start, line if wanted(index) else None
            index += 1
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
    yield index, start, _document(path.stem, "\n".join(paragraphs), f"{path}:1") if wanted(index) else None
    return index + 1


def _arrow_records(path: Path, cursor: Cursor, wanted: Callable[[int], bool], options: ReaderOptions) -> Records:
    """HF `datasets` parquet or arrow files with `title`/`text` columns (and `id` when present); a row per record."""
    import pyarrow as pa

    first_index = cursor.record - cursor.offset  # the index of the file's row 0
    try:
        row, batches = _arrow_batches(path, cursor.offset)
        for batch in batches:
            size, skip = batch.num_rows, max(cursor.offset - row, 0)
            indices = range(first_index + row + skip, first_index + row + size)
            # rows of other parts' records are not converted (to_pylist is the parsing here)
            objs = batch.slice(skip).to_pylist() if any(map(wanted, indices)) else [None] * len(indices)
            for index, obj in zip(indices, objs):
                at = index - first_index
                record = _from_mapping(obj, options, f"{path}:row {at + 1}") if wanted(index) else None
                yield index, Cursor(cursor.file, at, 0, index), record
            row += size
    except (pa.ArrowException, OSError) as e:
        raise CorpusError(f"{path}: cannot read as {path.suffix[1:]} ({e})") from e
    return first_index + max(row, cursor.offset)


def _arrow_batches(path: Path, from_row: int) -> tuple[int, Iterator]:
    """(the row the batches start at, record batches holding rows from `from_row` on, maybe a few before)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = path.open() if isinstance(path, UrlFile) else path  # ranged reads of the row groups wanted
    if path.suffix == ".parquet":
        parquet = pq.ParquetFile(source)
        group, row = 0, 0
        while group < parquet.num_row_groups and row + parquet.metadata.row_group(group).num_rows <= from_row:
            row += parquet.metadata.row_group(group).num_rows
            group += 1
        return row, parquet.iter_batches(batch_size=1024, row_groups=range(group, parquet.num_row_groups))
    try:
        return 0, iter(pa.ipc.open_stream(source))  # what `datasets.save_to_disk` writes
    except pa.ArrowInvalid:
        return 0, iter(pa.ipc.open_file(path.open() if isinstance(path, UrlFile) else path))
