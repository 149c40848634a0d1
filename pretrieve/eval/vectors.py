"""Corpus vectors as shards: written by `pretrieve encode` while the corpus streams past, read memory-mapped.

FOLDER/corpus-NNNNN.npy ([n, d], float32 or float16 as asked) + FOLDER/corpus-NNNNN.ids (one document id per
line): shard N holds documents N * shard_size .. (N + 1) * shard_size - 1 of the corpus in file order
(data.retrieval.stream_corpus). Each file is written under a temporary name and renamed, the ids last, so a
shard with its .ids is complete. FOLDER/encode.json records what determines the vectors (model, pooling,
max_length, normalize) and the shard size and dtype; encoding into a folder made otherwise is an error.

Memory while encoding: one window of tokens (eval.encode) and one shard's vectors, never the corpus; worker i of
n encodes every n-th shard and reads past the others without tokenizing them. Texts are encoded per shard (the
windows restart at each shard), so the in-memory encoding of `eval` and `mine` (`encode_corpus`, the default
shard size) gives `pretrieve encode`'s vectors at that shard size bit for bit.

Reading (`open_corpus_vectors`) maps each shard with np.load(mmap_mode="r"), checks that the shards' ids are
the corpus's, in order, and copies nothing: search reads the shards block by block (eval.search), and a
document's vector is fetched by its row when asked for (contrastive entropy).
"""

from __future__ import annotations

import json
import os
import re
from itertools import chain, count, islice
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from pretrieve.utils.output_folder import check_own_entries
from pretrieve.utils.run_dir import record_settings, write_atomic

DEFAULT_SHARD_SIZE = 100_000
DTYPES = ("float32", "float16")


class ShardedVectors:
    """Corpus vectors as consecutive [n_i, d] parts (memory-mapped shards, or arrays in memory) addressed by
    global row, part after part; `ids[row]` is the row's document."""

    def __init__(self, parts: list[np.ndarray], ids: list[str]):
        self.parts, self.ids = parts, ids
        self.starts = np.cumsum([0, *(len(p) for p in parts)])
        self.dim = parts[0].shape[1] if parts else 0
        if self.starts[-1] != len(ids):
            raise ValueError(f"{len(ids)} ids for {self.starts[-1]} vectors")

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, rows) -> np.ndarray:
        """float32 [len(rows), d] vectors of those global rows (eval.search.pair_scorer reads documents so)."""
        rows = np.asarray(rows, dtype=np.int64)
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        out = np.empty((len(rows), self.dim), dtype=np.float32)
        for part in np.unique(part_of):
            chosen = part_of == part
            out[chosen] = self.parts[part][rows[chosen] - self.starts[part]]
        return out

    def blocks(self, rows: int, dtype=np.float32) -> Iterator[tuple[int, np.ndarray]]:
        """(global row of its first vector, a `dtype` copy) of at most `rows` consecutive vectors, in row order."""
        for start, part in zip(self.starts, self.parts):
            for first in range(0, len(part), rows):
                yield int(start) + first, np.ascontiguousarray(part[first:first + rows], dtype=dtype)


def encode_shards(encoder, documents: Iterable[tuple[str, str]], shard_size: int,
                  wanted: Callable[[int], bool] = lambda number: True, progress: bool = True,
                  total: int | None = None) -> Iterator[tuple[int, list[str], np.ndarray | None]]:
    """(shard number, ids, float32 vectors) of each shard of the (id, text) stream, read once; vectors None for
    a shard `wanted(number)` says not to encode (its texts are read past, not tokenized). `total`: the corpus's
    documents where known, for each shard's progress line (unknown, it counts without a total)."""
    if shard_size < 1:
        raise ValueError(f"shard_size: must be >= 1, got {shard_size}")
    stream = iter(documents)
    for number in count():
        first = next(stream, None)
        if first is None:
            return
        ids: list[str] = []
        texts = _texts_noting_ids(chain([first], islice(stream, shard_size - 1)), ids)
        if not wanted(number):
            for _ in texts:
                pass
            yield number, ids, None
            continue
        vectors = np.empty((shard_size, encoder.dim), dtype=np.float32)  # pages past the last document stay unused
        in_shard = None if total is None else max(0, min(shard_size, total - number * shard_size))
        for rows, block in encoder.vectors(texts, desc=f"encode shard {number}", progress=progress,
                                           total=in_shard):
            vectors[rows] = block
        yield number, ids, vectors[:len(ids)]


def _texts_noting_ids(documents: Iterable[tuple[str, str]], ids: list[str]) -> Iterator[str]:
    for doc_id, text in documents:
        ids.append(doc_id)
        yield text


