"""Pair streaming against the text stream: `prepare --pairs` and the stream over pair shards, in one run.

    python -m benchmarks.pair_stream [--data ../shared/data/pretrain] [--out benchmarks/results/pair_stream.json]

1. prepare, 2 workers, on the Wikipedia sample (WikiExtractor jsonl.gz): text blocks, and pairs (title ->
   first paragraph, "title: heading" -> section); on the Gutenberg books: crop pairs. MB/s counts the input's
   document text (UTF-8), as benchmarks/data_pipeline.py does.
2. The stream over the shards: StreamLoader with 0 and 2 workers, batch 32, shuffle buffer 1000, samples decoded
   into token-id arrays (a pair into its query, positive and negatives): the Wikipedia text shards, the pair
   shards of both sources mixed, and the same with one-source batches. The median of 3 runs each, in turns, with
   samples/s and tokens/s (a pair's tokens are its texts' together).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from pretrieve.data.corpora import Document, read_corpus
from pretrieve.data.prepare import PrepareOptions, prepare
from pretrieve.data.stream import ShardStream, StreamLoader
from pretrieve.data.stream_counts import sample_tokens

BATCH, BUFFER = 32, 1000


def text_megabytes(source: str, folder: Path) -> float:
    return sum(len(r.text.encode("utf-8")) for r in read_corpus(source, [folder]) if isinstance(r, Document)) / 1e6


def timed_prepare(out: Path, source: str, folder: Path, megabytes: float, **options) -> dict:
    m = prepare(PrepareOptions(source=source, inputs=[str(folder)], out=str(out), workers=2, progress=False,
                               **options))
    seconds = m["prepare_seconds"]  # the manifest's: the run that wrote it
    return {"samples": m["num_samples"], "tokens": m["num_tokens"], "seconds": round(seconds, 2),
            "mb_per_s": round(megabytes / seconds, 3), **({"pair_kinds": m["pair_kinds"],
                                                           "duplicate_pairs": m["duplicate_pairs"]}
                                                          if options.get("pairs") else {})}


def stream_once(manifests: list[Path], workers: int, one_source: bool) -> dict:
    stream = ShardStream(manifests, seed=0, shuffle_buffer=BUFFER, one_source_batches=one_source, batch_size=BATCH)
    samples = tokens = 0
    started = time.perf_counter()
    for batch in StreamLoader(stream, batch_size=BATCH, num_workers=workers):
        samples += len(batch)
        tokens += sum(sample_tokens(s) for s in batch)
    seconds = time.perf_counter() - started
    return {"samples": samples, "tokens": tokens, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/pretrain"))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results/pair_stream.json")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the shards here; a later run streams them again, its prepare rows are the first's")
    args = parser.parse_args()
    wiki, books = args.data / "enwiki-sample", args.data / "gutenberg"
    wiki_mb, books_mb = text_megabytes("wikipedia", wiki), text_megabytes("books", books)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.work or Path(scratch)
        prepared = {
            "wikipedia text": timed_prepare(tmp / "wiki-text", "wikipedia", wiki, wiki_mb),
            "wikipedia pairs": timed_prepare(tmp / "wiki-pairs", "wikipedia", wiki, wiki_mb, pairs=True),
            "books crop pairs": timed_prepare(tmp / "books-pairs", "books", books, books_mb, pairs=True,
                                              on_error="skip"),
        }
        streams = {
            "text": ([tmp / "wiki-text"], False),
            "pairs": ([tmp / "wiki-pairs", tmp / "books-pairs"], False),
            "pairs, one-source batches": ([tmp / "wiki-pairs", tmp / "books-pairs"], True),
        }
        runs: dict = {(name, w): [] for name in streams for w in (0, 2)}
        for _ in range(args.repeats):  # in turns, so that load on the machine falls on all alike
            for (name, workers), results in runs.items():
                manifests, one_source = streams[name]
                results.append(stream_once(manifests, workers, one_source))
    stream_rows = {}
    for (name, workers), results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        stream_rows[f"{name}, {workers} workers"] = {
            "samples": results[0]["samples"], "tokens": results[0]["tokens"], "median_seconds": round(seconds, 3),
            "samples_per_s": round(results[0]["samples"] / seconds), "tokens_per_s": round(results[0]["tokens"] / seconds)}
    for workers in (0, 2):
        text = stream_rows[f"text, {workers} workers"]
        for name in ("pairs", "pairs, one-source batches"):
            row = stream_rows[f"{name}, {workers} workers"]
            row["tokens_per_s_vs_text"] = round(row["tokens_per_s"] / text["tokens_per_s"], 3)
    result = {
        "input_mb": {"wikipedia": round(wiki_mb, 2), "books": round(books_mb, 2)},
        "prepare_2_workers": prepared,
        "stream": stream_rows,
        "batch_size": BATCH, "shuffle_buffer": BUFFER, "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(stream_rows))


if __name__ == "__main__":
    main()
