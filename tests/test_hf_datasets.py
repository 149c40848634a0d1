"""Hugging Face datasets as `prepare` input, offline: datasets saved locally (parquet files, `save_to_disk`, the
`parquet` builder) streamed by `--hf-dataset` give the shards of the same records as JSON lines, text and pairs;
the field mapping; exact resume at a row of a later shard; bad rows; the Hub unreachable; input files at URLs."""

import gzip
import json
import os
import subprocess
import sys

import datasets
import pytest

from support import SAMPLES
from http_shards import ShardServer
from pretrieve.cli import main as cli
from pretrieve.data import corpora, remote
from pretrieve.data.corpora import CorpusError, Cursor, ReaderOptions
from pretrieve.data.fields import FieldError, field_value, parse_fields
from pretrieve.data.hf_datasets import DatasetError, HFDataset, rows
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareError, PrepareOptions
from pretrieve.data.url_inputs import UrlFile

WIKI = [json.loads(line) for line in gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rt", encoding="utf-8")]
PAIRS = [{"id": f"r{i}", **json.loads(line)}
         for i, line in enumerate((SAMPLES / "finetune/embedder_retrieval_msmarco.jsonl").read_text().splitlines())]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def write_parquet_shards(folder, records, sizes):
    """`records` as parquet files of `sizes` rows each: a dataset folder of as many shards."""
    folder.mkdir(parents=True)
    start = 0
    for k, size in enumerate(sizes):
        datasets.Dataset.from_list(records[start:start + size]).to_parquet(str(folder / f"train-{k:05d}.parquet"))
        start += size
    assert start == len(records)
    return folder


def run(out, **kwargs):
    kwargs.setdefault("inputs", [])
    return prepare(PrepareOptions(out=str(out), workers=0, **kwargs))


def digests(manifest):
    return [s["sha256"] for s in manifest["shards"]]


def same_output(a, b):
    assert digests(a) == digests(b) and len(digests(a)) > 1
    for key in ("num_samples", "num_tokens", "num_documents", "num_records", "skipped"):
        assert a[key] == b[key], key


def test_a_streamed_dataset_gives_the_shards_of_its_records_as_json_lines(tmp_path):
    """30 articles of the Wikipedia sample as JSON lines, and as a dataset: a folder of three parquet files (the
    layout of a Hub dataset), the `parquet` builder over them, and `save_to_disk` in two arrow shards."""
    articles = WIKI[:30]
    reference = run(tmp_path / "jsonl", source="wikipedia", shard_size=64,
                    inputs=[str(write_jsonl(tmp_path / "w.jsonl", articles))])
    folder = write_parquet_shards(tmp_path / "wiki-parquet", articles, [12, 10, 8])
    datasets.Dataset.from_list(articles).save_to_disk(str(tmp_path / "wiki-saved"), num_shards=2)
    parquet = {"split": "train", "files": [str(folder / f"train-{k:05d}.parquet") for k in range(3)]}
    # the manifest names the data files read; a single saved Dataset has no split to name
    for name, extra, recorded in (
            (str(folder), {}, parquet),
            ("parquet", {"hf_data_files": [str(folder / "*.parquet")]},
             {**parquet, "data_files": [str(folder / "*.parquet")]}),
            (str(tmp_path / "wiki-saved"), {}, {"files": [str(tmp_path / f"wiki-saved/data-0000{k}-of-00002.arrow")
                                                          for k in range(2)]})):
        out = tmp_path / f"hf-{len(list(tmp_path.iterdir()))}"
        streamed = run(out, source="wikipedia", hf_dataset=name, shard_size=64, **extra)
        same_output(streamed, reference)
        assert streamed["inputs"] == [{"hf_dataset": name, **recorded}]


def test_pairs_from_a_dataset_and_the_field_mapping(tmp_path):
    """BGE-style pair records {query, pos, neg} as a dataset give the pair shards of their JSON lines; so do the
    same records under other column names with --fields, and MS MARCO's layout (the judged passages among the
    retrieved ones, picked by a mask), where a query with no judged passage gives no pair and is counted."""
    reference = run(tmp_path / "jsonl", source="jsonl", pairs=True, shard_size=4,
                    inputs=[str(write_jsonl(tmp_path / "p.jsonl", PAIRS))])
    folder = write_parquet_shards(tmp_path / "bge", PAIRS, [6, 4])
    same_output(run(tmp_path / "bge-out", source="jsonl", pairs=True, shard_size=4, hf_dataset=str(folder)), reference)

    renamed = [{"key": r["id"], "question": r["query"], "positives": r["pos"], "negatives": r["neg"]} for r in PAIRS]
    folder = write_parquet_shards(tmp_path / "renamed", renamed, [10])
    assert cli(["prepare", "--pairs", "--source", "jsonl", "--hf-dataset", str(folder), "--out", str(tmp_path / "r"),
                "--shard-size", "4", "--workers", "0",
                "--fields", "query=question", "pos=positives", "neg=negatives", "id=key"]) == 0
    same_output(json.loads((tmp_path / "r/manifest.json").read_text()), reference)

    # sentence-transformers' triplets: one positive and one negative, strings
    triplets = [{"id": r["id"], "anchor": r["query"], "positive": r["pos"][0], "negative": r["neg"][0]} for r in PAIRS]
    first = [{"id": r["id"], "query": r["query"], "pos": r["pos"][:1], "neg": r["neg"][:1]} for r in PAIRS]
    assert digests(run(tmp_path / "triplets", source="jsonl", pairs=True, shard_size=4, query_field="anchor",
                       pos_field="positive", neg_field="negative",
                       hf_dataset=str(write_parquet_shards(tmp_path / "t", triplets, [10])))) == \
        digests(run(tmp_path / "first", source="jsonl", pairs=True, shard_size=4,
                    inputs=[str(write_jsonl(tmp_path / "first.jsonl", first))]))

    # microsoft/ms_marco: passages {is_selected, passage_text}; the 4th query has no passage selected
    marco = [{"query_id": r["id"], "query": r["query"], "passages": {
        "is_selected": [1] * len(r["pos"]) * (i != 3) + [0] * len(r["pos"]) * (i == 3) + [0] * len(r["neg"]),
        "passage_text": r["pos"] + r["neg"]}} for i, r in enumerate(PAIRS)]
    folder = write_parquet_shards(tmp_path / "marco", marco, [10])
    m = run(tmp_path / "marco-out", source="jsonl", pairs=True, shard_size=4, hf_dataset=str(folder),
            id_field="query_id", pos_field="passages.passage_text[passages.is_selected]",
            neg_field="passages.passage_text[!passages.is_selected]")
    without = run(tmp_path / "without", source="jsonl", pairs=True, shard_size=4,
                  inputs=[str(write_jsonl(tmp_path / "w.jsonl", PAIRS[:3] + PAIRS[4:]))])
    assert m["records_without_pairs"] == 1 and m["num_records"] == 10 and m["skipped"] == {}
    assert digests(m) == digests(without) and m["num_samples"] == without["num_samples"]


def test_field_mapping_is_checked():
    assert parse_fields(["text=body", "pos=p.text[p.ok]"]) == {"text": "body", "pos": "p.text[p.ok]"}
    for entries, message in ((["body"], "write KEY=COLUMN"), (["txt=body"], "unknown key 'txt'"),
                             (["text=a", "text=b"], "text is mapped twice"), (["pos=a[b"], r"COLUMN\[MASK\]")):
        with pytest.raises(FieldError, match=message):
            parse_fields(entries)
    row = {"a.b": 1, "p": {"text": ["x", "y", "z"], "ok": [True, False, True]}}
    assert field_value(row, "a.b") == 1 and field_value(row, "p.text") == ["x", "y", "z"]
    assert field_value(row, "p.text[p.ok]") == ["x", "z"] and field_value(row, "p.text[!p.ok]") == ["y"]
    assert field_value(row, "p.none") is field_value(row, "q") is field_value(row, "q[p.ok]")
    with pytest.raises(FieldError, match="p.text and a.b must be lists of one length"):
        field_value(row, "p.text[a.b]")


def test_resume_starts_at_the_row_of_a_later_shard(tmp_path):
    """A run stopped by a bad row (no text) in the third of three shards saved its cursor as (shard, row).
    Before the resume the first shard is replaced by one of fewer rows: a reader that counted rows from the
    stream's start would land elsewhere; the resumed run, which starts at the third shard, ends with the shards
    of the uninterrupted run on the original rows."""
    bad = [dict(r) for r in WIKI]
    bad[55]["text"] = None
    folder = write_parquet_shards(tmp_path / "wiki", bad, [25, 20, 15])
    opts = dict(source="wikipedia", hf_dataset=str(folder), shard_size=16)
    with pytest.raises(CorpusError, match=r"hf-dataset .*/wiki/train:shard 2 row 11: no string field 'text' .*--on-error skip"):
        run(tmp_path / "out", **opts)
    state = json.loads((tmp_path / "out/.prepare-state.json").read_text())
    shard, row, _, record = state["next"]["cursor"]
    assert shard == 2 and 0 <= row < 10 and record == 45 + row and len(state["shards"]) > 1
    reference = run(tmp_path / "ref", source="wikipedia", inputs=[str(write_jsonl(tmp_path / "w.jsonl", WIKI))],
                    shard_size=16)
    datasets.Dataset.from_list(WIKI[:3]).to_parquet(str(folder / "train-00000.parquet"))
    datasets.Dataset.from_list(WIKI[45:]).to_parquet(str(folder / "train-00002.parquet"))
    same_output(run(tmp_path / "out", **opts), reference)


def test_bad_rows_stop_naming_the_row_or_are_skipped_and_counted(tmp_path):
    records = [{"id": "1", "text": "A fine first document. It has two sentences."}, {"id": "2", "text": "   "},
               {"id": "3", "text": None}, {"id": "4", "text": "The last good document."}]
    folder = write_parquet_shards(tmp_path / "bad", records, [2, 2])
    with pytest.raises(CorpusError, match=r"bad/train:shard 0 row 2: empty or whitespace-only text \(empty\)"):
        run(tmp_path / "fail", source="jsonl", hf_dataset=str(folder))
    assert not (tmp_path / "fail/manifest.json").exists()
    m = run(tmp_path / "skip", source="jsonl", hf_dataset=str(folder), on_error="skip")
    assert m["skipped"] == {"empty": 1, "missing_field": 1} and m["num_documents"] == 2 and m["num_records"] == 4


def test_arguments_are_checked(tmp_path):
    folder = write_parquet_shards(tmp_path / "d", PAIRS, [10])
    for kwargs, message in (({"inputs": ["x.jsonl"], "hf_dataset": str(folder)}, "one of the two"),
                            ({}, "one of the two"), ({"inputs": ["x"], "hf_config": "c"}, "go with --hf-dataset"),
                            ({"source": "beir", "pairs": True, "hf_dataset": str(folder)}, "reads --input FOLDER"),
                            ({"pairs": True, "hf_dataset": str(folder), "hf_rows_per_document": 2}, "is one row"),
                            ({"hf_dataset": str(folder), "hf_rows_per_document": 0}, "must be positive")):
        with pytest.raises(PrepareError, match=message):
            run(tmp_path / "o", **{"source": "jsonl", **kwargs})
    with pytest.raises(DatasetError, match=r"hf-dataset .*/d/test: .*test"):
        run(tmp_path / "o", source="jsonl", hf_dataset=str(folder), hf_split="test")
    assert not (tmp_path / "o").exists()


def test_a_builder_reads_only_the_files_named(tmp_path, monkeypatch, capsys):
    """A file builder (parquet, json, ...) without --hf-data-files would read every file under the current
    folder: refused by flag before any work, here in a folder holding a parquet file it would have prepared."""
    monkeypatch.chdir(write_parquet_shards(tmp_path / "cwd", WIKI[:5], [5]))
    for builder in ("parquet", "json", "csv", "text", "arrow"):
        assert cli(["prepare", "--source", "jsonl", "--hf-dataset", builder, "--out", str(tmp_path / "o"),
                    "--workers", "0"]) == 1
        assert f"--hf-dataset {builder} is the {builder} builder of datasets, which reads the files " \
               "--hf-data-files names" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_split_and_config_are_refused_where_they_do_not_apply(tmp_path):
    """--hf-config on a file builder or a saved dataset, --hf-split on a single saved Dataset, --hf-data-files on
    a saved dataset would change nothing: refused by flag. A saved DatasetDict's split is read and recorded."""
    folder = write_parquet_shards(tmp_path / "d", WIKI[:10], [10])
    datasets.Dataset.from_list(WIKI[:10]).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(WIKI[:3]), validation=datasets.Dataset.from_list(
        WIKI[3:10])).save_to_disk(str(tmp_path / "dict"))
    builder = {"hf_dataset": "parquet", "hf_data_files": [str(folder / "*.parquet")]}
    saved = {"hf_dataset": str(tmp_path / "saved")}
    for kwargs, message in (({**builder, "hf_config": "nope"}, "--hf-config nope: the parquet builder has no "
                                                               "configurations"),
                            ({**saved, "hf_split": "validation"}, "--hf-split validation: .*/saved is one Dataset "
                                                                  "written by save_to_disk, which has no splits"),
                            ({**saved, "hf_config": "nope"}, "--hf-config: .*/saved was written by save_to_disk"),
                            ({**saved, "hf_data_files": ["x"]}, "--hf-data-files: .*/saved was written by "),
                            ({"hf_dataset": str(tmp_path / "dict"), "hf_config": "c"}, "--hf-config: .*/dict was"),
                            ({"inputs": ["x"], "hf_split": "train"}, "go with --hf-dataset")):
        with pytest.raises((DatasetError, PrepareError), match=message):
            run(tmp_path / "o", source="wikipedia", **kwargs)
        assert not (tmp_path / "o").exists()
    with pytest.raises(DatasetError, match=r"hf-dataset .*/dict/test: no split 'test' \(splits: train, validation\)"):
        run(tmp_path / "o", source="wikipedia", hf_dataset=str(tmp_path / "dict"), hf_split="test")
    m = run(tmp_path / "v", source="wikipedia", hf_dataset=str(tmp_path / "dict"), hf_split="validation")
    assert m["num_documents"] == 7 and m["inputs"] == [{"hf_dataset": str(tmp_path / "dict"), "split": "validation",
                                                         "files": [str(next((tmp_path / "dict/validation").glob(
                                                             "*.arrow")))]}]


