"""`pretrieve prepare`: shard round trip, packing on real text, determinism, crash + resume, bad input."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import webdataset as wds

from support import SAMPLES, prepare_sample
from pretrieve.data.corpora import CorpusError
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareError, PrepareOptions
from pretrieve.data.shards import read_shard
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend


def shard_samples(out):
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"]:
        yield from read_shard(out / shard["file"], sha256=shard["sha256"], num_samples=shard["num_samples"])


def test_manifest_totals_and_webdataset_round_trip(wiki_shards):
    manifest = json.loads((wiki_shards / "manifest.json").read_text())
    assert manifest["num_documents"] == 60 and len(manifest["shards"]) == 11
    urls = [str(wiki_shards / s["file"]) for s in manifest["shards"]]
    raw = list(wds.WebDataset(urls, shardshuffle=False))  # any webdataset reader opens our shards
    ours = list(shard_samples(wiki_shards))
    assert len(raw) == len(ours) == manifest["num_samples"] == sum(s["num_samples"] for s in manifest["shards"])
    assert sum(len(ids) for ids, _ in ours) == manifest["num_tokens"]
    for sample, (ids, meta) in zip(raw, ours):
        assert np.array_equal(np.frombuffer(sample["ids.u16"], "<u2"), ids)
        assert json.loads(sample["json"]) == meta
    assert manifest["tokenizer"]["vocab_size"] == 30522 and manifest["token_dtype"] == "uint16"


def test_blocks_reassemble_each_document_in_order(wiki_shards):
    backend = load_backend(DEFAULT_TOKENIZER)
    articles = [json.loads(line) for line in gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rt")]
    blocks: dict[str, list] = {}
    for ids, meta in shard_samples(wiki_shards):
        assert 0 < len(ids) <= 510 and meta["source"] == "wikipedia"
        blocks.setdefault(meta["doc"], []).append((meta["block"], ids))
    assert list(blocks) == [a["id"] for a in articles]  # documents in input order
    for article in articles:
        parts = blocks[article["id"]]
        assert [b for b, _ in parts] == list(range(len(parts)))
        expected = backend.encode(f"{article['title']}\n{article['text']}", add_special_tokens=False).ids
        assert np.concatenate([ids for _, ids in parts]).tolist() == expected


def test_holdout_splits_by_document(tmp_path, wiki_shards):
    """--holdout 0.25: the two sides hold disjoint documents whose union is the corpus, each document whole
    (every block of it), and the validation side about a quarter of the 60 documents."""
    sides = {split: prepare_sample(tmp_path / split, "wikipedia", "wikipedia", shard_size=64, holdout=0.25,
                                   split=split) for split in ("train", "validation")}
    docs = {split: {meta["doc"] for _, meta in shard_samples(tmp_path / split)} for split in sides}
    blocks = {split: sum(1 for _ in shard_samples(tmp_path / split)) for split in sides}
    everything = {meta["doc"] for _, meta in shard_samples(wiki_shards)}
    assert not docs["train"] & docs["validation"] and docs["train"] | docs["validation"] == everything
    assert blocks["train"] + blocks["validation"] == sum(1 for _ in shard_samples(wiki_shards))
    assert 8 <= len(docs["validation"]) <= 22 and sides["validation"]["arguments"]["split"] == "validation"
    with pytest.raises(PrepareError, match="--split validation needs --holdout"):
        prepare_sample(tmp_path / "bad", "wikipedia", "wikipedia", split="validation")


def test_output_does_not_depend_on_workers(tmp_path):
    one = prepare_sample(tmp_path / "w0", "books", "books", shard_size=16)
    two = prepare(PrepareOptions(source="books", inputs=[str(SAMPLES / "books")], out=str(tmp_path / "w2"),
                                 shard_size=16, workers=2))
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]


def test_passage_mode_truncates_and_counts(tmp_path):
    m = prepare_sample(tmp_path, "msmarco-passage", "msmarco-passage", max_len=64, shard_size=200)
    assert m["num_samples"] == m["num_documents"] == 500 and m["arguments"]["packing"] == "passage"
    lengths = [len(ids) for ids, _ in shard_samples(tmp_path)]
    assert max(lengths) == 62 and m["truncated_documents"] == sum(n == 62 for n in lengths) > 0


def test_short_seq_prob_makes_short_blocks(tmp_path):
    m = prepare_sample(tmp_path, "wikipedia", "wikipedia", short_seq_prob=0.5, shard_size=1000)
    full = prepare_sample(tmp_path / "full", "wikipedia", "wikipedia", shard_size=1000)
    assert m["num_samples"] > full["num_samples"] and m["num_tokens"] == full["num_tokens"]


def test_rerun_is_a_no_op_and_other_arguments_are_refused(tmp_path, capsys):
    first = prepare_sample(tmp_path, "books", "books", shard_size=16)
    mtime = os.stat(tmp_path / "manifest.json").st_mtime_ns
    assert "nothing was done" not in capsys.readouterr().err
    assert prepare_sample(tmp_path, "books", "books", shard_size=16) == first
    assert os.stat(tmp_path / "manifest.json").st_mtime_ns == mtime
    assert f"pretrieve prepare: {tmp_path} is already complete with these arguments and inputs: nothing was done " \
           "(--overwrite prepares it again)" in capsys.readouterr().err
    with pytest.raises(PrepareError, match="other arguments"):
        prepare_sample(tmp_path, "books", "books", shard_size=32)
    again = prepare_sample(tmp_path, "books", "books", shard_size=32, overwrite=True)
    assert len(again["shards"]) == 3 and len(list(tmp_path.glob("*.tar"))) == 3
    (tmp_path / "manifest.json").write_text('{"format": "pretrieve-sh')  # a hand-damaged manifest
    with pytest.raises(PrepareError, match=r"manifest.json: damaged \(.*--overwrite"):
        prepare_sample(tmp_path, "books", "books", shard_size=32)


@pytest.mark.system  # three prepare processes, one killed
def test_killed_run_resumes_to_identical_shards(tmp_path):
    # A bigger input (the sample five times) so the run is still going when it is killed.
    big = tmp_path / "big.jsonl"
    lines = gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rt").read()
    big.write_text(lines * 5)
    args = ["--source", "wikipedia", "--input", str(big), "--shard-size", "20", "--workers", "1"]
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pretrieve", "prepare", *args, "--out", str(out)])
    deadline = time.time() + 120
    while not (out / ".prepare-state.json").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    state = json.loads((out / ".prepare-state.json").read_text())
    visible = sorted(p.name for p in out.glob("*.tar"))
    recorded = [s["file"] for s in state["shards"]]
    # No half-written shard under a final name. A kill between a shard's rename and the state save leaves
    # that one complete shard unrecorded; the resumed run writes it again.
    assert visible[:len(recorded)] == recorded and len(visible) - len(recorded) <= 1
    for extra in visible[len(recorded):]:
        assert len(list(read_shard(out / extra, num_samples=20))) == 20
    assert subprocess.run([sys.executable, "-m", "pretrieve", "prepare", *args, "--out", str(out)]).returncode == 0
    subprocess.run([sys.executable, "-m", "pretrieve", "prepare", *args, "--out", str(tmp_path / "ref")], check=True)
    resumed = json.loads((out / "manifest.json").read_text())
    reference = json.loads((tmp_path / "ref/manifest.json").read_text())
    for key in ("num_samples", "num_tokens", "num_documents", "skipped"):
        assert resumed[key] == reference[key]
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in reference["shards"]]
    assert [p.name for p in out.glob(".*")] == [".lock"]  # state and temp files gone; the empty lock file stays


BAD_JSONL = (b'{"id": "1", "text": "A fine first document. It has two sentences."}\n'
             b'{"id": "2", "text": "broken\n'
             b'{"id": "3", "text": "caf\xe9 latin-1"}\n'
             b'{"id": "4", "text": "   "}\n'
             b'{"id": "5", "body": "no text field"}\n'
             b'{"id": "6", "text": "The last good document."}\n')


def test_bad_records_fail_with_location_or_are_skipped_and_counted(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(BAD_JSONL)
    opts = dict(source="jsonl", inputs=[str(src)], workers=0, shard_size=1)
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: malformed JSON .*--on-error skip"):
        prepare(PrepareOptions(out=str(tmp_path / "fail"), **opts))
    assert not (tmp_path / "fail/manifest.json").exists()
    assert not list((tmp_path / "fail").glob(".*.tmp"))
    m = prepare(PrepareOptions(out=str(tmp_path / "skip"), on_error="skip", **opts))
    assert m["skipped"] == {"bad_json": 1, "bad_utf8": 1, "empty": 1, "missing_field": 1}
    assert m["num_documents"] == 2
    assert [meta["doc"] for _, meta in shard_samples(tmp_path / "skip")] == ["1", "6"]


def test_nothing_to_write_and_bad_arguments(tmp_path):
    src = tmp_path / "empty.jsonl"
    src.write_text('{"id": "1", "text": " "}\n')
    with pytest.raises(PrepareError, match="no samples produced"):
        prepare(PrepareOptions(source="jsonl", inputs=[str(src)], out=str(tmp_path / "o"), workers=0, on_error="skip"))
    assert not (tmp_path / "o").exists()  # a failed prepare leaves nothing it made, not even its lock file
    with pytest.raises(PrepareError, match="--max-len"):
        prepare(PrepareOptions(source="jsonl", inputs=[str(src)], out=str(tmp_path / "o"), max_len=2))


def test_cli_prepare_reports_errors_without_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pretrieve", "prepare", "--source", "books", "--input",
                             str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "input not found" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_prepare_help_shows_each_default(capsys, monkeypatch):
    """Every option that has a default says it; the values shown are PrepareOptions' own."""
    from pretrieve.cli import main

    monkeypatch.setenv("COLUMNS", "300")  # one line per option: no wrapped "(default:" to join
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    options = {block.split()[0]: " ".join(block.split())
               for block in re.split(r"\n  (?=-)", capsys.readouterr().out.split("\noptions:\n")[1])}
    for name in set(options) - {"-h,", "--source", "--input", "--out"}:
        assert "(default: " in options[name], options[name]
    for name in ("max_len", "shard_size", "on_error", "short_seq_prob", "seed", "text_field", "id_field", "title_field",
                 "queries_field", "books_format", "holdout", "split"):
        assert f"(default: {getattr(PrepareOptions, name)}" in options["--" + name.replace("_", "-")]


