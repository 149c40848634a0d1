"""The shard sample format (docs/design.md, "Shard sample"): write and read webdataset tar shards.

A sample is two tar members sharing a key: `<key>.ids.u16` (token ids, little-endian uint16; `.ids.i32`
when the vocabulary has 65,536 ids or more) and `<key>.json` (`doc`, `block`, `source`). Shards are plain
POSIX tars any webdataset reader can open. Writes go to a hidden temp file renamed on completion, so a
shard is either complete or absent.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from pretrieve.data.remote import ReadError, ReadOptions, fetch

MANIFEST_FORMAT = "pretrieve-shards/1"  # manifest.json's "format"; `pretrieve prepare` writes it
TOKEN_EXTENSIONS = {"ids.u16": np.dtype("<u2"), "ids.i32": np.dtype("<i4")}
_BLOCK = 512


class ShardError(RuntimeError):
    """A shard that cannot be read or does not match its manifest; the message names the file."""


def token_extension(vocab_size: int) -> str:
    return "ids.u16" if vocab_size < 65536 else "ids.i32"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class ShardStats:
    file: str
    num_samples: int
    num_tokens: int
    sha256: str
    bytes: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class ShardWriter:
    """Writes one shard; `close()` makes it visible under its final name and returns its stats."""

    def __init__(self, path: str | Path, token_ext: str):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(f".{self.path.name}.tmp")
        self.token_ext = token_ext
        self.dtype = TOKEN_EXTENSIONS[token_ext]
        self._file = open(self.tmp_path, "wb")
        self._hash = hashlib.sha256()
        self._sink = _HashingWriter(self._file, self._hash)
        self._tar = tarfile.open(fileobj=self._sink, mode="w|", format=tarfile.USTAR_FORMAT)
        self.num_samples = 0
        self.num_tokens = 0

    def add(self, ids: np.ndarray, meta: dict) -> None:
        key = f"{self.num_samples:09d}"
        self._add_member(f"{key}.{self.token_ext}", np.asarray(ids, dtype=self.dtype).tobytes())
        self._add_member(f"{key}.json", json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        self.num_samples += 1
        self.num_tokens += len(ids)

    def _add_member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o444  # mtime 0, no owner: the same input gives byte-identical shards
        self._tar.addfile(info, io.BytesIO(data))

    def close(self) -> ShardStats:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp_path, self.path)
        return ShardStats(self.path.name, self.num_samples, self.num_tokens, self._hash.hexdigest(), self.path.stat().st_size)

    def abort(self) -> None:
        self._sink.aborted = True  # the tar stream's finaliser must not write into the closed file
        self._file.close()
        self.tmp_path.unlink(missing_ok=True)


class _HashingWriter:
    def __init__(self, file, digest):
        self.file, self.digest, self.aborted = file, digest, False

    def write(self, data) -> int:
        if self.aborted:
            return len(data)
        self.digest.update(data)
        return self.file.write(data)


def read_shard(location: str | Path, start: int = 0, stop: int | None = None, sha256: str | None = None,
               num_samples: int | None = None, size: int | None = None,
               options: ReadOptions | None = None) -> Iterator[tuple[np.ndarray, dict]]:
    """(token ids, metadata) of samples [start, stop) of a shard at a local path or URL (data/remote.py), in order.

    With `sha256`, the whole file is verified before anything is yielded; with `num_samples`, a shard holding
    fewer samples than the manifest says is an error.
    """
    data = load_shard(location, sha256, size, options)
    yield from parse_shard(data, location, start, stop, num_samples)


def load_shard(location: str | Path, sha256: str | None = None, size: int | None = None,
               options: ReadOptions | None = None, cancel: threading.Event | None = None):
    """The bytes of a shard (bytes, bytearray or a read-only mmap), verified against `sha256` when given.

    The digest is computed while the bytes arrive and checked once all of them are in, so a corrupted shard
    fails here, before `parse_shard` turns any of it into a sample (verify-then-yield). With `size` (the
    manifest's `bytes`), a shard of another length is reported as truncated or grown, which says more than
    its digest would.
    """
    try:
        data, digest = fetch(str(location), size, options, cancel, digest=sha256 is not None)
    except ReadError as e:
        raise ShardError(str(e)) from e  # it names the location, the range, the attempts and the last error
    if size is not None and len(data) != size:
        raise ShardError(f"{location}: {length_mismatch(len(data), size)}. Copy it again, or re-run "
                         "`pretrieve prepare` into a fresh directory.")
    if sha256 is not None and digest != sha256:
        raise ShardError(f"{location}: sha256 differs from the manifest ({len(data):,} bytes read); the shard is "
                         "corrupted or was replaced. Re-run `pretrieve prepare` into a fresh directory.")
    return data


def length_mismatch(length: int, expected: int) -> str:
    """A file of `length` bytes where the manifest records `expected`, in words."""
    if length < expected:
        return f"truncated: {length:,} of the {expected:,} bytes the manifest records"
    return f"{length:,} bytes, {length - expected:,} more than the {expected:,} the manifest records (replaced?)"


def parse_shard(data, location: str | Path, start: int = 0, stop: int | None = None,
                num_samples: int | None = None) -> Iterator[tuple[np.ndarray, dict]]:
    """Samples [start, stop) of a loaded shard. Parsing reads the 512-byte ustar headers directly (our
    writer's format) instead of going through `tarfile`: it is the stream's hot loop."""
    index = 0
    for key, ids_bytes, ext, meta_bytes in _samples(data, location):
        if stop is not None and index >= stop:
            return
        if index >= start:
            try:
                meta = json.loads(meta_bytes)
            except ValueError as e:
                raise ShardError(f"{location}: sample {key}: bad JSON ({e})") from e
            yield np.frombuffer(ids_bytes, dtype=TOKEN_EXTENSIONS[ext]), meta
        index += 1
    expected = num_samples if stop is None else stop
    if expected is not None and index < expected:
        raise ShardError(f"{location}: holds {index} samples, expected {expected}; the shard is truncated")


def _samples(data, path: str | Path) -> Iterator[tuple[str, bytes, str, bytes]]:
    view = memoryview(data).toreadonly()  # token arrays are views: nobody may write into a shard's bytes
    pos, end = 0, len(data)
    pending: dict[str, tuple[str, bytes]] = {}
    current_key = None
    while pos + _BLOCK <= end:
        header = data[pos:pos + _BLOCK]
        if header[0] == 0:  # end-of-archive marker
            break
        if header[257:262] != b"ustar":
            raise ShardError(f"{path}: corrupted tar header at byte {pos}")
        name = header[:100].split(b"\0", 1)[0].decode("utf-8")
        try:
            size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
        except ValueError:
            raise ShardError(f"{path}: corrupted tar header at byte {pos}") from None
        body = pos + _BLOCK
        if body + size > end:
            raise ShardError(f"{path}: member {name} runs past the end of the file; the shard is truncated")
        pos = body + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        key, _, ext = name.partition(".")
        if key != current_key:
            current_key, pending = key, {}
        pending[ext] = view[body:body + size]
        if len(pending) == 2:
            token_ext = "ids.u16" if "ids.u16" in pending else "ids.i32"
            if token_ext not in pending or "json" not in pending:
                raise ShardError(f"{path}: sample {key} has members {sorted(pending)}, expected ids + json")
            yield key, pending[token_ext], token_ext, bytes(pending["json"])
    else:
        raise ShardError(f"{path}: no end-of-archive marker; the shard is truncated")
