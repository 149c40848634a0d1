"""Hugging Face datasets as `prepare` input (`--hf-dataset NAME`): their rows streamed, shard by shard, resumable
at a row.

NAME is what `datasets.load_dataset` takes, read with `streaming=True` (nothing is downloaded ahead: the rows
arrive as they are read): a dataset of the Hub (`wikimedia/wikipedia` with `--hf-config 20231101.en`), a local
folder of data files, or a packaged builder with `--hf-data-files` (`parquet`, `json`, `csv`). A folder written
by `save_to_disk` is read with `load_from_disk`, one shard per arrow file (a `DatasetDict`: its split alone).
Options that would do nothing are refused (`HFDataset.check`), and the manifest records the options used and
the data files they resolved to (`as_input`).

A dataset of one sentence a row (BookCorpus) has no document to pack sentences within: `rows_per_document`
consecutive rows of a shard then make one document, their texts its lines.

Rows are read shard by shard (`IterableDataset.shard`, contiguous, in order: a shard is one data file for the
file builders), which is the order of the whole stream. A row's position is (shard, row within it): a resumed
`prepare` starts at that shard and skips the rows before the position in it (`IterableDataset.skip`), so no
earlier shard is read again. The position is two numbers, kept in prepare's resume state as a file's cursor is
(datasets' own `state_dict`, a nested record of its iterators, would resume as exactly but is not one).

Without a network (a compute node), the Hub is not reached: with `HF_HUB_OFFLINE=1` a Hub dataset is an error at
once (streaming reads its data files from the Hub); with a network that fails, datasets retries for about 20 s first.
`datasets` comes with the `hf` extra.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator

from pretrieve.optional import DATASETS, require


class DatasetError(ValueError):
    """A dataset that cannot be opened or read, or options that do not apply to it; the message names it."""


@dataclass(frozen=True)
class HFDataset:
    name: str
    config: str | None = None
    split: str | None = None  # None: "train", where the dataset has splits
    data_files: tuple[str, ...] = ()
    rows_per_document: int = 1

    def __str__(self) -> str:
        named = [self.name] + ([self.config] if self.config else []) + [self.split or "train"]
        return f"hf-dataset {'/'.join(named)}"

    def check(self) -> None:
        """Refuse, before any work, the options that would read what was not meant or would do nothing."""
        require(DATASETS, "--hf-dataset")
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        if self.name in _PACKAGED_DATASETS_MODULES:  # datasets takes the builder even where a folder has the name
            if not self.data_files:  # datasets would read every file under the current folder
                raise DatasetError(f"--hf-dataset {self.name} is the {self.name} builder of datasets, which reads "
                                   f"the files --hf-data-files names: pass them (or --hf-dataset ./{self.name} for a "
                                   "folder of that name)")
            if self.config:
                raise DatasetError(f"--hf-config {self.config}: the {self.name} builder has no configurations "
                                   "(it reads --hf-data-files); leave --hf-config out")
        saved = _saved_to_disk(self.name)
        if saved:
            for flag, given in (("--hf-config", self.config), ("--hf-data-files", self.data_files)):
                if given:
                    raise DatasetError(f"{flag}: {self.name} was written by save_to_disk, which has no "
                                       f"configurations or data files to choose; leave {flag} out")
        if saved == "dataset" and self.split:
            raise DatasetError(f"--hf-split {self.split}: {self.name} is one Dataset written by save_to_disk, "
                               "which has no splits; leave --hf-split out")

    def as_input(self) -> dict:
        """What a manifest records of this input (the job id is made of it): the options used and the data files
        they resolve to (opens the dataset)."""
        _, split, files = open_stream(self)
        entry = {"hf_dataset": self.name, **({"config": self.config} if self.config else {}),
                 **({"split": split} if split else {})}
        if self.data_files:
            entry["data_files"] = list(self.data_files)
        entry["files"] = files
        if self.rows_per_document > 1:
            entry["rows_per_document"] = self.rows_per_document
        return entry


def rows(dataset: HFDataset, shard: int = 0, row: int = 0) -> Iterator[tuple[int, int, list[dict]]]:
    """(shard, first row, rows) of every group of `rows_per_document` rows from position (shard, row) on, in the
    stream's order; a shard's last group may be shorter, and no group spans two shards."""
    stream = open_stream(dataset)[0]
    size = dataset.rows_per_document
    for k in range(shard, stream.num_shards):
        part = stream.shard(num_shards=stream.num_shards, index=k, contiguous=True)
        first = row if k == shard else 0
        if first:
            part = part.skip(first)
        group: list[dict] = []
        try:
            for record in part:
                group.append(record)
                if len(group) == size:
                    yield k, first, group
                    first, group = first + size, []
            if group:
                yield k, first, group
        except (OSError, ValueError) as e:  # a damaged or unreachable data file: datasets names it
            raise DatasetError(f"{dataset}: cannot read shard {k} ({type(e).__name__}: {e})") from e


def open_stream(dataset: HFDataset) -> tuple:
    """(the dataset as a `datasets.IterableDataset`, the split read or None, the data files read); a clear error
    when it cannot be opened."""
    datasets = require(DATASETS, "--hf-dataset")
    datasets.disable_progress_bars()  # prepare draws its own
    try:
        if _saved_to_disk(dataset.name):
            return _open_saved(datasets, dataset)
        # what load_dataset(..., streaming=True) does, with the builder's resolved data files at hand
        builder = datasets.load_dataset_builder(dataset.name, dataset.config,
                                                data_files=list(dataset.data_files) or None)
        split = dataset.split or "train"
        splits = {str(name): files for name, files in (builder.config.data_files or {}).items()}
        if splits and split not in splits:
            raise DatasetError(f"{dataset}: no split {split!r} (splits: {', '.join(splits)})")
        return builder.as_streaming_dataset(split=split), split, [str(f) for f in splits.get(split, ())]
    except ConnectionError as e:  # no network, or HF_HUB_OFFLINE=1
        raise DatasetError(
            f"{dataset}: cannot reach the Hugging Face Hub ({e}). Without a network, stream it on a machine "
            "that has one (a login node) into shards, and train from the shards") from e
    except (FileNotFoundError, ValueError) as e:  # no such dataset, config or split
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"{dataset}: {e}") from e


def _saved_to_disk(name: str) -> str | None:
    """"dataset" or "dict" for a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    if os.path.exists(os.path.join(name, "state.json")):
        return "dataset"
    return "dict" if os.path.exists(os.path.join(name, "dataset_dict.json")) else None


def _open_saved(datasets, dataset: HFDataset) -> tuple:
    """open_stream of a save_to_disk folder: one shard per arrow file; a DatasetDict's split is read alone."""
    folder, split = dataset.name, None
    if _saved_to_disk(dataset.name) == "dict":
        split = dataset.split or "train"
        with open(os.path.join(dataset.name, "dataset_dict.json"), encoding="utf-8") as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise DatasetError(f"{dataset}: no split {split!r} (splits: {', '.join(splits)})")
        folder = os.path.join(dataset.name, split)
    try:
        saved = datasets.load_from_disk(folder)
    except IndexError:  # datasets concatenates the saved arrow files, and fails where there are none
        saved = []
    if not len(saved):
        raise DatasetError(f"{dataset}: {folder} holds no rows (an empty dataset written by save_to_disk)")
    files = [c["filename"] for c in saved.cache_files]
    return saved.to_iterable_dataset(num_shards=max(1, len(files))), split, files