def test_an_empty_saved_dataset_is_named(tmp_path, capsys):
    """datasets cannot load a saved dataset of no rows (an IndexError, raised in prepare's worker pool): one line
    naming the folder, before any work, for a Dataset and a DatasetDict's split."""
    empty = datasets.Dataset.from_dict({"id": [], "text": []})
    empty.save_to_disk(str(tmp_path / "empty"))
    datasets.DatasetDict(train=empty, validation=datasets.Dataset.from_list(WIKI[:2])).save_to_disk(
        str(tmp_path / "dict"))
    for name in ("empty", "dict"):
        assert cli(["prepare", "--source", "jsonl", "--hf-dataset", str(tmp_path / name), "--out",
                    str(tmp_path / "o"), "--workers", "2"]) == 1
        folder = tmp_path / ("dict/train" if name == "dict" else name)
        assert f"{folder} holds no rows (an empty dataset written by save_to_disk)" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_rows_resume_anywhere(tmp_path):
    """`rows` from any (shard, row) yields exactly the rest of the stream; groups of rows stay within a shard."""
    folder = write_parquet_shards(tmp_path / "d", WIKI[:12], [5, 4, 3])
    every = list(rows(HFDataset(str(folder))))
    assert [(s, r) for s, r, _ in every] == [(0, r) for r in range(5)] + [(1, r) for r in range(4)] + [
        (2, r) for r in range(3)]
    assert [group[0]["id"] for _, _, group in every] == [w["id"] for w in WIKI[:12]]
    for k, (shard, row, _) in enumerate(every):
        assert list(rows(HFDataset(str(folder)), shard, row)) == every[k:]
    pairs = list(rows(HFDataset(str(folder), rows_per_document=2)))
    assert [(s, r, len(g)) for s, r, g in pairs] == [(0, 0, 2), (0, 2, 2), (0, 4, 1), (1, 0, 2), (1, 2, 2),
                                                     (2, 0, 2), (2, 2, 1)]
    assert list(rows(HFDataset(str(folder), rows_per_document=2), 1, 2)) == pairs[4:]


