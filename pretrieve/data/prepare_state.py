"""Where a prepare job stands: what identifies its output, the resume state written after each complete shard,
and the output of an earlier run (its own to resume or to overwrite, another job's to refuse).

The state file records where the next shard starts (record index, block index, and the reader's cursor: file,
byte offset or row), the shards so far and the counts so far; a resumed run trusts a listed shard only if it is
still there, intact. The manifest is written last, atomically; its presence means the directory is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pretrieve.data import corpora, pairs, remote
from pretrieve.data.prepare_options import PrepareError
from pretrieve.data.shards import ShardStats, ShardWriter, read_shard
from pretrieve.utils.output_folder import check_own_entries
from pretrieve.utils.run_lock import LOCK_FILE

MANIFEST = "manifest.json"
STATE = ".prepare-state.json"


def job_id_of(arguments: dict, inputs: list[dict], fingerprint: str) -> str:
    """What identifies an output: its arguments, inputs (paths and sizes) and tokenizer (combine.py computes it too)."""
    job = {"arguments": arguments, "inputs": inputs, "tokenizer": fingerprint}
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def remote_manifest(location: str) -> dict | None:
    """The manifest at a URL, or None where there is none."""
    try:
        data, _ = remote.fetch(location, digest=False)
    except remote.NotFound:
        return None
    except remote.ReadError as e:
        raise PrepareError(f"cannot check for an earlier output: {e}") from e
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except ValueError as e:
        raise PrepareError(f"{location}: damaged ({e}); use another --out or pass --overwrite") from e


def load_previous(out: Path, job_id: str, overwrite: bool) -> dict:
    """The resume state of an earlier run of the same job; refuses to mix different jobs in one directory."""
    manifest_path, state_path = out / MANIFEST, out / STATE
    check_own_entries(out, "pretrieve prepare", _prepare_writes)  # --overwrite too: it removes only its own files
    if overwrite and out.exists():
        manifest_path.unlink(missing_ok=True)  # first: the old output stops being complete before any of it changes
        for p in out.iterdir():
            if p.name != LOCK_FILE:
                p.unlink()
        return {}
    for path, what in ((manifest_path, "a complete prepare"), (state_path, "an unfinished prepare")):
        if path.exists():
            try:
                previous = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise PrepareError(f"{path}: damaged ({e}); use another --out or pass --overwrite") from e
            if not isinstance(previous, dict) or previous.get("job_id") != job_id:
                raise PrepareError(f"{out} holds {what} with other arguments or inputs; "
                                   "use another --out or pass --overwrite")
            if path == manifest_path:
                return {"complete": True, "manifest": previous}
            return previous
    if out.exists() and any(out.glob("*.tar")):
        raise PrepareError(f"{out} holds shards but no manifest or resume state; use another --out or --overwrite")
    return {}


def _prepare_writes(name: str) -> bool:
    """The names a local prepare gives its files: shards, manifest, resume state, lock, temporary files."""
    return name in (MANIFEST, STATE, LOCK_FILE) or re.fullmatch(_SHARD_NAME, name) is not None


_SHARD_NAME = rf"\.?({'|'.join(map(re.escape, {*corpora.SOURCES, *pairs.PAIR_SOURCES}))})-\d{{6,}}\.tar(\.tmp)?|\..+\.tmp"


class ShardSequence:
    """Cuts the sample stream into shards and checkpoints progress after each complete shard."""

    def __init__(self, out: Path, source: str, token_ext: str, shard_size: int, job_id: str, state: dict,
                 pairs: bool = False):
        self.out, self.source, self.token_ext, self.shard_size, self.job_id = out, source, token_ext, shard_size, job_id
        self.shards = [ShardStats(**{k: v for k, v in s.items() if k != "group"}) for s in state.get("shards", [])]
        self.groups = [s["group"] for s in state.get("shards", [])]  # the record group of each shard
        self.group: int | None = None  # the group of the shard being written
        self.skipped = Counter(state.get("skipped", {}))
        self.documents = state.get("documents", 0)
        self.truncated = state.get("truncated", 0)
        self.counts = Counter(state.get("counts", {}))  # pairs: duplicates dropped, pairs by kind
        self.seen: set[bytes] = set()  # pairs: the digests of the pairs written
        self.writer: ShardWriter | None = None
        for shard in self.shards:  # a resumed run trusts complete shards only if they are intact
            path = out / shard.file
            if not path.exists() or path.stat().st_size != shard.bytes:
                raise PrepareError(f"{path}: listed as complete in {out / STATE} but missing or changed; "
                                   "re-run with --overwrite")
            if pairs:
                self.seen.update(_pairs_digests(path, shard))

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards) + (self.writer.num_samples if self.writer else 0)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards) + (self.writer.num_tokens if self.writer else 0)

    def shard_entries(self) -> list[dict]:
        return [{**s.as_dict(), "group": g} for s, g in zip(self.shards, self.groups)]

    def enter_group(self, group: int, next_position: dict) -> None:
        """The next record belongs to `group`: a shard of another group ends here, however few samples it has."""
        if group != self.group and self.writer is not None:
            self._close_shard()
            self._save_state(next_position)
        self.group = group

    def add(self, ids: np.ndarray, meta: dict, next_position: dict) -> None:
        if self.writer is None:
            self.writer = ShardWriter(self.out / f"{self.source}-{len(self.shards):06d}.tar", self.token_ext)
        self.writer.add(ids, meta)
        if self.writer.num_samples == self.shard_size:
            self._close_shard()
            self._save_state(next_position)

    def _close_shard(self) -> None:
        self.shards.append(self.writer.close())
        self.groups.append(self.group)
        self.writer = None

    def _save_state(self, next_position: dict) -> None:
        """`next`: the record to go on from (its cursor re-reads it) and its first block not yet written."""
        write_json_atomic(self.out / STATE, {
            "job_id": self.job_id, "next": {**next_position, "cursor": list(next_position["cursor"])},
            "shards": self.shard_entries(), "skipped": dict(self.skipped), "documents": self.documents,
            "truncated": self.truncated, "counts": dict(self.counts),
        })

    def finish(self) -> None:
        if self.writer is not None and self.writer.num_samples:
            self._close_shard()
        elif self.writer is not None:
            self.writer.abort()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _pairs_digests(path: Path, shard: ShardStats) -> Iterator[bytes]:
    for ids, meta in read_shard(path, sha256=shard.sha256, num_samples=shard.num_samples):
        yield pairs.pair_digest(ids, meta["parts"])


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
