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
        blocks, at = self.document(sample, reach=1)
        return [blocks[j] for j in (at - 1, at + 1) if 0 <= j < len(blocks)]

    def document(self, sample: dict, reach: int) -> tuple[list[tuple[np.ndarray, dict]], int]:
        """(the blocks of the sample's document found in its shard, at most `reach` on either side of it, in
        order, the sample's own included; the sample's place among them)."""
        blocks = self._shard(sample["shard_file"])
        key = (sample["doc"], sample["source"])

        def run(step: int) -> list[tuple[np.ndarray, dict]]:
            found, j, block = [], sample["index"] + step, sample["block"]
            while len(found) < reach and 0 <= j < len(blocks):
                ids, meta = blocks[j]
                if (meta["doc"], meta["source"]) != key or meta["block"] != block + step:
                    break
                found.append((ids, meta))
                j, block = j + step, block + step
            return found

        before = run(-1)[::-1]
        own = blocks[sample["index"]]
        return [*before, own, *run(1)], len(before)
