"""Which samples an epoch holds, in which order, and which (rank, worker) reads which: pure arithmetic.

Everything is a function of (shard sizes, mixture weights, seed, epoch, world, workers) over `Segment`s
(ranges of samples inside one shard), so the plan is never stored and costs O(number of shards) to compute.
That is what makes resume exact and elastic: a stream position is just "how many samples each slot has
consumed", and the samples not yet consumed can be recomputed and redistributed over a new world size.

Epoch e:
1. Mixture: manifest m contributes n_m samples, n_m = N_m without weights, otherwise round(T * w_m / sum(w))
   with T = `epoch_samples` or the total size. Its samples come from an endless sequence of passes over its
   shards, each pass in an order drawn from (seed, m, pass); epoch e takes positions [e*n_m, (e+1)*n_m),
   so a down-weighted corpus walks through all of its data over the epochs and an up-weighted one repeats.
2. The shard pieces of all manifests are permuted together, drawn from (seed, e).
3. Ranks get equal contiguous shares; when the total is not a multiple of the world size, the last ranks are
   topped up with at most world-1 samples from the start of the epoch, flagged `pad`. Every rank thus yields
   the same number of batches and an uneven split never hangs a collective.
4. Inside a rank, workers get contiguous shares differing by at most one sample.
5. Each (rank, worker) slot reads its share in order and emits it shuffled in windows of `shuffle_buffer`
   samples, each window in an order drawn from (seed, epoch, stage, rank, slot, window).

One-source batches (`unit` = the batch size B > 1): each quota is rounded up to a multiple of B (the manifest's
endless sequence of passes supplies the few extra samples), each manifest's pieces are permuted alone, from
(seed, epoch, manifest), and split over ranks and workers in whole units of B (ranks topped up with whole units
from the start, flagged `pad`). A slot thus holds a multiple of B samples of each manifest; it shuffles each
manifest's share in its own windows, drawn from (seed, epoch, rank, slot, manifest, window), and emits batches
in an order of manifests drawn from (seed, epoch, rank, slot) (`batch_sources`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Segment:
    shard: int  # index into the stream's shard table
    start: int
    stop: int
    pad: bool = False  # a repeat that only equalises ranks

    @property
    def size(self) -> int:
        return self.stop - self.start


def total(segments: Sequence[Segment]) -> int:
    return sum(s.size for s in segments)


def take(segments: Sequence[Segment], begin: int, end: int, pad: bool | None = None) -> list[Segment]:
    """Positions [begin, end) of the concatenation of `segments`."""
    out, pos = [], 0
    for s in segments:
        lo, hi = max(begin, pos), min(end, pos + s.size)
        if lo < hi:
            out.append(Segment(s.shard, s.start + lo - pos, s.start + hi - pos, s.pad if pad is None else pad))
        pos += s.size
        if pos >= end:
            break
    return out


def drop(segments: Sequence[Segment], count: int) -> list[Segment]:
    return take(segments, count, total(segments))


class EpochPlan:
    def __init__(self, manifest_shards: list[list[int]], shard_sizes: list[int], weights: list[float] | None,
                 seed: int, epoch_samples: int | None = None, shuffle_buffer: int = 1000, unit: int = 1):
        self.manifest_shards = manifest_shards
        self.shard_sizes = shard_sizes
        self.seed = seed
        self.window = max(1, shuffle_buffer)
        sizes = [sum(shard_sizes[s] for s in shards) for shards in manifest_shards]
        if any(n == 0 for n in sizes):
            raise ValueError("a manifest with no samples cannot be streamed")
        if weights is None:
            if epoch_samples is not None:
                raise ValueError("epoch_samples needs mixture weights")
            self.quotas = sizes
        else:
            if len(weights) != len(manifest_shards):
                raise ValueError(f"{len(weights)} weights for {len(manifest_shards)} manifests")
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"mixture weights must be >= 0 with a positive sum, got {weights}")
            epoch_total = epoch_samples if epoch_samples is not None else sum(sizes)
            self.quotas = [round(epoch_total * w / sum(weights)) for w in weights]
        self.unit = unit
        if unit > 1:
            self.quotas = [math.ceil(q / unit) * unit for q in self.quotas]
        settings = [manifest_shards, shard_sizes, weights, seed, epoch_samples, self.window] + ([unit] if unit > 1 else [])
        self.fingerprint = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]

    # --- epoch contents -------------------------------------------------------------------------------
    def epoch_sequence(self, epoch: int) -> list[Segment]:
        pieces = []
        for m, quota in enumerate(self.quotas):
            pieces.extend(self._manifest_slice(m, epoch * quota, quota))
        order = np.random.default_rng([self.seed, 2, epoch]).permutation(len(pieces))
        return [pieces[i] for i in order]

    def manifest_sequence(self, epoch: int, m: int) -> list[Segment]:
        """Manifest m's samples of `epoch`, its pieces permuted alone (one-source batches)."""
        pieces = self._manifest_slice(m, epoch * self.quotas[m], self.quotas[m])
        order = np.random.default_rng([self.seed, 4, epoch, m]).permutation(len(pieces))
        return [pieces[i] for i in order]

    def batch_sources(self, epoch: int, rank: int, slot: int, batches: list[int]) -> np.ndarray:
        """The manifest of each batch of a slot that holds batches[m] batches of manifest m."""
        labels = np.repeat(np.arange(len(batches)), batches)
        return labels[np.random.default_rng([self.seed, 5, epoch, rank, slot]).permutation(len(labels))]

    def source_window_order(self, epoch: int, rank: int, slot: int, m: int, window: int, size: int) -> np.ndarray:
        """The order in which a slot emits one shuffle window of its share of manifest m (one-source batches)."""
        if self.window == 1:
            return np.arange(size)
        return np.random.default_rng([self.seed, 6, epoch, rank, slot, m, window]).permutation(size)

    def _manifest_slice(self, m: int, begin: int, count: int) -> list[Segment]:
        shards = self.manifest_shards[m]
        size = sum(self.shard_sizes[s] for s in shards)
        pass_index, skip = divmod(begin, size)
        out: list[Segment] = []
        while count > 0:
            for i in np.random.default_rng([self.seed, 1, m, pass_index]).permutation(len(shards)):
                n = self.shard_sizes[shards[i]]
                if skip >= n:
                    skip -= n
                    continue
                taken = min(n - skip, count)
                out.append(Segment(shards[i], skip, skip + taken))
                count -= taken
                skip = 0
                if count == 0:
                    break
            pass_index += 1
        return out

    # --- who reads what ---------------------------------------------------------------------------------
    @classmethod
    def layout(cls, sequence: list[Segment], world: int, workers: int) -> list[list[list[Segment]]]:
        """[rank][worker] -> segments; equal per rank (padded), near-equal per worker."""
        return [cls.rank_slots(sequence, world, workers, r) for r in range(world)]

    @staticmethod
    def rank_slots(sequence: list[Segment], world: int, workers: int, rank: int, unit: int = 1) -> list[list[Segment]]:
        """One rank's row of `layout`, without computing the others; `unit`: shares in whole units of that many
        samples (the sequence holds a multiple of it)."""
        n = total(sequence)
        per_rank = math.ceil(n / unit / world) * unit if n else 0
        begin, end = rank * per_rank, (rank + 1) * per_rank
        rank_seq = take(sequence, begin, min(end, n))
        pos = max(begin, n)  # past the end: wrap around, flagged pad (more than one lap only for tiny data)
        while pos < end:
            piece = take(sequence, (pos - n) % n, min((pos - n) % n + end - pos, n), pad=True)
            rank_seq.extend(piece)
            pos += total(piece)
        units = per_rank // unit
        sizes = [(units // workers + (w < units % workers)) * unit for w in range(workers)]
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        return [take(rank_seq, bounds[w], bounds[w + 1]) for w in range(workers)]

    def window_order(self, epoch: int, stage: int, rank: int, slot: int, window: int, size: int) -> np.ndarray:
        """The order in which a slot emits the `size` samples of one shuffle window."""
        if self.window == 1:
            return np.arange(size)
        return np.random.default_rng([self.seed, 3, epoch, stage, rank, slot, window]).permutation(size)

    def unread(self, slot_segments: list[Segment], consumed: int, epoch: int, stage: int, rank: int,
               slot: int) -> list[Segment]:
        """The samples of a slot not among its first `consumed` outputs (the open window's rest, in input order)."""
        window, emitted = divmod(consumed, self.window)
        if emitted == 0:
            return drop(slot_segments, consumed)
        begin = window * self.window
        size = min(self.window, total(slot_segments) - begin)
        open_window = take(slot_segments, begin, begin + size)
        left = np.sort(self.window_order(epoch, stage, rank, slot, window, size)[emitted:])
        return [take(open_window, int(p), int(p) + 1)[0] for p in left] + drop(slot_segments, begin + size)

    def stage_sequence(self, epoch: int, finished_stages: list[dict]) -> list[Segment]:
        """The samples of `epoch` left after the finished stages of an elastic resume, in order."""
        sequence = self.epoch_sequence(epoch)
        for stage_index, stage in enumerate(finished_stages):
            rest: list[Segment] = []
            for rank, rank_slots in enumerate(self.layout(sequence, stage["world"], stage["workers"])):
                for slot, segments in enumerate(rank_slots):
                    unread = self.unread(segments, stage["offsets"][slot], epoch, stage_index, rank, slot)
                    rest.extend(s for s in unread if not s.pad)
            sequence = rest
        return sequence
