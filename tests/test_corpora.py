"""Every reader on the bundled real samples, and every kind of bad record."""

import bz2
import gzip
import json
import shutil

import pytest

from support import SAMPLES
from pretrieve.data.corpora import BadRecord, CorpusError, Document, ReaderOptions, read_corpus


def docs(source, path, **options):
    records = list(read_corpus(source, [path], ReaderOptions(**options)))
    assert all(isinstance(r, Document) for r in records), [r for r in records if isinstance(r, BadRecord)]
    return records


def test_wikiextractor_jsonl_gz():
    records = docs("wikipedia", SAMPLES / "wikipedia")
    assert len(records) == 60
    assert records[0].doc_id == "12" and records[0].text.startswith("Anarchism\nAnarchism is a political philosophy")


def test_wikiextractor_directory_tree(tmp_path):
    # WikiExtractor writes AA/wiki_00, AA/wiki_01, AB/wiki_00 ... (plain or bz2-compressed).
    lines = gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rt", encoding="utf-8").read().splitlines(True)
    (tmp_path / "AA").mkdir()
    (tmp_path / "AB").mkdir()
    (tmp_path / "AA/wiki_00").write_text("".join(lines[:20]), encoding="utf-8")
    (tmp_path / "AA/wiki_01").write_text("".join(lines[20:40]), encoding="utf-8")
    with bz2.open(tmp_path / "AB/wiki_00.bz2", "wt", encoding="utf-8") as f:
        f.write("".join(lines[40:]))
    records = docs("wikipedia", tmp_path)
    assert [r.doc_id for r in records] == [json.loads(line)["id"] for line in lines]


def test_parquet_and_arrow():
    import datasets

    records = docs("wikipedia", SAMPLES / "wikipedia-parquet")
    assert len(records) == 40 and records[0].where.endswith(":row 1")
    ds = datasets.load_dataset("parquet", data_files=str(SAMPLES / "wikipedia-parquet/*.parquet"), split="train")
    assert records[5].text.endswith(ds[5]["text"]) and records[5].text.startswith(ds[5]["title"])


