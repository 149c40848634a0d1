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
                 seed: int, epoch_samples: int | None = None):
        self.manifest_shards = manifest_shards
        self.shard_sizes = shard_sizes
        self.seed = seed
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
        self.fingerprint = hashlib.sha256(json.dumps(
            [manifest_shards, shard_sizes, weights, seed, epoch_samples]).encode()).hexdigest()[:16]

    # --- epoch contents -------------------------------------------------------------------------------
    def epoch_sequence(self, epoch: int) -> list[Segment]:
        pieces = []
        for m, quota in enumerate(self.quotas):
            pieces.extend(self._manifest_slice(m, epoch * quota, quota))
        order = np.random.default_rng([self.seed, 2, epoch]).permutation(len(pieces))
        return [pieces[i] for i in order]

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
    @staticmethod
    def layout(sequence: list[Segment], world: int, workers: int) -> list[list[list[Segment]]]:
        """[rank][worker] -> segments; equal per rank (padded), near-equal per worker."""
        n = total(sequence)
        per_rank = math.ceil(n / world) if n else 0
        padded = list(sequence)
        missing = per_rank * world - n
        while missing > 0:  # wrap around; more than one lap only for datasets smaller than the world
            piece = take(sequence, 0, min(missing, n), pad=True)
            padded.extend(piece)
            missing -= total(piece)
        out = []
        for r in range(world):
            rank_seq = take(padded, r * per_rank, (r + 1) * per_rank)
            sizes = [per_rank // workers + (w < per_rank % workers) for w in range(workers)]
            bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
            out.append([take(rank_seq, bounds[w], bounds[w + 1]) for w in range(workers)])
        return out

    @classmethod
    def remaining(cls, sequence: list[Segment], world: int, workers: int, offsets: list[int]) -> list[Segment]:
        """What a stage (world, workers) left unread when each rank's worker w had consumed offsets[w]."""
        rest: list[Segment] = []
        for rank_slots in cls.layout(sequence, world, workers):
            for w, slot in enumerate(rank_slots):
                rest.extend(s for s in drop(slot, offsets[w]) if not s.pad)
        return rest

    def stage_sequence(self, epoch: int, finished_stages: list[dict]) -> list[Segment]:
        """The samples of `epoch` left after the finished stages of an elastic resume, in order."""
        sequence = self.epoch_sequence(epoch)
        for stage in finished_stages:
            sequence = self.remaining(sequence, stage["world"], stage["workers"], stage["offsets"])
        return sequence