def offline_prepare(tmp_path, *args, **env):
    result = subprocess.run([sys.executable, "-m", "pretrieve", "prepare", "--source", "wikipedia", *args,
                             "--out", str(tmp_path / "o"), "--workers", "0"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "o").exists()
    return result.stderr


def test_the_hub_unreachable_is_a_clear_error(tmp_path):
    """No network here: a Hub dataset by name, or its files by hf:// path, with HF_HUB_OFFLINE=1 (as on a compute
    node) and, for hf://, with the Hub's endpoint refusing connections: one line naming the dataset or URL and
    what to do, no wait."""
    err = offline_prepare(tmp_path, "--hf-dataset", "wikimedia/wikipedia", "--hf-config", "20231101.en",
                          HF_HUB_OFFLINE="1")
    assert "hf-dataset wikimedia/wikipedia/20231101.en/train: cannot reach the Hugging Face Hub" in err
    assert "login node" in err
    url = "hf://datasets/wikimedia/wikipedia/20231101.en/train-*.parquet"
    for env in ({"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}):
        err = offline_prepare(tmp_path, "--input", url, **env)
        assert f"{url}: cannot list" in err and "login node" in err


def test_hf_urls_are_parsed_as_files_of_the_hub():
    from huggingface_hub import HfFileSystem

    url = "hf://datasets/wikimedia/wikipedia/20231101.en/train-00000-of-00041.parquet"
    fs, path = remote.filesystem(url, remote.ReadOptions())
    assert isinstance(fs, HfFileSystem) and path == url[len("hf://"):]
    assert fs.unstrip_protocol(path) == url
    file = UrlFile(url, 10)
    assert (file.name, file.suffix, str(file)) == ("train-00000-of-00041.parquet", ".parquet", url)
    assert remote.is_remote(url)


def test_inputs_at_urls_read_as_local_files(tmp_path):
    """hf:// goes through fsspec as https:// does: parquet and .jsonl.gz served over loopback HTTP prepare into
    the local files' shards, and a parquet read from a cursor starts at its row group (ranged requests)."""
    import pyarrow.parquet as pq

    folder = tmp_path / "served"
    folder.mkdir()
    table = pq.read_table(SAMPLES / "wikipedia-parquet/train-00000-of-00001.parquet")
    pq.write_table(table, folder / "wiki.parquet", row_group_size=8)
    (folder / "wiki.jsonl.gz").write_bytes((SAMPLES / "wikipedia/wiki_00.jsonl.gz").read_bytes())
    with ShardServer(folder) as server:
        for name in ("wiki.parquet", "wiki.jsonl.gz"):
            local = run(tmp_path / f"local-{name}", source="wikipedia", inputs=[str(folder / name)], shard_size=16)
            served = run(tmp_path / f"http-{name}", source="wikipedia", inputs=[server.url(name)], shard_size=16)
            assert digests(served) == digests(local)
            assert served["inputs"] == [{"path": server.url(name), "bytes": (folder / name).stat().st_size}]
        files = corpora.list_input_files("wikipedia", [server.url("wiki.parquet")])
        local = corpora.list_input_files("wikipedia", [folder / "wiki.parquet"])
        start = Cursor(0, 21, 0, 21)
        assert [(i, c, r) for i, c, r in corpora.read_records("wikipedia", files, ReaderOptions(), start)] != []
        assert [(i, c, r.doc_id) for i, c, r in corpora.read_records("wikipedia", files, ReaderOptions(), start)] == \
            [(i, c, r.doc_id) for i, c, r in corpora.read_records("wikipedia", local, ReaderOptions(), start)]
        with pytest.raises(CorpusError, match="input not found: http://.*/missing.parquet"):
            corpora.list_input_files("wikipedia", [server.url("missing.parquet")])


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as Python sees an uninstalled module
    with pytest.raises(ModuleNotFoundError, match=r"--hf-dataset needs datasets, .*pip install 'pretrieve\[hf\]'"):
        run(tmp_path / "o", source="jsonl", hf_dataset=str(tmp_path))


def test_rows_of_one_sentence_join_into_documents(tmp_path):
    """BookCorpus's layout, a sentence a row: the two sample books as rows, one shard each, with
    --hf-rows-per-document at least the longer book's lines give the shards of the books read one sentence a line
    (no group spans two shards). A bad row is skipped and counted, the rest of its document kept."""
    books = sorted((SAMPLES / "books").glob("*.txt"))
    lines = [[line.strip() for line in book.read_text(encoding="utf-8").splitlines() if line.strip()] for book in books]
    rows_of = [[{"id": book.stem, "text": line} for line in book_lines] for book, book_lines in zip(books, lines)]
    folder = write_parquet_shards(tmp_path / "sentences", rows_of[0] + rows_of[1], [len(r) for r in rows_of])
    reference = run(tmp_path / "books", source="books", inputs=[str(b) for b in books], books_format="lines",
                    shard_size=8)
    longest = max(map(len, lines))
    same_output(run(tmp_path / "joined", source="books", hf_dataset=str(folder), hf_rows_per_document=longest,
                    shard_size=8), reference)
    rows_of[1][3]["text"] = None
    folder = write_parquet_shards(tmp_path / "bad", rows_of[0] + rows_of[1], [len(r) for r in rows_of])
    m = run(tmp_path / "skipped", source="books", hf_dataset=str(folder), hf_rows_per_document=longest,
            on_error="skip")
    assert m["skipped"] == {"missing_field": 1} and m["num_documents"] == 2 and m["num_records"] == 3
    assert m["inputs"][0]["rows_per_document"] == longest


def test_parts_of_a_dataset_combine_into_the_single_job(tmp_path):
    from pretrieve.data.combine import combine

    folder = write_parquet_shards(tmp_path / "wiki", WIKI[:12], [5, 4, 3])
    opts = dict(source="wikipedia", hf_dataset=str(folder), shard_size=32, group_records=4)
    single = run(tmp_path / "single", **opts)
    for part in range(2):
        run(tmp_path / f"part-{part}", part=part, parts=2, **opts)
    combined = combine([str(tmp_path / f"part-{part}") for part in range(2)], str(tmp_path / "combined"))
    assert [s["sha256"] for s in combined["shards"]] == digests(single) and combined["job_id"] == single["job_id"]


def test_jobs_without_the_new_options_keep_their_ids():
    """A file job's arguments (its job id, which an earlier output's resume matches) leave out the dataset and
    pair-field options while they hold their defaults, so outputs prepared before these options resume."""
    later = {"query_field", "pos_field", "neg_field", "hf_dataset", "hf_config", "hf_split", "hf_data_files",
             "hf_rows_per_document"}
    for pairs in (False, True):
        assert not later & set(PrepareOptions(source="jsonl", inputs=["x"], out="o", pairs=pairs).output_arguments())
    assert PrepareOptions(source="jsonl", inputs=[], out="o", pairs=True, hf_dataset="d",
                          pos_field="p").output_arguments()["pos_field"] == "p"
