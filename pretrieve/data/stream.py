"""The training stream: a weighted, shuffled, rank/worker-split mixture of prepared shards, resumable exactly.

`ShardStream` is an IterableDataset over manifests; `StreamLoader` is the DataLoader to drive it with.

    stream = ShardStream(["wiki/manifest.json", "books/manifest.json"], weights=[0.75, 0.25], seed=0)
    loader = StreamLoader(stream, batch_size=32, num_workers=2, collate_fn=collate)
    for epoch in range(epochs):
        for batch in loader:         # the rest of the current epoch
            ...
            checkpoint["data"] = stream.state_dict()
    # later, in a fresh process: stream.load_state_dict(checkpoint["data"]) and iterate on

What is read where comes from `EpochPlan` (epoch_plan.py). Each (rank, worker) slot reads its contiguous
share of shard pieces sequentially and shuffles it in windows of `shuffle_buffer` samples, each window in
an order drawn from (seed, epoch, stage, rank, slot, window). Because the order is a pure function of the
position, a position is all the state there is: per worker slot, the number of samples consumed. The main
process knows it without asking the workers: `StreamLoader` replays the DataLoader's round-robin over worker
batches (the DataLoader returns worker batches in index order, skipping exhausted workers). On resume the
worker that must produce the next batch becomes worker 0 (`rotation`), so batches N+1, N+2, ... match the
uninterrupted run. With a different world size or worker count ("elastic"), the samples the old layout had
not yet consumed are recomputed and spread over the new one: no sample of the epoch is lost or repeated,
apart from the flagged `pad` samples that equalise ranks.

Samples are dicts: `ids` (np.ndarray of token ids, no special tokens), `doc`, `block`, `source`, `pad`,
and `shard` / `index` (the sample's address, handy for tests and debugging). The loader keeps where its last batch
came from (`stream.last_batch`: a slot and offset, no sample), which `describe_batch` turns into the shards and
samples it held, read again: a health alarm names them (engine/health.py). Pair manifests (`"kind": "pairs"`,
`prepare --pairs`) give pair samples instead of `ids` and `block`: `query`, `pos` (token ids, no special tokens)
and `negs` (a list of them, maybe empty), with `pair` (how it was made); one stream reads one kind.

One-source batches (`one_source_batches=True, batch_size=B`): every run of B samples a slot yields, counted
from the start of the epoch, comes from one manifest (one source), as nomic-embed and GTE batch their pairs so
that in-batch negatives are not off-topic by their source alone. Which manifest each batch comes from is drawn
per slot from (seed, epoch, rank, slot) (epoch_plan.py), so positions are still sample counts and a resume is
exact; a mid-epoch resume must keep the world size and worker count.

Manifests and shards may be local paths or URLs (data/remote.py says what opens what; `read` sets retries,
timeouts and prefetching). Each reader loads its next `read.prefetch_shards` shards in the background
(data/prefetch.py). A shard is verified against its sha256 before any of its samples is yielded: a corrupted
or unreadable shard is an error naming it and the sample of it where the stream stopped, and no sample of it
reaches a batch. Positions are sample offsets, so where the bytes come from does not enter the state: a run
resumes exactly over HTTP as from local files, and even from one to the other.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
from contextlib import closing
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pretrieve.data.epoch_plan import EpochPlan, Segment, drop, total
from pretrieve.data.pairs import split_pair
from pretrieve.data.prefetch import prefetched
from pretrieve.data.remote import NotFound, ReadError, ReadOptions, fetch, local_path, resolve, scheme
from pretrieve.data.shards import MANIFEST_FORMAT, ShardError, load_shard, parse_shard
from pretrieve.data.tokenizer import TokenizerInfo, describe, in_words
from pretrieve.utils.stop_signals import STOP_SIGNALS

STATE_FORMAT = "pretrieve-stream/1"


class StreamError(ValueError):
    pass


@dataclass(frozen=True)
class ShardRef:
    location: str  # local path or URL
    num_samples: int
    sha256: str
    bytes: int | None  # the file's size, when the manifest has it (remote reads then skip asking for it)


def manifest_location(location: str | os.PathLike) -> str:
    """A manifest file's location: a folder (local, or a URL whose last part is not *.json) gets manifest.json."""
    path = local_path(location)
    if path is not None and scheme(location) is None:
        return str(Path(path) / "manifest.json" if Path(path).is_dir() else Path(path))
    text = os.fspath(location)
    if scheme(text) == "pipe" or text.rsplit("/", 1)[-1].endswith(".json"):
        return text
    return text.rstrip("/") + "/manifest.json"


