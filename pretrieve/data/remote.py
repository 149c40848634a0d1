"""Shard and manifest locations (docs/design.md, "Shard locations"): open them, read them whole with their sha256,
retry what a network breaks, and upload files to them.

What opens what:
- a local path or a `file://` URL: the file itself, read in one call (the stream's fast path, no retries);
- `pipe:CMD`: webdataset's `Pipe` runs CMD in a shell and its stdout is the file (webdataset's convention,
  e.g. `pipe:aws s3 cp s3://bucket/x.tar -`); a pipe cannot seek, so a retry runs the command again;
- any other `scheme://` URL: fsspec's filesystem for the scheme (`http(s)://` through aiohttp; `s3://` and
  `gs://` through the optional s3fs / gcsfs: `pip install pretrieve[s3]`, `[gcs]`), read in ranged requests of
  `block_size` bytes, so a request that fails is retried from its own first byte (HTTP Range), not from the
  start of the file. Per-scheme fsspec options come from `storage_options` (e.g. {"s3": {"anon": True}}),
  else from fsspec's own configuration and the backend's environment (AWS_*, GOOGLE_*).

Faults: a request that fails for a reason retrying can fix (connection reset, 5xx, 408/429, a timeout of
`timeout` seconds, a body cut short) is retried after an exponential backoff with jitter; `retries` bounds the
failures in a row without progress. Other errors (404, 403, other 4xx, a bad URL) fail at once. Either way the
error names the URL, the byte range, the attempts and the last error. Backends may retry inside one of our
attempts (botocore does); `timeout` bounds each attempt all the same.

A download lands in memory up to `memory_limit` bytes and beyond that in an unlinked local temp file (under
TMPDIR), mapped when complete: verifying a shard before any of it is used needs no memory for its size.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import posixpath
import random
import re
import select
import signal
import tempfile
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import numpy as np

T = TypeVar("T")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_PIPE_READ = 1 << 16  # a pipe hands over at most its buffer (64 KiB on Linux) per read


@dataclass
class ReadOptions:
    """How shards are fetched; `ShardStream(read=...)`. `from_options` takes the same-named `data.*` keys."""

    retries: int = 5  # failed requests in a row (no progress between them) retried before giving up
    timeout: float = 60.0  # seconds one request (one block) may take before it counts as failed
    backoff: float = 0.5  # the first retry waits 0.25-0.5 s; each further failure in a row doubles it
    backoff_max: float = 30.0
    block_size: int = 8 << 20  # bytes per ranged request
    memory_limit: int = 512 << 20  # a download larger than this spills to a local temp file
    prefetch_shards: int = 1  # shards each reader loads ahead in background threads (0: load when needed)
    storage_options: dict = field(default_factory=dict)  # per URL scheme: keyword arguments for fsspec

    def __post_init__(self):
        if self.retries < 0 or self.prefetch_shards < 0:
            raise ValueError(f"retries and prefetch_shards must be >= 0 (got {self.retries}, {self.prefetch_shards})")
        if self.timeout <= 0 or self.block_size <= 0:
            raise ValueError(f"timeout and block_size must be positive (got {self.timeout}, {self.block_size})")

    @classmethod
    def from_options(cls, options) -> "ReadOptions":
        """The fields found on `options` (e.g. the config's DataOptions); defaults for the others."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls) if hasattr(options, f.name)})


class ReadError(OSError):
    """A location that could not be read; the message names it, what was being read, attempts, last error."""


class NotFound(ReadError, FileNotFoundError):
    pass


class Cancelled(Exception):
    """A background read given up by its reader (the stream moved on or closed)."""


# --- locations --------------------------------------------------------------------------------------------
def scheme(location: str | os.PathLike) -> str | None:
    """"pipe", the URL scheme in lower case, or None for a local path."""
    text = os.fspath(location)
    if text.startswith("pipe:"):
        return "pipe"
    match = _SCHEME.match(text)
    return match.group(1).lower() if match else None


def local_path(location: str | os.PathLike) -> str | None:
    """The file system path of a local path or `file://` URL; None for anything remote."""
    kind = scheme(location)
    if kind is None:
        return os.fspath(location)
    return unquote(urlsplit(os.fspath(location)).path) if kind == "file" else None


def is_remote(location: str | os.PathLike) -> bool:
    return local_path(location) is None


def resolve(base: str, name: str) -> str:
    """The location of `name`, an entry of the file at `base`: URLs and absolute paths as they are, relative
    names against the folder of `base`, local or remote (docs/design.md: shard names resolve against the manifest)."""
    if scheme(name) or os.path.isabs(name):
        return name
    kind = scheme(base)
    if kind is None:
        return str(Path(base).parent / name)
    if kind == "pipe":
        raise ValueError(f"{base}: a manifest read through pipe: has no folder; name its shards with absolute "
                         f"paths or URLs, not {name!r}")
    parts = urlsplit(base)  # the query (e.g. a signature) belongs to the manifest, not to its shards
    path = posixpath.normpath(posixpath.join(posixpath.dirname(parts.path), name))
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def child(folder: str, name: str) -> str:
    """`name` inside `folder`, a local path or URL."""
    return resolve(folder.rstrip("/") + "/", name) if scheme(folder) else str(Path(folder) / name)


# --- reading ----------------------------------------------------------------------------------------------
def fetch(location: str, size: int | None = None, options: ReadOptions | None = None,
          cancel: threading.Event | None = None, digest: bool = True) -> tuple[bytes | bytearray | mmap.mmap, str | None]:
    """The whole content at `location` and its sha256 hex digest (None unless `digest`).

    `size`, when known (the manifest's `bytes`), saves asking a remote backend for it. Raises ReadError
    (NotFound when it does not exist), or Cancelled once `cancel` is set.
    """
    options = options or ReadOptions()
    cancel = cancel or threading.Event()
    path = local_path(location)
    if path is not None:
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError as e:
            raise NotFound(f"{location}: not found ({e})") from e
        except OSError as e:
            raise ReadError(f"{location}: cannot read ({e})") from e
        return data, hashlib.sha256(data).hexdigest() if digest else None
    attempts = Attempts(location, options, cancel)
    if scheme(location) == "pipe":
        return attempts.call(lambda: _read_pipe(location, size, options, cancel), "reading the command's output")
    return _read_ranges(location, size, options, attempts)


def size_of(location: str, options: ReadOptions | None = None) -> int | None:
    """The size in bytes of the file at `location` (one stat, or one request with retries); None for `pipe:`,
    whose output has no size until it is read."""
    options = options or ReadOptions()
    path = local_path(location)
    if path is not None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError as e:
            raise NotFound(f"{location}: not found ({e})") from e
        except OSError as e:
            raise ReadError(f"{location}: cannot read ({e})") from e
    if scheme(location) == "pipe":
        return None
    fs, fs_path = filesystem(location, options)
    return Attempts(location, options, threading.Event()).call(
        lambda: _call(fs, "size", fs_path, timeout=options.timeout), "reading its size")


def _read_ranges(location: str, size: int | None, options: ReadOptions, attempts: "Attempts"):
    fs, path = filesystem(location, options)
    if size is None:
        size = attempts.call(lambda: _call(fs, "size", path, timeout=options.timeout), "reading its size")
    spool, digest, pos = None, hashlib.sha256(), 0
    while pos < size:
        end = min(pos + options.block_size, size)
        chunk = attempts.call(lambda: _call(fs, "cat_file", path, start=pos, end=end, timeout=options.timeout),
                              f"reading bytes {pos}-{end - 1} of {size}")
        digest.update(chunk)
        if pos == 0 and len(chunk) == size <= options.memory_limit:  # all in one answer (or Range ignored)
            return chunk, digest.hexdigest()  # no copy
        if len(chunk) < end - pos:  # the file ends early: a Range past its end gets what there is
            raise ReadError(f"{location}: truncated: it ends at byte {pos + len(chunk):,}, before the {size:,} bytes "
                            "expected")
        if len(chunk) != end - pos:
            raise ReadError(f"{location}: bytes {pos}-{end - 1}: got {len(chunk):,} bytes, more than asked for (the "
                            f"file is longer than the {size:,} bytes expected, or the server ignores Range)")
        spool = spool or _Spool(size, options.memory_limit)
        spool.write(chunk)
        pos = end
    return (spool.buffer() if spool else b""), digest.hexdigest()


def _read_pipe(location: str, size: int | None, options: ReadOptions, cancel: threading.Event):
    from webdataset.gopen import Pipe

    spool, digest = _Spool(size, options.memory_limit), hashlib.sha256()
    # as webdataset's gopen("pipe:...") does (exit 141, SIGPIPE, is fine), in a process group of its own so a
    # stalled command is killed with its children; unbuffered, so select() on the descriptor sees every byte
    pipe = Pipe(location[len("pipe:"):], mode="rb", shell=True, bufsize=0, ignore_status=[141],
                start_new_session=True)
    try:
        fd = pipe.stream.fileno()
        while True:
            if not select.select([fd], [], [], options.timeout)[0]:
                raise TimeoutError(f"no output for {options.timeout} s")
            if cancel.is_set():
                raise Cancelled(location)
            chunk = os.read(fd, _PIPE_READ)
            if not chunk:
                break
            digest.update(chunk)
            spool.write(chunk)
    except BaseException:
        os.killpg(pipe.proc.pid, signal.SIGKILL)
        pipe.proc.wait()
        pipe.stream.close()
        raise
    pipe.close()  # raises OSError naming the command when it exited non-zero
    return spool.buffer(), digest.hexdigest()


# (pid, scheme, options) -> fsspec filesystem. Our own cache, not fsspec's: fsspec drops its instances in a forked
# child (a DataLoader worker), whose finalizers then wait 1 s each to close their sessions on the parent's event
# loop, which no thread runs there. Entries of the parent stay referenced here, so that never happens.
_FILESYSTEMS: dict[tuple, object] = {}


def filesystem(location: str, options: ReadOptions):
    """(fsspec filesystem, path) for a URL, one filesystem per scheme, options and process."""
    import fsspec

    kind = scheme(location)
    kwargs = options.storage_options.get(kind, {})
    key = (os.getpid(), kind, repr(sorted({**fsspec.config.conf.get(kind, {}), **kwargs}.items())))
    if key not in _FILESYSTEMS:
        try:
            _FILESYSTEMS[key] = fsspec.filesystem(kind, skip_instance_cache=True, **kwargs)
        except (ImportError, ValueError) as e:  # unknown scheme, or its package missing
            raise ReadError(f"{location}: no backend for {kind}:// ({e}); s3:// and gs:// need "
                            "`pip install pretrieve[s3]` / `pretrieve[gcs]`") from e
    fs = _FILESYSTEMS[key]
    return fs, fs._strip_protocol(location)


def _call(fs, method: str, *args, timeout: float, **kwargs):
    """`fs.method(...)`; on an async backend (http, s3, gs) cancelled after `timeout` seconds."""
    from fsspec.asyn import AsyncFileSystem, sync

    if isinstance(fs, AsyncFileSystem) and not fs.asynchronous:
        try:
            return sync(fs.loop, getattr(fs, f"_{method}"), *args, timeout=timeout, **kwargs)
        except TimeoutError as e:  # fsspec's FSTimeoutError says nothing
            raise TimeoutError(f"no answer within {timeout} s") from e
    return getattr(fs, method)(*args, **kwargs)  # a blocking backend applies its own timeouts


class _Spool:
    """One download's bytes: in memory up to `limit`, then in an unlinked temp file, mapped when complete."""

    def __init__(self, size: int | None, limit: int):
        self.limit, self.length, self.file = limit, 0, None
        self.preallocated = size is not None and size <= limit  # the usual case: one allocation, no copies
        self.memory = bytearray(size if self.preallocated else 0)

    def write(self, chunk: bytes) -> None:
        if self.file is None and self.length + len(chunk) > self.limit:
            self.file = tempfile.TemporaryFile(prefix="pretrieve-shard-")
            self.file.write(memoryview(self.memory)[:self.length])
            self.memory = None
        if self.file is not None:
            self.file.write(chunk)
        elif self.preallocated:  # numpy copies without the GIL: the consumer's parsing goes on meanwhile
            np.frombuffer(self.memory, np.uint8, len(chunk), self.length)[:] = np.frombuffer(chunk, np.uint8)
        else:
            self.memory += chunk
        self.length += len(chunk)

    def buffer(self) -> bytearray | mmap.mmap | bytes:
        if self.file is None:
            del self.memory[self.length:]  # a shorter file than announced; its digest will tell
            return self.memory
        self.file.flush()
        mapped = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if self.length else b""
        self.file.close()  # the mapping keeps the (unlinked) data until the last sample view is gone
        return mapped


# --- faults -------------------------------------------------------------------------------------------------
_PERMANENT = (ReadError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
              TypeError, KeyError, AttributeError, NotImplementedError, Cancelled)


def transient(error: BaseException) -> bool:
    """Whether trying again may succeed: HTTP 5xx / 408 / 425 / 429 and network errors, not 4xx or bad input."""
    status = getattr(error, "status", None)
    if isinstance(status, int) and 400 <= status < 600:
        return status >= 500 or status in (408, 425, 429)
    return isinstance(error, Exception) and not isinstance(error, _PERMANENT)


class Attempts:
    """Calls against one location, retried with exponential backoff and jitter while failures are transient;
    `options.retries` bounds the failures in a row (a success resets the count)."""

    def __init__(self, location: str, options: ReadOptions, cancel: threading.Event):
        self.location, self.options, self.cancel = location, options, cancel
        self.failures = 0  # in a row
        self.random = random.Random()  # jitter differs between processes so retries do not come in waves

    def call(self, fn: Callable[[], T], what: str) -> T:
        while True:
            if self.cancel.is_set():
                raise Cancelled(self.location)
            try:
                result = fn()
            except Exception as e:
                self._failed(e, what)
            else:
                self.failures = 0
                return result

    def _failed(self, error: Exception, what: str) -> None:
        last = f"{type(error).__name__}: {error}"
        if isinstance(error, (ReadError, Cancelled)):
            raise error
        if not transient(error):
            kind = NotFound if isinstance(error, FileNotFoundError) else ReadError
            raise kind(f"{self.location}: {what} failed with {last} (not retried: trying again cannot fix "
                       "it)") from error
        if self.failures >= self.options.retries:
            raise ReadError(f"{self.location}: {what} failed {self.failures + 1} times in a row "
                            f"(data.retries={self.options.retries}, data.timeout={self.options.timeout} s); last "
                            f"error: {last}. Check the URL and the network, or raise data.retries / data.timeout."
                            ) from error
        self.failures += 1
        ceiling = min(self.options.backoff_max, self.options.backoff * 2 ** (self.failures - 1))
        if self.cancel.wait(ceiling * self.random.uniform(0.5, 1.0)):
            raise Cancelled(self.location)


# --- writing ------------------------------------------------------------------------------------------------
def upload(local: str | os.PathLike, location: str, options: ReadOptions | None = None) -> None:
    """Copy a local file to `location` (retried as reads are). Object stores (s3, gs) make an object visible
    whole or not at all; callers that need that everywhere upload to a temporary name and `move` it."""
    options = options or ReadOptions()
    fs, path = filesystem(location, options)
    Attempts(location, options, threading.Event()).call(lambda: fs.put_file(os.fspath(local), path), "uploading")


def move(source: str, target: str, options: ReadOptions | None = None) -> None:
    options = options or ReadOptions()
    fs, path = filesystem(source, options)
    _, target_path = filesystem(target, options)
    Attempts(target, options, threading.Event()).call(lambda: fs.mv(path, target_path), f"moving {source} here")


def remove(location: str, options: ReadOptions | None = None) -> None:
    """Delete `location` if it exists."""
    options = options or ReadOptions()
    fs, path = filesystem(location, options)
    try:
        Attempts(location, options, threading.Event()).call(lambda: fs.rm_file(path), "deleting")
    except NotFound:
        pass
