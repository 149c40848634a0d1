"""What `pretrieve stream` measures: epochs of the training stream (mixture, shuffle, rank / worker split) read
through its loader as training reads them, counted (batches, samples, tokens, samples per source) and timed."""

from __future__ import annotations

import time
from typing import Iterator

from pretrieve.data.stream import ShardStream, StreamLoader


def epoch_counts(manifests: list[str], *, epochs: int, batch_size: int, workers: int, shuffle_buffer: int, seed: int,
                 weights: list[float] | None = None, one_source_batches: bool = False) -> Iterator[dict]:
    """One dict per epoch, yielded as the epoch ends: {epoch, batches, samples, tokens, sources (samples per source
    name, as the mixture drew them), seconds, samples_per_s}; a pair's tokens are its texts' together. The time is the epoch's, start of its first batch to
    the end of its last; the stream's manifests are read before it."""
    stream = ShardStream(manifests, weights=weights, seed=seed, shuffle_buffer=shuffle_buffer,
                         one_source_batches=one_source_batches, batch_size=batch_size)
    loader = StreamLoader(stream, batch_size=batch_size, num_workers=workers)
    for _ in range(epochs):
        epoch = stream.epoch
        samples = tokens = batches = 0
        sources: dict[str, int] = {}
        start = time.perf_counter()
        for batch in loader:
            batches += 1
            samples += len(batch)
            for sample in batch:
                tokens += sample_tokens(sample)
                sources[sample["source"]] = sources.get(sample["source"], 0) + 1
        seconds = time.perf_counter() - start
        yield {"epoch": epoch, "batches": batches, "samples": samples, "tokens": tokens, "sources": sources,
               "seconds": round(seconds, 3), "samples_per_s": round(samples / max(seconds, 1e-9), 1)}


def sample_tokens(sample: dict) -> int:
    """The tokens of a text sample, or of a pair's query, positive and negatives."""
    if "ids" in sample:
        return len(sample["ids"])
    return len(sample["query"]) + len(sample["pos"]) + sum(len(n) for n in sample["negs"])