def test_a_failed_prepare_removes_only_what_it_made(tmp_path):
    """Folders it created go again (deepest first, while empty); a folder that was there stays, without a lock file."""
    missing = [str(tmp_path / "missing.jsonl")]
    with pytest.raises(CorpusError, match="input not found"):
        prepare(PrepareOptions(source="jsonl", inputs=missing, out=str(tmp_path / "a/b/c"), workers=0))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "there").mkdir()
    (tmp_path / "there/notes.txt").write_text("kept")
    with pytest.raises(CorpusError, match="input not found"):
        prepare(PrepareOptions(source="jsonl", inputs=missing, out=str(tmp_path / "there"), workers=0))
    assert [p.name for p in (tmp_path / "there").iterdir()] == ["notes.txt"]
    help_text = subprocess.run([sys.executable, "-m", "pretrieve", "--help"], capture_output=True, text=True).stdout
    for command in ("prepare", "pretrain", "export", "eval", "farm", "report", "launch-info"):
        assert command in help_text


def stream_samples(manifest, epochs=2):
    """Every sample of `epochs` epochs of rank 1 of 2, shuffled, as comparable tuples (the address included)."""
    from pretrieve.data.stream import ShardStream

    stream = ShardStream([manifest], seed=5, shuffle_buffer=16, rank=1, world_size=2)
    return [(s["epoch"], s["shard"], s["index"], s["doc"], s["block"], s["pad"], s["ids"].tolist())
            for _ in range(epochs) for s in stream]


