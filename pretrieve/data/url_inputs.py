"""Raw input files at URLs (`prepare --input hf://datasets/OWNER/NAME/PATH`, `https://`, `s3://`, `gs://`):
listed, sized and opened through fsspec, the same as remote shards (remote.py). `hf://` is the Hugging Face
Hub's file system (huggingface_hub's HfFileSystem): a dataset's parquet files, read in ranged requests, so
that a resumed `prepare` starts at the row group of its row, as from a local file.

A URL is a file, a glob pattern (`hf://datasets/wikimedia/wikipedia/20231101.en/train-*.parquet`) or a folder,
of which the files matching the source's patterns are read, sorted. Without a network the Hub is not reached:
listing fails at once (with `HF_HUB_OFFLINE=1` too), with an error naming the URL.
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass
from urllib.parse import urlsplit

from pretrieve.data import remote


class UrlInputError(ValueError):
    """An input URL that cannot be listed or read; the message names it."""


@dataclass(frozen=True)
class UrlFile:
    """An input file at a URL, in place of a `Path`: its `name`, `suffix`, size in bytes and `open()`."""
    url: str
    bytes: int

    @property
    def name(self) -> str:
        return posixpath.basename(urlsplit(self.url).path)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    def __str__(self) -> str:
        return self.url

    def open(self):
        """A seekable binary file: reads and seeks are ranged requests."""
        fs, path = remote.filesystem(self.url, remote.ReadOptions())
        return fs.open(path, "rb")


def list_url_files(url: str, patterns: tuple[str, ...]) -> list[UrlFile]:
    """The files `url` names: itself, its glob's matches or a folder's files matching `patterns`, sorted."""
    try:
        fs, path = remote.filesystem(url, remote.ReadOptions())
        if any(c in path for c in "*?["):
            found = sorted(fs.glob(path, detail=True).items())
        else:
            info = fs.info(path)
            found = [(path, info)] if info["type"] != "directory" else sorted(
                (p, i) for p, i in fs.find(path, detail=True).items()
                if any(fnmatch.fnmatch(posixpath.basename(p), pattern) for pattern in patterns))
    except FileNotFoundError as e:
        raise UrlInputError(f"input not found: {url}") from e
    except Exception as e:  # each backend raises its own errors (no network, no credentials, offline mode)
        raise UrlInputError(f"{url}: cannot list ({type(e).__name__}: {e}); without a network, read the "
                            "input on a machine that has one (a login node) into shards") from e
    files = [UrlFile(fs.unstrip_protocol(p), int(i.get("size") or 0)) for p, i in found if i["type"] != "directory"]
    if not files:
        raise UrlInputError(f"{url}: no files there ({' '.join(patterns)})")
    return files
