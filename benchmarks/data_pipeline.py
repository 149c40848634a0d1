"""Data pipeline benchmark: `prepare` vs the raw tokenizer, and the stream vs bare webdataset, in one run.

    python -m benchmarks.data_pipeline [--data ../shared/data/pretrain] [--out benchmarks/results/data_pipeline.json]

1. Tokenizer baseline: `tokenizers.Tokenizer.encode_batch` on one core (TOKENIZERS_PARALLELISM=false) over
   exactly the document texts prepare tokenizes, in the same ~1 MB chunks.
2. prepare with 1 worker (and 2, for scaling) on Wikipedia (WikiExtractor jsonl.gz) + Gutenberg books;
   MB/s counts the UTF-8 bytes of the document text. The main process reads and writes while the worker
   tokenizes, as in real runs.
3. The stream over the resulting 512-token shards: StreamLoader with 0 and 2 workers, batch 32, shuffle
   buffer 1000, samples decoded to token-id arrays; against a bare `webdataset.WebDataset` iteration
   (no decoding) over the same shards.
4. The same stream with 1 worker from the local files and over HTTP from a loopback server
   (tests/http_shards.py in its own process: ranged requests, sendfile), sha256 verified, the next shard
   prefetched; the median of 3 alternating runs each, with the time to the first batch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from pretrieve.data.corpora import Document, read_corpus
from pretrieve.data.prepare import CHUNK_CHARS, PrepareOptions, prepare
from pretrieve.data.remote import ReadOptions
from pretrieve.data.stream import ShardStream, StreamLoader
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

CORPORA = [("wikipedia", "enwiki-sample"), ("books", "gutenberg")]


def tokenizer_baseline(data: Path) -> dict:
    texts = [r.text for source, folder in CORPORA for r in read_corpus(source, [data / folder]) if isinstance(r, Document)]
    chunks, current, size = [], [], 0
    for text in texts:
        current.append(text)
        size += len(text)
        if size >= CHUNK_CHARS:
            chunks.append(current)
            current, size = [], 0
    chunks.append(current)
    backend = load_backend(DEFAULT_TOKENIZER)
    started = time.perf_counter()
    tokens = sum(len(e.ids) for chunk in chunks for e in backend.encode_batch(chunk, add_special_tokens=False))
    seconds = time.perf_counter() - started
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    return {"documents": len(texts), "text_mb": round(megabytes, 2), "tokens": tokens, "seconds": round(seconds, 2),
            "mb_per_s": round(megabytes / seconds, 3), "tokens_per_s": round(tokens / seconds)}


def run_prepare(data: Path, out: Path, workers: int, text_mb: float) -> tuple[dict, list[Path]]:
    started = time.perf_counter()
    manifests, tokens, skipped = [], 0, {}
    for source, folder in CORPORA:
        m = prepare(PrepareOptions(source=source, inputs=[str(data / folder)], out=str(out / source), workers=workers,
                                   shard_size=10000, overwrite=True, progress=False,
                                   on_error="skip"))  # Gutenberg has a latin-1 line: skipped, counted
        manifests.append(out / source / "manifest.json")
        tokens += m["num_tokens"]
        skipped.update({f"{source}:{reason}": n for reason, n in m["skipped"].items()})
    seconds = time.perf_counter() - started
    return {"workers": workers, "skipped": skipped, "seconds": round(seconds, 2), "mb_per_s": round(text_mb / seconds, 3),
            "mb_per_s_per_worker": round(text_mb / seconds / workers, 3),
            "tokens_per_s_per_worker": round(tokens / seconds / workers)}, manifests


def stream_rate(manifests: list, workers: int, read: ReadOptions | None = None) -> dict:
    started = time.perf_counter()
    stream = ShardStream(manifests, seed=0, shuffle_buffer=1000, read=read)  # manifests are read in the time
    loader = StreamLoader(stream, batch_size=32, num_workers=workers)
    samples = tokens = 0
    first_batch = None
    for batch in loader:
        first_batch = first_batch or time.perf_counter() - started
        samples += len(batch)
        tokens += sum(len(s["ids"]) for s in batch)
    seconds = time.perf_counter() - started
    return {"workers": workers, "samples": samples, "seconds": round(seconds, 2),
            "samples_per_s": round(samples / seconds), "samples_per_s_per_worker": round(samples / seconds / max(1, workers)),
            "mean_tokens_per_sample": round(tokens / samples, 1), "first_batch_s": round(first_batch, 3)}


@contextmanager
def loopback_http_server(folder: Path):
    """tests/http_shards.py serving `folder` on 127.0.0.1 in its own process; yields its base URL."""
    port_file = folder / ".port"
    port_file.unlink(missing_ok=True)
    server = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[1] / "tests/http_shards.py"),
                               str(folder), "--port-file", str(port_file)])
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the loopback HTTP server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def local_vs_http(manifests: list[Path], folder: Path, repeats: int = 3) -> dict:
    """1 worker, the next shard prefetched: median samples/s and time to first batch, local files vs HTTP."""
    runs: dict[str, list[dict]] = {"local": [], "http": []}
    with loopback_http_server(folder) as base:
        urls = [f"{base}/{m.relative_to(folder).as_posix()}" for m in manifests]
        for _ in range(repeats):  # alternating, so drifting load on a shared machine hits both alike
            runs["local"].append(stream_rate(manifests, 1, ReadOptions(prefetch_shards=1)))
            runs["http"].append(stream_rate(urls, 1, ReadOptions(prefetch_shards=1)))
    summary = {kind: {"samples_per_s_per_worker": round(statistics.median(r["samples_per_s"] for r in rs)),
                      "first_batch_s": round(statistics.median(r["first_batch_s"] for r in rs), 3), "runs": rs}
               for kind, rs in runs.items()}
    summary["http_to_local_ratio"] = round(summary["http"]["samples_per_s_per_worker"]
                                           / summary["local"]["samples_per_s_per_worker"], 3)
    return summary


def bare_webdataset_rate(manifests: list[Path]) -> dict:
    import webdataset as wds

    urls = [str(m.parent / s["file"]) for m in manifests for s in json.loads(m.read_text())["shards"]]
    started = time.perf_counter()
    samples = sum(1 for _ in wds.WebDataset(urls, shardshuffle=False))
    seconds = time.perf_counter() - started
    return {"samples": samples, "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared/data/pretrain")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results/data_pipeline.json")
    parser.add_argument("--work-dir", type=Path, default=None, help="where shards go (default: a temp dir)")
    args = parser.parse_args()
    # one core: the numbers are per worker (tokenizers reads it at each call, the workers and the server inherit it)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pretrieve-bench-"))

    baseline = tokenizer_baseline(args.data)
    print("tokenizer", baseline, flush=True)
    prep1, manifests = run_prepare(args.data, work / "w1", 1, baseline["text_mb"])
    print("prepare", prep1, flush=True)
    prep2, _ = run_prepare(args.data, work / "w2", 2, baseline["text_mb"])
    print("prepare", prep2, flush=True)
    bare = bare_webdataset_rate(manifests)
    print("webdataset", bare, flush=True)
    streams = [stream_rate(manifests, w) for w in (0, 2)]
    print("stream", streams, flush=True)
    remote = local_vs_http(manifests, work / "w1")
    print("http", {k: v for k, v in remote.items() if k != "runs"}, flush=True)

    result = {
        "prepare_to_tokenizer_ratio": round(prep1["mb_per_s_per_worker"] / baseline["mb_per_s"], 3),
        "stream_samples_per_s_per_worker": streams[0]["samples_per_s_per_worker"],
        "stream_to_raw_webdataset_ratio": round(streams[0]["samples_per_s"] / bare["samples_per_s"], 3),
        "http_to_local_ratio_1_worker": remote["http_to_local_ratio"],
        "first_batch_s": {"local": remote["local"]["first_batch_s"], "http": remote["http"]["first_batch_s"]},
        "detail": {"tokenizer_encode_batch": baseline, "prepare": [prep1, prep2], "raw_webdataset": bare,
                   "stream": streams, "local_vs_http_1_worker": remote},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "command": "python -m benchmarks.data_pipeline",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
    if args.work_dir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