def test_arrow_from_save_to_disk(tmp_path):
    import datasets

    ds = datasets.Dataset.from_parquet(str(SAMPLES / "wikipedia-parquet/train-00000-of-00001.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    records = docs("wikipedia", tmp_path / "saved")
    assert [r.doc_id for r in records] == ds["id"]


def test_books_file_and_lines(tmp_path):
    books = docs("books", SAMPLES / "books")
    assert [b.doc_id for b in books] == ["blake-poems", "melville-moby_dick-part"]
    moby = books[1].text.split("\n")
    assert any(p.startswith("Call me Ishmael.") for p in moby)  # hard-wrapped lines joined into paragraphs
    (tmp_path / "b.txt").write_text("First sentence.\nSecond one here.\n\nThird.\n", encoding="utf-8")
    assert docs("books", tmp_path / "b.txt", books_format="lines")[0].text == "First sentence.\nSecond one here.\nThird."
    assert docs("books", tmp_path / "b.txt")[0].text == "First sentence. Second one here.\nThird."


def test_msmarco_passage_and_doc():
    passages = docs("msmarco-passage", SAMPLES / "msmarco-passage/collection.tsv")
    assert len(passages) == 500
    documents = docs("msmarco-doc", SAMPLES / "msmarco-doc")
    assert len(documents) == 40 and documents[0].doc_id == "D764"
    assert documents[0].text.startswith("Agnostida\nAgnostida is an order of arthropod")


def test_beir_and_generic_jsonl():
    beir = docs("beir", SAMPLES / "beir/scifact-sample")
    assert len(beir) == 500
    generic = docs("jsonl", SAMPLES / "jsonl", text_field="contents")
    assert len(generic) == 300 and generic[0].doc_id == "CACM-1"


@pytest.mark.parametrize("source, content, reason, line", [
    ("jsonl", b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "broken\n', "bad_json", 2),
    ("jsonl", b'{"id": "a", "text": "fine"}\n{"id": "b", "body": "x"}\n', "missing_field", 2),
    ("jsonl", b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "  \\n "}\n', "empty", 2),
    ("jsonl", b'{"id": "a", "text": "fine"}\n{"id": "b", "text": "caf\xe9"}\n', "bad_utf8", 2),
    ("msmarco-passage", b"1\tfine passage\n2 no tab here\n", "bad_row", 2),
    ("msmarco-doc", b"D1\thttp://x\tTitle\tBody\nD2\thttp://y\tonly three\n", "bad_row", 2),
    ("books", b"good line\n\xff\xfe bad\n", "bad_utf8", 2),
])
def test_bad_records_name_file_and_line(tmp_path, source, content, reason, line):
    path = tmp_path / ("in.txt" if source == "books" else "in.tsv" if "msmarco" in source else "in.jsonl")
    path.write_bytes(content)
    bad = [r for r in read_corpus(source, [path]) if isinstance(r, BadRecord)]
    assert [(b.reason, b.where) for b in bad] == [(reason, f"{path}:{line}")]


def test_missing_input_and_truncated_archive(tmp_path):
    with pytest.raises(CorpusError, match="input not found: .*nope.jsonl"):
        list(read_corpus("jsonl", [tmp_path / "nope.jsonl"]))
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes((SAMPLES / "wikipedia/wiki_00.jsonl.gz").read_bytes()[:20000])
    with pytest.raises(CorpusError, match="cut.jsonl.gz: cannot read"):
        list(read_corpus("wikipedia", [truncated]))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(CorpusError, match="holds no books files"):
        list(read_corpus("books", [empty_dir]))
    shutil.copy(SAMPLES / "books/blake-poems.txt", empty_dir / "README")  # not a *.txt: still no book
    with pytest.raises(CorpusError, match="holds no books files"):
        list(read_corpus("books", [empty_dir]))


def cursor_inputs(tmp_path):
    """(source, files, whether bad records are among them) for every kind of input the cursor handles: plain, .gz
    and .bz2 lines (a blank and a non-UTF-8 line among them), TSV, parquet in row groups of 9, an arrow stream
    in batches of 7, books."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lines = gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rb").read().splitlines(True)[:12]
    text = b"".join(lines[:4]) + b"\n\xff\xfe\n" + b"".join(lines[4:])
    (tmp_path / "plain.jsonl").write_bytes(text)
    (tmp_path / "lines.jsonl.gz").write_bytes(gzip.compress(text))
    (tmp_path / "lines.jsonl.bz2").write_bytes(bz2.compress(text))
    table = pq.read_table(SAMPLES / "wikipedia-parquet/train-00000-of-00001.parquet")
    pq.write_table(table, tmp_path / "groups.parquet", row_group_size=9)
    with pa.ipc.new_stream(tmp_path / "batches.arrow", table.schema) as stream:
        for batch in table.to_batches(max_chunksize=7):
            stream.write_batch(batch)
    (tmp_path / "books").mkdir()
    (tmp_path / "books/bad.txt").write_bytes(b"One line.\n\xe9t\xe9\n\nAnother paragraph.\n\xff\n")
    shutil.copy(SAMPLES / "books/blake-poems.txt", tmp_path / "books")
    return [("wikipedia", [tmp_path / "plain.jsonl", tmp_path / "lines.jsonl.gz", tmp_path / "lines.jsonl.bz2"], True),
            ("msmarco-passage", [SAMPLES / "msmarco-passage/collection.tsv"], False),
            ("wikipedia", [tmp_path / "groups.parquet", tmp_path / "batches.arrow"], False),
            ("books", sorted((tmp_path / "books").glob("*.txt")), True)]


def test_reading_from_any_cursor_gives_the_rest(tmp_path):
    """From the cursor of any record, the reader yields that record and all after it (a book's records from the
    book's start), numbered as in a full read; records refused by `wanted` come as None, numbered alike."""
    from pretrieve.data.corpora import read_records

    for source, files, has_bad in cursor_inputs(tmp_path):
        full = list(read_records(source, files))
        assert [index for index, _, _ in full] == list(range(len(full)))
        assert len({cursor.file for _, cursor, _ in full}) == len(files)
        assert any(isinstance(r, BadRecord) for _, _, r in full) == has_bad
        for index, cursor, record in full:
            rest = list(read_records(source, files, start=cursor))
            assert rest == full[cursor.record:], (source, index)
        odd = list(read_records(source, files, wanted=lambda i: i % 2 == 1))
        assert [(i, c) for i, c, _ in odd] == [(i, c) for i, c, _ in full]
        assert [r for _, _, r in odd] == [r if i % 2 else None for i, _, r in full]
