"""The shards of a run's manifests checked before the run starts (`data.check_shards`), so that a truncated or
replaced shard is an error naming it before DeepSpeed starts, not a failure minutes into the run.

`size` (the default) compares each shard's size with its manifest's `bytes`: a stat per local shard, one request
per remote one. `sha256` reads every shard whole and checks its digest: it finds a shard corrupted in place, at
the cost of reading the corpus once more (for remote shards, downloading it). `none` leaves it to the stream,
which verifies each shard as it reads it (data/stream.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pretrieve.data.remote import ReadError, ReadOptions, resolve, size_of
from pretrieve.data.shards import ShardError, length_mismatch, load_shard
from pretrieve.data.stream import StreamError, load_manifest

CHECKS = ("size", "sha256", "none")
SHOWN = 5  # bad shards named in the error; the count says how many more


def check_shards(manifests: list[str], read: ReadOptions | None = None, how: str = "size") -> int:
    """Check every shard of `manifests` as `how` says (one of CHECKS); returns the number checked. StreamError
    names the bad shards and what is wrong with each."""
    if how not in CHECKS:
        raise ValueError(f"check_shards: {how!r} is not one of {', '.join(CHECKS)}")
    if how == "none":
        return 0
    read = read or ReadOptions()
    shards = []
    for manifest in manifests:
        location, content = load_manifest(manifest, read)
        shards += [(resolve(location, s["file"]), s) for s in content["shards"]]
    with ThreadPoolExecutor(max_workers=16) as pool:  # remote shards: one request each, many in flight
        problems = [p for p in pool.map(lambda shard: _problem(*shard, read, how), shards) if p]
    if problems:
        more = f"; and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise StreamError(f"{len(problems)} of {len(shards)} shards fail the {how} check (data.check_shards): "
                          f"{'; '.join(problems[:SHOWN])}{more}. Copy them again, or re-run `pretrieve prepare` "
                          "into a fresh directory")
    return len(shards)


def _problem(location: str, shard: dict, read: ReadOptions, how: str) -> str | None:
    """What is wrong with one shard, in words; None when nothing is."""
    expected = shard.get("bytes")
    try:
        if how == "sha256":
            load_shard(location, shard["sha256"], expected, read)
            return None
        size = size_of(location, read)
    except (ShardError, ReadError) as e:
        return str(e).split(". Copy it again")[0]
    if expected is None or size is None or size == expected:  # an old manifest without sizes; a pipe:
        return None
    return f"{location}: {length_mismatch(size, expected)}"