def encode_corpus(encoder, documents: Iterable[tuple[str, str]], progress: bool = True,
                  total: int | None = None) -> ShardedVectors:
    """The corpus's vectors in memory, encoded as `pretrieve encode` does at the default shard size (`total`: the
    number of documents, when known, for the progress line)."""
    parts, ids = [], []
    for _, shard_ids, vectors in encode_shards(encoder, documents, DEFAULT_SHARD_SIZE, progress=progress,
                                               total=total):
        parts.append(vectors)
        ids.extend(shard_ids)
    return ShardedVectors(parts, ids)


def encode_corpus_shards(encoder, documents: Iterable[tuple[str, str]], out: str | Path,
                         shard_size: int = DEFAULT_SHARD_SIZE, worker: int = 0, workers: int = 1,
                         dtype: str = "float32", progress: bool = True) -> tuple[list[Path], int]:
    """Encode the (id, text) stream into OUT as shards (the module docstring). Worker `worker` of `workers`
    (processes or GPUs sharing OUT) takes every `workers`-th shard; shards already complete are skipped, so a
    killed encoding continues where it stopped. Returns this worker's shards and the corpus's document count."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker {worker} is not in 0..{workers - 1}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(out)
    check_own_entries(out, "pretrieve encode", _encode_writes)
    out.mkdir(parents=True, exist_ok=True)
    record_settings(out / "encode.json", {**encoder.settings(), "shard_size": shard_size, "dtype": dtype}, "vectors")

    def stem(number: int) -> Path:
        return out / f"corpus-{number:05d}"

    def wanted(number: int) -> bool:
        return number % workers == worker and not stem(number).with_suffix(".ids").is_file()

    mine, documents_seen = [], 0
    for number, ids, vectors in encode_shards(encoder, documents, shard_size, wanted, progress):
        documents_seen += len(ids)
        if number % workers == worker:
            mine.append(stem(number))
        if vectors is not None:
            tmp = stem(number).with_name(f".{stem(number).name}.npy.tmp")
            with open(tmp, "wb") as f:
                np.save(f, vectors.astype(dtype, copy=False))
            os.replace(tmp, stem(number).with_suffix(".npy"))
            write_atomic(stem(number).with_suffix(".ids"), "".join(f"{d}\n" for d in ids))
    return mine, documents_seen


def _encode_writes(name: str) -> bool:
    """The names `encode_corpus_shards` gives its files, and their temporary names while being written."""
    return re.fullmatch(r"encode\.json|\.encode\.json\.\d+\.tmp|\.?corpus-\d{5,}\.(npy|ids)(\.tmp)?", name) is not None


def open_corpus_vectors(folder: str | Path, settings: dict, doc_ids: list[str] | None = None) -> ShardedVectors:
    """FOLDER's shards, memory-mapped, checked against the encoder `settings` the caller encodes queries with
    and, given `doc_ids`, against the corpus (the same documents in the same order); errors name what is
    missing or different."""
    folder = Path(folder)
    record = folder / "encode.json"
    if not record.is_file():
        raise ValueError(f"{record}: not found; write the vectors with `pretrieve encode`")
    made = json.loads(record.read_text())
    if {k: made.get(k) for k in settings} != settings:
        raise ValueError(f"{record}: vectors made with {made}, but this run encodes with {settings}")
    parts, ids = [], []
    for number, ids_file in enumerate(sorted(folder.glob("corpus-*.ids"))):
        if ids_file.name != f"corpus-{number:05d}.ids":
            raise ValueError(f"{folder}: shard corpus-{number:05d} is missing (found {ids_file.name}); run "
                             "`pretrieve encode` again to finish it")
        shard_ids = ids_file.read_text().splitlines()
        vectors = np.load(ids_file.with_suffix(".npy"), mmap_mode="r")
        if vectors.ndim != 2 or len(vectors) != len(shard_ids) or (parts and vectors.shape[1] != parts[0].shape[1]):
            raise ValueError(f"{ids_file}: {len(shard_ids)} ids for vectors of shape {vectors.shape}")
        parts.append(vectors)
        ids.extend(shard_ids)
    if doc_ids is not None:
        check_same_documents(folder, ids, doc_ids)
        ids = doc_ids  # equal: one list of 8.8M ids, not two
    return ShardedVectors(parts, ids)


def check_same_documents(where: str | Path, ids: list[str], doc_ids: list[str]) -> None:
    """Vectors' ids row by row against the corpus's: the same documents in the same order."""
    if ids == doc_ids:
        return
    row = next((i for i, (a, b) in enumerate(zip(ids, doc_ids)) if a != b), min(len(ids), len(doc_ids)))
    if row == len(ids):
        raise ValueError(f"{where}: vectors for {len(ids)} of the corpus's {len(doc_ids)} documents (the next is "
                         f"{doc_ids[row]}); run `pretrieve encode` for the missing shards")
    found = ids[row]
    raise ValueError(f"{where}: row {row} holds document {found}, where the corpus has "
                     f"{doc_ids[row] if row < len(doc_ids) else 'no more documents'}: vectors of another corpus")