def load_manifest(location: str | os.PathLike, read: ReadOptions | None = None) -> tuple[str, dict]:
    """(the manifest's location, its validated content)."""
    path = manifest_location(location)
    try:
        data, _ = fetch(path, options=read, digest=False)
        manifest = json.loads(bytes(data).decode("utf-8"))
    except NotFound:
        raise StreamError(f"manifest not found: {path} (run `pretrieve prepare` first)") from None
    except ReadError as e:
        raise StreamError(f"cannot read the manifest: {e}") from e
    except ValueError as e:
        raise StreamError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise StreamError(f"{path}: not a pretrieve manifest (a JSON object is expected)")
    for key in ("format", "shards", "tokenizer", "num_samples"):
        if key not in manifest:
            raise StreamError(f"{path}: not a pretrieve manifest (missing key {key!r})")
    if manifest["format"] != MANIFEST_FORMAT:
        raise StreamError(f"{path}: format {manifest['format']!r}; this version reads {MANIFEST_FORMAT!r}")
    if not isinstance(manifest["tokenizer"], dict) or "fingerprint" not in manifest["tokenizer"]:
        raise StreamError(f"{path}: tokenizer: no fingerprint")
    if not isinstance(manifest["shards"], list):
        raise StreamError(f"{path}: shards: a list is expected")
    for i, shard in enumerate(manifest["shards"]):
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and isinstance(shard.get("sha256"), str)
                and isinstance(shard.get("num_samples"), int) and shard["num_samples"] >= 0):
            raise StreamError(f"{path}: shards[{i}]: needs file, sha256 and num_samples >= 0")
    return path, manifest


@dataclass(frozen=True)
class BatchOrigin:
    """Where a batch came from: `count` samples of `slot` from `offset` on, under the epoch's `stages`."""

    epoch: int
    stages: tuple
    slot: int
    offset: int
    count: int


