"""Shards over the network (data/remote.py, data/prefetch.py): HTTP from a loopback server gives exactly the
local batches and resumes exactly; transient faults are retried (from the failed range, not the start) and
persistent ones end in an error naming the URL, the attempts and the last error, bounded by the timeouts, with
no sample of a bad shard yielded; pipe: and file:// locations; s3:// against moto's S3 server, for reading and
for `prepare --out s3://...`. Backends exercised: local paths, file://, pipe:, http:// (fsspec + aiohttp) and
s3:// (fsspec + s3fs); gs:// shares the s3 code path in fsspec and is not run here.
"""

import json
import mmap
import multiprocessing
import shutil
import threading
import time
from pathlib import Path

import pytest

from support import SAMPLES
from http_shards import ShardServer
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareError, PrepareOptions
from pretrieve.data.remote import ReadOptions, fetch, resolve
from pretrieve.data.shards import ShardError
from pretrieve.data.stream import ShardStream, StreamError, StreamLoader

pytestmark = pytest.mark.system

BATCH = 8
# small blocks, so every shard takes several ranged requests; small timeouts and backoffs keep faults quick
READ = ReadOptions(block_size=16 << 10, timeout=2.0, retries=3, backoff=0.01, backoff_max=0.05)


def content(batches):
    return [[(s["shard"], s["index"], s["pad"], s["doc"], s["block"], s["ids"].tobytes()) for s in b] for b in batches]


def run(stream, workers=0, limit=None):
    """One epoch of batches (or the first `limit`) as comparable tuples."""
    out = []
    it = iter(StreamLoader(stream, batch_size=BATCH, num_workers=workers))
    for batch in it:
        out.append(batch)
        if len(out) == limit:
            it.close()
            break
    return content(out)


def make(manifests, read=READ, **kw):
    return ShardStream(manifests, seed=3, shuffle_buffer=40, read=read, **kw)


def samples_until_error(stream):
    """(samples yielded, the ShardError that ended the stream)."""
    got = []
    with pytest.raises(ShardError) as error:
        for sample in stream:
            got.append(sample)
    return got, error.value


@pytest.fixture(scope="module")
def local(wiki_shards, books_shards):
    manifests = [wiki_shards / "manifest.json", books_shards / "manifest.json"]
    return {workers: run(make(manifests), workers) for workers in (0, 2)}


@pytest.fixture
def server(wiki_shards, books_shards):
    with ShardServer({"wiki": wiki_shards, "books": books_shards}, stall_seconds=5) as s:
        yield s


def http_manifests(server):
    return [server.url("wiki/manifest.json"), server.url("books/")]  # a folder URL gets manifest.json


@pytest.mark.parametrize("workers", [0, 2])
def test_http_stream_gives_the_local_batches_and_resumes_exactly(server, local, workers):
    assert run(make(http_manifests(server)), workers) == local[workers]
    ranged = [r for name, r in server.requests if name.endswith(".tar")]
    assert ranged and all(r and r.startswith("bytes=") for r in ranged)
    assert len(ranged) > 2 * 16  # 16 shards of more than one 16 KiB block each
    n = len(local[workers]) // 3
    first = make(http_manifests(server))
    assert run(first, workers, limit=n) == local[workers][:n]
    resumed = make(http_manifests(server))  # a fresh stream: what a restarted process builds
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert run(resumed, workers) == local[workers][n:]


def test_a_local_run_resumes_over_http(server, local, wiki_shards, books_shards):
    """Positions are sample offsets: the state does not depend on where the bytes come from."""
    first = make([wiki_shards / "manifest.json", books_shards / "manifest.json"])
    assert run(first, limit=10) == local[0][:10]
    resumed = make(http_manifests(server))
    resumed.load_state_dict(first.state_dict())
    assert run(resumed) == local[0][10:]


def test_file_urls_pipe_commands_and_relative_names(books_shards, tmp_path):
    expected = run(make([books_shards / "manifest.json"]))
    assert run(make([f"file://{books_shards}/manifest.json"])) == expected
    manifest = json.loads((books_shards / "manifest.json").read_text())
    for shard in manifest["shards"]:  # webdataset's convention: the command writes the shard to stdout
        shard["file"] = f"pipe:cat {books_shards / shard['file']}"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert run(make([tmp_path])) == expected
    relative = f"pipe:cat {books_shards / 'manifest.json'}"
    with pytest.raises(StreamError, match="read through pipe: has no folder"):
        make([relative])
    with pytest.raises(StreamError, match=r"nowhere://b/manifest.json: no backend for nowhere://"):
        make(["nowhere://b/"])

    assert resolve("https://h:8/a/b/manifest.json?sig=1", "x-0.tar") == "https://h:8/a/b/x-0.tar"
    assert resolve("s3://bucket/p/manifest.json", "../q/x.tar") == "s3://bucket/q/x.tar"
    assert resolve("gs://bucket/manifest.json", "s3://other/x.tar") == "s3://other/x.tar"
    assert resolve("file:///data/w/manifest.json", "x.tar") == "file:///data/w/x.tar"
    assert resolve("/data/w/manifest.json", "x.tar") == "/data/w/x.tar"


