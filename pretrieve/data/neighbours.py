"""Neighbouring blocks of a sample's document, for the contextual decoders (CoT-MAE, CoT-MoTE).

`prepare` writes a document's blocks consecutively, each with its `doc` id and `block` number, so the
blocks next to a sample in its shard are its neighbours when they carry the same (source, doc) and an
adjacent block number; nothing else qualifies, so a neighbour never crosses documents. Shards are read
whole into a small per-process cache (the stream reads a window of samples from few shards at a time).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from pretrieve.data.shards import read_shard


class NeighbourBlocks:
    def __init__(self, cached_shards: int = 4):
        self.cached_shards = cached_shards
        self._cache: OrderedDict[str, list[tuple[np.ndarray, dict]]] = OrderedDict()

    def _shard(self, path: str) -> list[tuple[np.ndarray, dict]]:
        if path in self._cache:
            self._cache.move_to_end(path)
        else:
            self._cache[path] = list(read_shard(path))
            while len(self._cache) > self.cached_shards:
                self._cache.popitem(last=False)
        return self._cache[path]

    def candidates(self, sample: dict) -> list[tuple[np.ndarray, dict]]:
        """The previous and next blocks of the sample's document found in its shard (0, 1 or 2)."""
        blocks = self._shard(sample["shard_file"])
        index = sample["index"]
        found = []
        for j in (index - 1, index + 1):
            if 0 <= j < len(blocks):
                ids, meta = blocks[j]
                if (meta["doc"], meta["source"]) == (sample["doc"], sample["source"]) \
                        and abs(meta["block"] - sample["block"]) == 1:
                    found.append((ids, meta))
        return found

    def pick(self, sample: dict, rng: np.random.Generator) -> tuple[np.ndarray, dict] | None:
        """A random neighbouring block of the same document, or None for a one-block document."""
        found = self.candidates(sample)
        return found[int(rng.integers(len(found)))] if found else None