class ShardStream(IterableDataset):
    def __init__(self, manifests: Sequence[str | os.PathLike], weights: Sequence[float] | None = None, seed: int = 0,
                 shuffle_buffer: int = 1000, rank: int | None = None, world_size: int | None = None,
                 tokenizer: str | TokenizerInfo | None = None, epoch_samples: int | None = None, verify: bool = True,
                 read: ReadOptions | None = None, one_source_batches: bool = False, batch_size: int | None = None):
        """`tokenizer`: the training tokenizer (a directory, a "sha256:..." fingerprint or a TokenizerInfo) the
        shards must match.
        `read`: retries, timeouts, prefetching and fsspec options for remote manifests and shards.
        `one_source_batches`: every `batch_size` samples in a row come from one manifest (module docstring)."""
        self.read = read or ReadOptions()
        if isinstance(manifests, (str, os.PathLike)):
            manifests = [manifests]
        if not manifests:
            raise StreamError("no manifests given")
        self.shards: list[ShardRef] = []
        groups: list[list[int]] = []
        tokenizers, kinds = {}, {}
        for m in manifests:
            location, manifest = load_manifest(m, self.read)
            tokenizers[location] = manifest["tokenizer"]
            kinds.setdefault(manifest.get("kind", "text"), location)
            groups.append([])
            for shard in manifest["shards"]:
                groups[-1].append(len(self.shards))
                try:
                    shard_location = resolve(location, shard["file"])
                except ValueError as e:
                    raise StreamError(str(e)) from None
                self.shards.append(ShardRef(shard_location, shard["num_samples"], shard["sha256"], shard.get("bytes")))
        if len(kinds) > 1:
            raise StreamError(f"one stream reads one kind of sample: {kinds.get('text')} holds text and "
                              f"{kinds.get('pairs')} holds pairs; stream them separately")
        self.kind = next(iter(kinds))
        fingerprints = {location: record["fingerprint"] for location, record in tokenizers.items()}
        if len(set(fingerprints.values())) > 1:
            raise StreamError(f"manifests were prepared with different tokenizers: {fingerprints}")
        self.tokenizer_fingerprint = next(iter(fingerprints.values()))
        if tokenizer is not None:
            self._check_tokenizer(tokenizer, tokenizers)
        if one_source_batches and (batch_size is None or batch_size < 1):
            raise StreamError(f"one_source_batches needs the batch size (batch_size >= 1), got {batch_size}")
        self.one_source_batches, self.batch_size = one_source_batches, batch_size
        self.plan = EpochPlan(groups, [s.num_samples for s in self.shards],
                              list(weights) if weights is not None else None, seed, epoch_samples, shuffle_buffer,
                              unit=batch_size if one_source_batches else 1)
        self.seed = seed
        self.verify = verify
        self.rank, self.world_size = _distributed_position(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise StreamError(f"rank {self.rank} outside world size {self.world_size}")
        self.epoch = 0
        self._stages: list[dict] = []  # this epoch's layouts; all but the last are finished (elastic resume)
        self._rotation = 0  # the slot that produces the next batch; DataLoader worker j reads slot (j + rotation) % k
        self._managed = False  # True while a StreamLoader drives the stream (and in the copies its workers get)
        self.last_batch: BatchOrigin | None = None  # where the loader's last batch came from

    def _check_tokenizer(self, tokenizer: str | TokenizerInfo, recorded: dict) -> None:
        """`tokenizer`: a directory, a "sha256:..." fingerprint or a TokenizerInfo; `recorded`: each manifest's
        `tokenizer` record. A mismatch names the tokenizer of the shards and the training one."""
        if isinstance(tokenizer, TokenizerInfo):
            training = tokenizer.as_dict()
        elif str(tokenizer).startswith("sha256:"):
            training = {"fingerprint": str(tokenizer)}
        else:
            training = describe(tokenizer).as_dict()
        wrong = [p for p, record in recorded.items() if record["fingerprint"] != training["fingerprint"]]
        if wrong:
            raise StreamError(f"{', '.join(wrong)}: shards were tokenized with another vocabulary than the training "
                              f"tokenizer: prepared with {in_words(recorded[wrong[0]])}, trained with "
                              f"{in_words(training)}; set data.tokenizer to the tokenizer they were prepared with, "
                              "or re-run `pretrieve prepare --tokenizer` with the training tokenizer")

    # --- positions and state --------------------------------------------------------------------------
    def _begin(self, slots: int) -> None:
        """Start (or continue) the current epoch with `slots` readers per rank; a new layout is a new stage."""
        if self._stages and (self._stages[-1]["world"], self._stages[-1]["workers"]) == (self.world_size, slots):
            return
        if self._stages and not any(self._stages[-1]["offsets"]):
            self._stages.pop()  # nothing was read under that layout
        if self._stages and self.one_source_batches:
            old = self._stages[-1]
            raise StreamError(f"one-source batches resume mid-epoch with the layout they started with: world size "
                              f"{old['world']} and {old['workers']} reader(s) per rank, not {self.world_size} and "
                              f"{slots}; resume with those or from an epoch boundary")
        self._stages.append({"world": self.world_size, "workers": slots, "offsets": [0] * slots})
        self._rotation = 0

    def _slots(self) -> list[list[Segment]]:
        """This rank's slots under the current stage."""
        sequence = self.plan.stage_sequence(self.epoch, self._stages[:-1])
        stage = self._stages[-1]
        return EpochPlan.rank_slots(sequence, stage["world"], stage["workers"], self.rank)

    def _source_slots(self, world: int | None = None, workers: int | None = None) -> list[list[list[Segment]]]:
        """One-source batches: this rank's slots, each a list of segments per manifest."""
        world = world or self._stages[-1]["world"]
        workers = workers or self._stages[-1]["workers"]
        per_manifest = [EpochPlan.rank_slots(self.plan.manifest_sequence(self.epoch, m), world, workers, self.rank,
                                             self.batch_size) for m in range(len(self.plan.quotas))]
        return [[slots[w] for slots in per_manifest] for w in range(workers)]

    def _slot_sizes(self) -> list[int]:
        if self.one_source_batches:
            return [sum(map(total, slot)) for slot in self._source_slots()]
        return [total(slot) for slot in self._slots()]

    def _end_epoch(self) -> None:
        self.epoch += 1
        self._stages = []
        self._rotation = 0

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "plan": self.plan.fingerprint, "epoch": self.epoch,
                "stages": json.loads(json.dumps(self._stages)), "rotation": self._rotation}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise StreamError(f"not a stream state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        if state["plan"] != self.plan.fingerprint:
            raise StreamError("the stream state belongs to other data (manifests, weights or seed differ); "
                              "resume with the same data settings or start a new run")
        self.epoch = state["epoch"]
        self._stages = [dict(s) for s in state["stages"]]
        self._rotation = state["rotation"]

    def describe_position(self) -> str:
        """The position in words: the epoch and the samples of it all ranks have read (ranks read in lockstep, so
        each stage's count on this rank times that stage's world size; pad samples included)."""
        read = sum(stage["world"] * sum(stage["offsets"]) for stage in self._stages)
        return f"epoch {self.epoch}, {read} of its {total(self.plan.epoch_sequence(self.epoch))} samples read"

    def describe_batch(self, origin: BatchOrigin) -> str:
        """The shards and samples of the batch `origin` names, read again from its slot's position."""
        view = copy.copy(self)
        view.epoch, view._stages = origin.epoch, list(origin.stages)
        shards: dict[str, list[str]] = {}
        with closing(view._iter_slot(origin.slot, origin.offset)) as samples:
            for sample in islice(samples, origin.count):
                shards.setdefault(sample["shard_file"], []).append(f"{sample['index']}{' (pad)' * sample['pad']}")
        return "; ".join(f"shard {shard} sample{'s' * (len(found) > 1)} {', '.join(found)}"
                         for shard, found in shards.items()) + f" (epoch {origin.epoch})"

    def samples_per_epoch(self) -> int:
        """Samples this rank reads in a full epoch at the current world size (pad samples included)."""
        if self.one_source_batches:
            return sum(map(total, self._source_slots(self.world_size, 1)[0]))
        return math.ceil(total(self.plan.epoch_sequence(self.epoch)) / self.world_size)

    # --- reading ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict]:
        # Decide the mode now, not in a generator body: a DataLoader calls iter() before it starts pulling.
        info = get_worker_info()
        if info is None and not self._managed:  # plain iteration in this process: count samples ourselves
            self._begin(1)
            return self._iter_counting()
        if info is not None and not self._managed:
            raise StreamError("ShardStream in DataLoader workers needs StreamLoader, which tracks the position "
                              "across workers; use pretrieve.data.stream.StreamLoader instead of DataLoader")
        slots = self._stages[-1]["workers"]
        slot = ((0 if info is None else info.id) + self._rotation) % slots
        return self._iter_slot(slot, self._stages[-1]["offsets"][slot])

    def _iter_counting(self) -> Iterator[dict]:
        offsets = self._stages[-1]["offsets"]
        for sample in self._iter_slot(0, offsets[0]):
            offsets[0] += 1
            yield sample
        self._end_epoch()

    def _iter_slot(self, slot: int, offset: int) -> Iterator[dict]:
        if self.one_source_batches:
            yield from self._iter_one_source_slot(slot, offset)
            return
        stage = len(self._stages) - 1
        yield from self._shuffled(self._slots()[slot], offset, partial(self.plan.window_order, self.epoch, stage,
                                                                      self.rank, slot))

    def _shuffled(self, segments: list[Segment], offset: int, window_order) -> Iterator[dict]:
        """The samples of `segments` from output `offset` on, emitted in windows shuffled by `window_order`."""
        n, window = total(segments), self.plan.window
        first_window = offset // window
        with closing(self._read(drop(segments, first_window * window))) as reader:  # closing stops its prefetch
            for w in range(first_window, math.ceil(n / window)):
                samples = list(islice(reader, min(window, n - w * window)))
                order = window_order(w, len(samples))
                skip = offset - w * window if w == first_window else 0
                for i in order[skip:]:
                    yield samples[i]

    def _iter_one_source_slot(self, slot: int, offset: int) -> Iterator[dict]:
        """Batches of one manifest each, in the slot's drawn order; each manifest's share shuffled alone."""
        shares, size = self._source_slots()[slot], self.batch_size
        sources = self.plan.batch_sources(self.epoch, self.rank, slot, [total(s) // size for s in shares])
        done, partly = divmod(offset, size)
        consumed = np.bincount(sources[:done], minlength=len(shares)) * size
        if partly:
            consumed[sources[done]] += partly
        readers = {}
        try:
            for b in range(done, len(sources)):
                m = int(sources[b])
                if m not in readers:
                    readers[m] = self._shuffled(shares[m], int(consumed[m]), partial(
                        self.plan.source_window_order, self.epoch, self.rank, slot, m))
                yield from islice(readers[m], size - (partly if b == done else 0))
        finally:
            for reader in readers.values():
                reader.close()

    def _read(self, segments: list[Segment]) -> Iterator[dict]:
        """Samples of `segments` in order; a run of increasing segments of one shard is one read of it, loaded
        (and verified) whole before its first sample is parsed, the next runs' shards loading meanwhile."""
        runs = list(_shard_runs(segments))
        loads = [partial(self._load, self.shards[run[0].shard]) for run in runs]
        with closing(prefetched(loads, self.read.prefetch_shards)) as loaded:
            for run in runs:
                yield from self._samples_of(run, loaded)

    def _load(self, ref: ShardRef, cancel):
        return load_shard(ref.location, ref.sha256 if self.verify else None, ref.bytes, self.read, cancel)

    def _samples_of(self, run: list[Segment], loaded: Iterator) -> Iterator[dict]:
        ref = self.shards[run[0].shard]
        try:
            data = next(loaded)
        except ShardError as e:
            raise ShardError(f"{e} The stream stopped at sample {run[0].start} of this shard's {ref.num_samples}; "
                             "none of its samples was yielded.") from e
        count = ref.num_samples if run[-1].stop == ref.num_samples else None
        samples = parse_shard(data, ref.location, run[0].start, run[-1].stop, count)
        segs = iter(run)
        seg = next(segs)
        for index, (ids, meta) in enumerate(samples, run[0].start):
            if index >= seg.stop:
                seg = next(segs)
            if index >= seg.start and "parts" in meta:  # a pair (prepare --pairs)
                query, pos, negs = split_pair(ids, meta["parts"])
                yield {"query": query, "pos": pos, "negs": negs, "doc": meta["doc"], "source": meta["source"],
                       "pair": meta["pair"], "pad": seg.pad, "shard": seg.shard, "index": index, "epoch": self.epoch,
                       "shard_file": ref.location}
            elif index >= seg.start:
                sample = {"ids": ids, "doc": meta["doc"], "block": meta["block"], "source": meta["source"],
                          "pad": seg.pad, "shard": seg.shard, "index": index, "epoch": self.epoch,
                          "shard_file": ref.location}
                if "queries" in meta:  # pseudo-queries (token ids) of the document, for CoT-MAE
                    sample["queries"] = meta["queries"]
                yield sample


def _shard_runs(segments: list[Segment]) -> Iterator[list[Segment]]:
    run: list[Segment] = []
    for seg in segments:
        if run and (seg.shard != run[-1].shard or seg.start < run[-1].stop):
            yield run
            run = []
        run.append(seg)
    if run:
        yield run


class StreamLoader(DataLoader):
    """A DataLoader for a ShardStream that keeps the stream's position exact in the main process.

    Batches are lists of samples unless `collate_fn` is given. Each iteration yields the rest of the stream's
    current epoch and then advances it. `persistent_workers` and `drop_last` are refused: workers must see
    the position at the start of each iteration, and every sample of the epoch is delivered.
    """

    def __init__(self, stream: ShardStream, batch_size: int, num_workers: int = 0, collate_fn=None, **kwargs):
        if not isinstance(stream, ShardStream):
            raise TypeError("StreamLoader drives a ShardStream")
        if stream.one_source_batches and (stream.batch_size % batch_size or
                                          (batch_size != stream.batch_size and num_workers > 1)):
            raise ValueError(f"the stream's one-source runs are {stream.batch_size} samples: the loader's batch_size "
                             f"must equal that (or divide it, with at most one worker), got {batch_size}")
        for bad in ("persistent_workers", "drop_last", "shuffle", "sampler", "batch_sampler"):
            if kwargs.get(bad):
                raise ValueError(f"StreamLoader does not support {bad}=...; the stream shuffles and splits itself")
        kwargs["worker_init_fn"] = _StopSignalsIgnored(kwargs.get("worker_init_fn"))
        super().__init__(stream, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn or list,
                         **kwargs)

    def __iter__(self):
        stream: ShardStream = self.dataset
        slots = max(1, self.num_workers)
        stream._begin(slots)
        offsets = stream._stages[-1]["offsets"]
        remaining = [size - offsets[i] for i, size in enumerate(stream._slot_sizes())]
        turn = stream._rotation
        stream._managed = True  # the workers' copies are pickled from here on
        try:
            batches = super().__iter__()
        finally:
            stream._managed = False
        try:
            for batch in batches:
                while remaining[turn] == 0:  # the DataLoader skips exhausted workers
                    turn = (turn + 1) % slots
                taken = min(self.batch_size, remaining[turn])
                stream.last_batch = BatchOrigin(stream.epoch, tuple(stream._stages), turn, offsets[turn], taken)
                remaining[turn] -= taken
                offsets[turn] += taken
                turn = (turn + 1) % slots
                stream._rotation = turn
                yield batch
        finally:
            # Now, not when the iterator is collected: a worker's error keeps it referenced by the traceback
            # until exit, and at exit multiprocessing's SIGTERM cannot end workers that ignore it (below)
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if any(remaining):
            raise StreamError(f"stream position out of step: {remaining} samples unaccounted for")
        stream._end_epoch()

    def batches_per_epoch(self) -> int:
        """Batches every rank yields in a full epoch (the same on all ranks)."""
        stream, slots = self.dataset, max(1, self.num_workers)
        if stream.one_source_batches:  # slots hold whole batches of each manifest
            return sum(math.ceil(sum(map(total, slot)) / self.batch_size)
                       for slot in stream._source_slots(stream.world_size, slots))
        n = stream.samples_per_epoch()
        return sum(math.ceil((n // slots + (w < n % slots)) / self.batch_size) for w in range(slots))


class _StopSignalsIgnored:
    """Worker init: SLURM sends its pre-timeout USR1 and its TERM to every process of a job step, a terminal its
    Ctrl-C (INT) to every process of its foreground group, torchrun to its worker's. The main process decides (a
    checkpoint at the next step, then it ends its workers); a worker killed under it would make the DataLoader
    raise in the middle of that step, and print its own traceback."""

    def __init__(self, then=None):
        self.then = then

    def __call__(self, worker_id: int) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        if self.then is not None:
            self.then(worker_id)


def _distributed_position(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None or world_size is not None:
        return rank or 0, world_size or 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