def books_with_bad_lines(tmp_path):
    """Six books cut from the bundled two, two of them with a Latin-1 line (a record of its own, skipped)."""
    folder = tmp_path / "books-in"
    folder.mkdir()
    for book in sorted((SAMPLES / "books").glob("*.txt")):
        paragraphs = book.read_bytes().split(b"\n\n")
        for k in range(3):
            bad = b"caf\xe9 au lait\n\n" if k == 1 else b""
            (folder / f"{book.stem}-{k}.txt").write_bytes(bad + b"\n\n".join(paragraphs[k::3]))
    return folder


@pytest.mark.parametrize("source,make_input,options", [
    ("wikipedia", lambda _: SAMPLES / "wikipedia", {"group_records": 7, "short_seq_prob": 0.3}),  # random blocks
    ("wikipedia", lambda _: SAMPLES / "wikipedia-parquet", {"group_records": 5}),
    ("books", books_with_bad_lines, {"group_records": 2, "on_error": "skip"}),
], ids=["jsonl.gz", "parquet", "books"])
def test_parts_stream_the_same_samples_as_one_prepare(tmp_path, source, make_input, options):
    """3 parts of one input, combined (given out of order): the single job's shards byte for byte, in its order,
    its manifest but for the shards' names, and so the same samples in the same order from the stream."""
    from pretrieve.data.combine import combine

    common = dict(source=source, inputs=[str(make_input(tmp_path))], workers=0, shard_size=16, **options)
    single = prepare(PrepareOptions(out=str(tmp_path / "single"), **common))
    parts = [prepare(PrepareOptions(out=str(tmp_path / f"part-{i}"), part=i, parts=3, **common)) for i in range(3)]
    assert all(p["num_samples"] for p in parts) and sum(p["num_samples"] for p in parts) == single["num_samples"]
    assert single["skipped"] == ({"bad_utf8": 2} if source == "books" else {})
    combined = combine([str(tmp_path / f"part-{i}") for i in (2, 0, 1)], str(tmp_path / "all"))
    assert [s["sha256"] for s in combined["shards"]] == [s["sha256"] for s in single["shards"]]
    assert len(single["shards"]) > len(parts)  # several groups per part
    assert combined["shards"][0]["file"].startswith("../part-0/")
    differing = {key for key in single if single[key] != combined[key]}
    # the times may also agree, within the second of `created`
    assert differing - {"created", "prepare_seconds"} == {"shards"} and set(combined) - set(single) == {"parts"}
    assert stream_samples(tmp_path / "all") == stream_samples(tmp_path / "single")
    assert prepare(PrepareOptions(out=str(tmp_path / "all"), **common)) == combined  # the single job's output


