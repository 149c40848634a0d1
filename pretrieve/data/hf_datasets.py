"""Hugging Face datasets as `prepare` input (`--hf-dataset NAME`): their rows streamed, shard by shard, resumable
at a row.

NAME is what `datasets.load_dataset` takes, read with `streaming=True` (nothing is downloaded ahead: the rows
arrive as they are read): a dataset of the Hub (`wikimedia/wikipedia` with `--hf-config 20231101.en`), a local
folder of data files, or a packaged builder with `--hf-data-files` (`parquet`, `json`, `csv`). A folder written
by `Dataset.save_to_disk` is read with `load_from_disk`, one shard per arrow file.

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

import os
from dataclasses import dataclass
from typing import Iterator

from pretrieve.optional import DATASETS, require


class DatasetError(ValueError):
    """A dataset that cannot be opened or read; the message names it."""


@dataclass(frozen=True)
class HFDataset:
    name: str
    config: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] = ()
    rows_per_document: int = 1

    def __str__(self) -> str:
        named = [self.name] + ([self.config] if self.config else []) + [self.split]
        return f"hf-dataset {'/'.join(named)}"

    def as_input(self) -> dict:
        """What a manifest records of this input (the job id is made of it)."""
        entry = {"hf_dataset": self.name, "config": self.config, "split": self.split}
        if self.data_files:
            entry["data_files"] = list(self.data_files)
        if self.rows_per_document > 1:
            entry["rows_per_document"] = self.rows_per_document
        return entry


def rows(dataset: HFDataset, shard: int = 0, row: int = 0) -> Iterator[tuple[int, int, list[dict]]]:
    """(shard, first row, rows) of every group of `rows_per_document` rows from position (shard, row) on, in the
    stream's order; a shard's last group may be shorter, and no group spans two shards."""
    stream = open_stream(dataset)
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


def open_stream(dataset: HFDataset):
    """The dataset as a `datasets.IterableDataset` (module docstring); a clear error when it cannot be opened."""
    datasets = require(DATASETS, "--hf-dataset")
    datasets.disable_progress_bars()  # prepare draws its own
    local = os.path.isdir(dataset.name)
    try:
        if local and os.path.exists(os.path.join(dataset.name, "dataset_info.json")) and not dataset.data_files:
            saved = datasets.load_from_disk(dataset.name)  # a save_to_disk folder
            if isinstance(saved, datasets.DatasetDict):
                if dataset.split not in saved:
                    raise DatasetError(f"{dataset}: no split {dataset.split!r} (splits: {', '.join(saved)})")
                saved = saved[dataset.split]
            return saved.to_iterable_dataset(num_shards=max(1, len(saved.cache_files)))
        return datasets.load_dataset(dataset.name, dataset.config, split=dataset.split, streaming=True,
                                     data_files=list(dataset.data_files) or None)
    except ConnectionError as e:  # no network, or HF_HUB_OFFLINE=1
        raise DatasetError(
            f"{dataset}: cannot reach the Hugging Face Hub ({e}). Without a network, stream it on a machine "
            "that has one (a login node) into shards, and train from the shards") from e
    except (FileNotFoundError, ValueError) as e:  # no such dataset, config or split
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"{dataset}: {e}") from e
