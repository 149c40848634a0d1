"""The tokenizer a pre-training run trains with, and the checks that tie it to the checkpoint and the shards.

A run trains with `data.tokenizer`; left out, with `model.init_from`'s own tokenizer when the checkpoint folder
holds one (continued pre-training keeps the checkpoint's tokenizer: its embedding rows are that tokenizer's
ids), else with the bundled bert-base-uncased WordPiece. Before any process starts, the config check refuses a
data.tokenizer of another vocabulary than init_from's, and local manifests whose shards were tokenized with
another vocabulary than the training tokenizer, naming both tokenizers (the stream checks manifests at URLs the
same way when it opens them).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pretrieve.data.remote import is_remote, local_path
from pretrieve.data.tokenizer import (DEFAULT_TOKENIZER, TOKENIZER_FILES, TokenizerError, describe, has_tokenizer,
                                      in_words)

RUN_TOKENIZER = "tokenizer"  # in the run directory: a copy of init_from's tokenizer, which the export ships


@dataclass(frozen=True)
class TrainingTokenizer:
    path: str
    source: str  # where it came from, in words: DATA_TOKENIZER, INIT_FROM or BUNDLED

    @property
    def from_checkpoint(self) -> bool:
        return self.source == INIT_FROM


DATA_TOKENIZER, INIT_FROM, BUNDLED = "data.tokenizer", "model.init_from's tokenizer", "the bundled tokenizer"


def training_tokenizer(data, model) -> TrainingTokenizer:
    """The tokenizer a run of `data:` (DataOptions) and `model:` (ModelOptions) trains with."""
    if data.tokenizer:
        return TrainingTokenizer(str(data.tokenizer), DATA_TOKENIZER)
    if model.init_from and Path(model.init_from).is_dir() and has_tokenizer(model.init_from):
        return TrainingTokenizer(str(model.init_from), INIT_FROM)
    return TrainingTokenizer(DEFAULT_TOKENIZER, BUNDLED)


def tokenizer_problems(data, model, manifests: dict[int, dict]) -> list[str]:
    """What does not fit the training tokenizer: init_from's own tokenizer (data.tokenizer of another vocabulary),
    the shards of the local manifests (`manifests`: data.manifests as read, by index) and of data.validation."""
    training = training_tokenizer(data, model)
    try:
        ours = _described(training.path)
    except TokenizerError as e:
        return [f"{'model.init_from' if training.from_checkpoint else 'data.tokenizer'}: {e}"]
    problems = []
    checkpoint = model.init_from
    if (training.source == DATA_TOKENIZER and checkpoint and Path(checkpoint).is_dir()
            and has_tokenizer(checkpoint)):
        try:
            theirs = _described(str(checkpoint))
        except TokenizerError:
            theirs = None  # not loadable: the run's own load of the checkpoint says why
        if theirs is not None and theirs["fingerprint"] != ours["fingerprint"]:
            problems.append(f"data.tokenizer: {in_words(ours)} is not the tokenizer of model.init_from, "
                            f"{in_words(theirs)}: the checkpoint's embedding rows are its own tokenizer's ids; "
                            "leave data.tokenizer out (the checkpoint's is used) and prepare the shards with "
                            f"`pretrieve prepare --tokenizer {checkpoint}`")
    for key, read in (("manifests", manifests), ("validation", _read_quietly(data.validation))):
        for i, manifest in read.items():
            recorded = manifest.get("tokenizer")
            if isinstance(recorded, dict) and recorded.get("fingerprint") not in (None, ours["fingerprint"]):
                problems.append(f"data.{key}[{i}]: {getattr(data, key)[i]}: {mismatch(recorded, ours, training)}")
    return problems


def mismatch(recorded: dict, ours: dict, training: TrainingTokenizer) -> str:
    """Shards tokenized with `recorded` (a manifest's tokenizer) against the training tokenizer, both named,
    with the fix that keeps the training tokenizer (a checkpoint's cannot be swapped)."""
    fix = (f"re-run `pretrieve prepare --tokenizer {training.path}` (the checkpoint's tokenizer: its embedding rows "
           "are that tokenizer's ids)" if training.from_checkpoint else
           "set data.tokenizer to the tokenizer they were prepared with, or re-run `pretrieve prepare --tokenizer "
           f"{training.path}`")
    return (f"shards were tokenized with another vocabulary than the training tokenizer: prepared with "
            f"{in_words(recorded)}; the run trains with {training.source}, {in_words(ours)}; {fix}")


def _read_quietly(paths: list[str]) -> dict[int, dict]:
    """{index: content} of the local manifests among `paths` that read as JSON objects; the others are reported
    by the stream when it opens them."""
    read = {}
    for i, path in enumerate(paths):
        if is_remote(path):
            continue
        try:
            content = json.loads(Path(local_path(path)).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(content, dict):
            read[i] = content
    return read


def _described(path: str) -> dict:
    """describe(path) as a dict, loaded once per folder and version of its files (`scale plan` checks a config
    per point, all with one tokenizer)."""
    stamp = tuple((name, (Path(path) / name).stat().st_mtime_ns) for name in TOKENIZER_FILES
                  if (Path(path) / name).is_file())
    return _described_at(str(path), stamp)


@functools.lru_cache(maxsize=8)
def _described_at(path: str, stamp: tuple) -> dict:
    return describe(path).as_dict()