def test_combine_refuses_missing_repeated_and_foreign_parts(tmp_path, capsys):
    """Through the command line: parts as a SLURM array would run them, one that gets no group (a warning, an
    empty part), and the refusals, each naming what is wrong."""
    from pretrieve.cli import main as cli

    wiki = str(SAMPLES / "wikipedia")
    run = ["prepare", "--source", "wikipedia", "--input", wiki, "--workers", "0", "--shard-size", "64",
           "--group-records", "25", "--parts", "4"]
    for i in range(4):
        assert cli([*run, "--part", str(i), "--out", str(tmp_path / f"p{i}")]) == 0
    assert "part 3 of 4 holds no samples: the input's 60 records make 3 group(s)" in capsys.readouterr().err
    parts = [str(tmp_path / f"p{i}") for i in range(4)]
    assert cli(["prepare", "--combine", *parts, "--out", str(tmp_path / "all")]) == 0
    assert "60 documents -> 648 samples" in capsys.readouterr().out
    assert cli(["prepare", "--combine", *parts[:2], parts[0], "--out", str(tmp_path / "x")]) == 1
    assert f"part 0 of 4 given twice: {parts[0]}/manifest.json and {parts[0]}/manifest.json" in capsys.readouterr().err
    assert cli(["prepare", "--combine", parts[0], parts[2], "--out", str(tmp_path / "x")]) == 1
    assert "parts 1, 3 of 4 missing" in capsys.readouterr().err
    assert cli([*run[:-1], "3", "--part", "1", "--out", str(tmp_path / "q1")]) == 0  # 3 parts, not 4
    assert cli(["prepare", "--combine", parts[0], str(tmp_path / "q1"), "--out", str(tmp_path / "x")]) == 1
    assert "are parts of different runs: parts differ" in capsys.readouterr().err
    assert cli(["prepare", "--combine", parts[0], "--source", "wikipedia", "--out", str(tmp_path / "x")]) == 1
    assert "takes no --source, --input or --hf-dataset" in capsys.readouterr().err
    assert cli(["prepare", "--source", "wikipedia", "--input", wiki, "--part", "4", "--parts", "4",
                "--out", str(tmp_path / "x")]) == 1
    assert "--part must be in [0, --parts), got part 4 of 4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_resume_seeks_past_the_records_already_in_shards(tmp_path):
    """A run stopped by a bad record late in a plain JSON-lines file resumes from its cursor. The bytes before the
    cursor are then overwritten by one line of garbage of the same length (the inputs' sizes are part of the
    job): a reader that went through them would number the records after them differently (as the reader that
    re-parsed from the start did). The resumed run ends with the reference's shards."""
    lines = gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rb").read().splitlines(True)
    good = b"".join(lines)
    src = tmp_path / "wiki.jsonl"
    src.write_bytes(b"".join(lines[:50]) + b"{" * (len(lines[50]) - 1) + b"\n" + b"".join(lines[51:]))
    opts = dict(source="wikipedia", inputs=[str(src)], workers=0, shard_size=16)
    with pytest.raises(CorpusError, match="wiki.jsonl:51: malformed JSON"):
        prepare(PrepareOptions(out=str(tmp_path / "out"), **opts))
    state = json.loads((tmp_path / "out/.prepare-state.json").read_text())
    file, offset, line, record = state["next"]["cursor"]
    assert (file, line) == (0, record) and 0 < record < 50 and offset == len(b"".join(lines[:record]))
    src.write_bytes(b"\xff" * offset + good[offset:])
    resumed = prepare(PrepareOptions(out=str(tmp_path / "out"), **opts))
    src.write_bytes(good)
    reference = prepare(PrepareOptions(out=str(tmp_path / "ref"), **opts))
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in reference["shards"]]
    for key in ("num_samples", "num_documents", "num_records", "skipped", "truncated_documents"):
        assert resumed[key] == reference[key]