def test_a_failing_pipe_command_is_retried_then_named(books_shards, tmp_path):
    manifest = json.loads((books_shards / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["file"] = str(books_shards / shard["file"])  # absolute names are taken as they are
    manifest["shards"][1]["file"] = "pipe:cat /nonexistent/books-000001.tar"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    got, error = samples_until_error(make([tmp_path], read=ReadOptions(retries=1, backoff=0.01)))
    assert "pipe:cat /nonexistent/books-000001.tar: reading the command's output failed 2 times" in str(error)
    assert "exit 1" in str(error) and "stopped at sample 0" in str(error)
    assert all(s["shard"] != 1 for s in got)

    manifest["shards"][1]["file"] = "pipe:sleep 30"  # silent past the timeout: killed, not waited for
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    started = time.monotonic()
    _, error = samples_until_error(make([tmp_path], read=ReadOptions(retries=0, timeout=0.3)))
    assert "pipe:sleep 30: reading the command's output failed 1 times" in str(error)
    assert "TimeoutError: no output for 0.3 s" in str(error) and time.monotonic() - started < 10


def test_transient_faults_are_retried_from_the_failed_range(server, local):
    server.faults.update({"wikipedia-000001.tar": ["503", "503"], "wikipedia-000002.tar": ["ok", "drop"],
                          "wikipedia-000004.tar": ["ok", "ok", "stall"], "books-000001.tar": ["reset"]})
    # a timeout well above a loaded machine's answer time (an answer past it is one more fault) and below the stall
    read = ReadOptions(block_size=16 << 10, timeout=2.0, retries=2, backoff=0.01, backoff_max=0.05)
    assert run(make(http_manifests(server), read=read)) == local[0]
    assert not any(server.faults.values())  # every fault was served
    for name, faulted in (("wikipedia-000002.tar", 1), ("wikipedia-000004.tar", 2)):
        ranges = [r for n, r in server.requests if n == name]
        assert ranges[faulted] == ranges[faulted + 1] != ranges[0]  # the failed range again, not the file again
        assert ranges.count(ranges[0]) == 1


# aiohttp itself sends a request again, once, when the kept-alive connection it reused turns out closed
@pytest.mark.parametrize("fault, last_error, requests", [
    ("503", "ClientResponseError: 503", (3, 3)), ("stall", "TimeoutError: no answer within 1.5 s", (3, 3)),
    ("reset", "ServerDisconnectedError", (3, 6))])
def test_persistent_faults_end_in_an_error_naming_url_attempts_and_last_error(server, fault, last_error, requests):
    server.faults["books-000002.tar"] = [fault] * 10
    read = ReadOptions(block_size=16 << 10, timeout=1.5, retries=2, backoff=0.01, backoff_max=0.05)
    started = time.monotonic()
    got, error = samples_until_error(make([server.url("books/manifest.json")], read=read))
    assert time.monotonic() - started < 30  # bounded: 3 attempts of at most 1.5 s, and the other shards
    message = str(error)
    assert message.startswith(f"{server.url('books/books-000002.tar')}: reading bytes 0-16383 of ")
    assert "failed 3 times in a row (data.retries=2, data.timeout=1.5 s)" in message
    assert last_error in message.split("last error:")[1]
    assert "The stream stopped at sample 0 of this shard's 16; none of its samples was yielded" in message
    assert all(s["shard"] != 2 for s in got)
    assert requests[0] <= [n for n, _ in server.requests].count("books-000002.tar") <= requests[1]


def test_missing_shard_is_not_retried(books_shards, tmp_path):
    (tmp_path / "books").mkdir()
    for path in books_shards.iterdir():
        if path.name != "books-000003.tar":
            (tmp_path / "books" / path.name).write_bytes(path.read_bytes())
    with ShardServer(tmp_path) as server:
        got, error = samples_until_error(make([server.url("books/manifest.json")]))
        assert "books-000003.tar: reading bytes 0-16383" in str(error) and "not retried" in str(error)
        assert "FileNotFoundError" in str(error)  # fsspec's name for a 404
        assert [n for n, _ in server.requests].count("books-000003.tar") == 1
    assert all(s["shard"] != 3 for s in got)


def test_a_truncated_shard_is_named_truncated_over_http_and_pipe(books_shards, tmp_path):
    """The manifest's byte count tells a short shard from a corrupted one, whichever way it is read."""
    shutil.copytree(books_shards, tmp_path / "books")
    victim = tmp_path / "books" / "books-000002.tar"
    size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:size - 1000])  # ends inside a 16 KiB range
    with ShardServer(tmp_path) as server:
        got, error = samples_until_error(make([server.url("books/manifest.json")]))
    assert str(error).startswith(f"{server.url('books/books-000002.tar')}: truncated: it ends at byte "
                                 f"{size - 1000:,}, before the {size:,} bytes expected")
    assert "stopped at sample 0" in str(error) and all(s["shard"] != 2 for s in got)
    manifest = json.loads((tmp_path / "books" / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["file"] = f"pipe:cat {tmp_path / 'books' / shard['file']}"
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    _, error = samples_until_error(make([tmp_path]))
    assert f"books-000002.tar: truncated: {size - 1000:,} of the {size:,} bytes the manifest records" in str(error)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_corrupted_byte_is_an_error_and_no_sample_of_the_shard_is_yielded(server, workers):
    server.corrupt["books-000002.tar"] = 5000
    stream = make([server.url("books/manifest.json")])
    got = []
    with pytest.raises(ShardError) as error:
        for batch in StreamLoader(stream, batch_size=BATCH, num_workers=workers):
            got.extend(batch)
    assert f"{server.url('books/books-000002.tar')}: sha256 differs from the manifest" in str(error.value)
    assert "stopped at sample 0 of this shard's 16; none of its samples was yielded" in str(error.value)
    assert got and all(s["shard"] != 2 for s in got)
    assert not multiprocessing.active_children()


def test_prefetch_loads_ahead_and_stops_when_the_stream_closes(server):
    def shards_requested():
        return {n for n, _ in server.requests if n.endswith(".tar")}

    def wait_for(condition, seconds=10.0):
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()

    def prefetch_threads():
        return [t for t in threading.enumerate() if t.name == "pretrieve-prefetch"]

    wiki = server.url("wiki/manifest.json")
    it = iter(ShardStream([wiki], seed=3, shuffle_buffer=1, read=ReadOptions(prefetch_shards=0)))
    first = next(it)["shard_file"].rsplit("/", 1)[1]
    assert shards_requested() == {first}  # without prefetch, nothing runs ahead
    it.close()

    server.requests.clear()
    server.faults.update({f"wikipedia-{i:06d}.tar": ["stall"] * 20 for i in range(11) if f"wikipedia-{i:06d}.tar" != first})
    read = ReadOptions(prefetch_shards=2, timeout=0.5, retries=20, backoff=0.01, backoff_max=0.05)
    it = iter(ShardStream([wiki], seed=3, shuffle_buffer=1, read=read))
    assert next(it)["shard_file"].endswith(first)
    assert wait_for(lambda: len(shards_requested()) == 3)  # the current shard and the next two
    assert len(prefetch_threads()) == 2
    it.close()  # the two loads, stalled in retries, give up at their next attempt
    assert wait_for(lambda: not prefetch_threads())


def test_a_shard_larger_than_the_memory_limit_is_spilled_and_mapped(server, books_shards, local):
    manifest = json.loads((books_shards / "manifest.json").read_text())
    shard = manifest["shards"][0]
    read = ReadOptions(block_size=16 << 10, memory_limit=20 << 10)
    data, digest = fetch(server.url(f"books/{shard['file']}"), shard["bytes"], read)
    assert isinstance(data, mmap.mmap) and len(data) == shard["bytes"] > 20 << 10 and digest == shard["sha256"]
    assert run(make(http_manifests(server), read=read)) == local[0]


def test_read_options_come_from_the_data_config():
    from pretrieve.pretrain_config import DataOptions

    read = ReadOptions.from_options(DataOptions(retries=2, timeout=3.0, prefetch_shards=0,
                                                storage_options={"s3": {"anon": True}}))
    assert (read.retries, read.timeout, read.prefetch_shards, read.storage_options) == (2, 3.0, 0, {"s3": {"anon": True}})
    with pytest.raises(ValueError, match="retries and prefetch_shards must be >= 0"):
        ReadOptions(retries=-1)


def test_prepare_to_a_file_url(tmp_path):
    manifest = prepare(PrepareOptions(source="books", inputs=[str(SAMPLES / "books")], out=f"file://{tmp_path}/b",
                                      shard_size=32, workers=0))
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["job_id"] == manifest["job_id"]


# --- s3:// against moto's S3 server on 127.0.0.1 ----------------------------------------------------------------
@pytest.fixture(scope="module")
def s3():
    """Options for s3fs pointing at a moto S3 server with one bucket."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "eu-west-1"}}
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir("pretrieve-test")
    yield options
    server.stop()


def test_prepare_to_s3_and_stream_it_back(s3, books_shards, tmp_path, monkeypatch):
    import fsspec
    import s3fs

    monkeypatch.setitem(fsspec.config.conf, "s3", s3)  # how `pretrieve prepare` finds the endpoint (or AWS_*)
    url = "s3://pretrieve-test/books"
    opts = PrepareOptions(source="books", inputs=[str(SAMPLES / "books")], out=url, shard_size=16, workers=0)
    manifest = prepare(opts)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3)
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("pretrieve-test/books")) == \
        sorted(["manifest.json"] + [s["file"] for s in manifest["shards"]])  # no staged manifest left
    assert prepare(opts) == manifest  # complete: nothing done again
    with pytest.raises(PrepareError, match="holds a complete prepare with other arguments"):
        prepare(PrepareOptions(**{**opts.__dict__, "shard_size": 32}))
    monkeypatch.delitem(fsspec.config.conf, "s3")

    read = ReadOptions(block_size=16 << 10, storage_options={"s3": s3})
    expected = run(make([books_shards / "manifest.json"]))
    assert run(make([url + "/manifest.json"], read=read), workers=1) == expected

    monkeypatch.setitem(fsspec.config.conf, "s3", s3)
    smaller = prepare(PrepareOptions(**{**opts.__dict__, "shard_size": 32, "overwrite": True}))
    assert len(smaller["shards"]) == 3
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls("pretrieve-test/books", refresh=True)) == \
        sorted(["manifest.json"] + [s["file"] for s in smaller["shards"]])  # the old shards 3 and 4 are gone


def test_pretraining_reads_its_shards_over_http_with_the_configured_retries(server, wiki_shards, tmp_path):
    """`pretrieve pretrain` with a manifest URL: the engine passes data.retries / timeout / prefetch_shards to
    the stream; a 503 on the shard is retried and the run logs the losses of the same run from local files."""
    import json
    import subprocess
    import sys

    from support import pretrain_env

    config = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-mlm.yaml"

    def pretrain(run_dir, manifest):
        args = [sys.executable, "-m", "pretrieve", "pretrain", str(config), f"run_dir={run_dir}",
                f"data.manifests=[{manifest}]", "data.weights=null", "method.max_len=64", "train.max_steps=2",
                "train.log_every=1", "train.micro_batch_size=4", "checkpoint.every=2", "tracking.enabled=false",
                "data.retries=3", "data.timeout=5", "data.prefetch_shards=1"]
        done = subprocess.run(args, env=pretrain_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    first_shard = json.loads((wiki_shards / "manifest.json").read_text())["shards"][0]["file"]
    server.faults[first_shard] = ["503"]
    over_http = pretrain(tmp_path / "http", server.url("wiki/manifest.json"))
    assert over_http == pretrain(tmp_path / "local", wiki_shards / "manifest.json")
    assert sum(1 for name, _ in server.requests if name.endswith(first_shard)) >= 2  # the 503, then the retry


def test_parts_prepared_into_s3_combine_there(s3, tmp_path, monkeypatch):
    """Two parts written to S3, combined into the folder above them: shard names relative to the combined
    manifest, which streams back the single local job's samples."""
    import fsspec

    from pretrieve.data.combine import combine

    monkeypatch.setitem(fsspec.config.conf, "s3", s3)
    common = dict(source="books", inputs=[str(SAMPLES / "books")], shard_size=16, workers=0, group_records=1)
    for i in range(2):
        prepare(PrepareOptions(out=f"s3://pretrieve-test/split/part-{i}", part=i, parts=2, **common))
    combined = combine([f"s3://pretrieve-test/split/part-{i}" for i in range(2)], "s3://pretrieve-test/split")
    single = prepare(PrepareOptions(out=str(tmp_path / "single"), **common))
    names = [s["file"] for s in combined["shards"]]
    assert names[0].startswith("part-0/books-") and names[-1].startswith("part-1/books-"), names
    assert [s["sha256"] for s in combined["shards"]] == [s["sha256"] for s in single["shards"]]
    monkeypatch.delitem(fsspec.config.conf, "s3")
    read = ReadOptions(storage_options={"s3": s3})
    assert run(make(["s3://pretrieve-test/split/manifest.json"], read=read)) == \
        run(make([tmp_path / "single" / "manifest.json"]))
