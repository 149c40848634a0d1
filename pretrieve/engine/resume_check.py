"""A resume continues the run its checkpoint belongs to: the resolved config is compared with the one that
wrote the checkpoint (a copy inside each tag, `config.yaml`; for tags written before that copy existed, the run
directory's `config.yaml`) before anything in the run directory is written.

Paths compare as absolute paths (against the working directory), and `resume` itself is no change. Keys that
only say how long, how often or where to report, or what a health alarm does (MAY_CHANGE) may differ; the
changes are recorded in `resume_changes.jsonl` and on the MLflow run. Any other difference (a batch size, a
method option, the precision, the ZeRO stage, the data) would continue another experiment on this one's weights,
or fail deep inside DeepSpeed: it is refused, naming every differing key, unless the config says
`resume_changes: allow`, which is recorded the same way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

from pretrieve.data.remote import local_path
from pretrieve.utils.options import ConfigError
from pretrieve.utils.run_dir import TAG_CONFIG

# dotted keys, or prefixes ending in "."
MAY_CHANGE = ("run_dir", "resume", "resume_changes", "init_checkpoint", "train.max_steps", "train.stop_at",
              "train.log_every", "train.eval_every", "train.max_runtime", "train.startup_timeout", "train.peak_flops",
              "checkpoint.every", "checkpoint.keep", "data.num_workers", "data.check_shards",
              "data.corpora", "tracking.", "train.health", "train.health.")
# how this invocation starts, not what it continues: never a change
NOT_COMPARED = ("resume",)
# file locations: a relative and an absolute path to one file are the same setting
PATH_KEYS = ("data.manifests", "data.validation", "data.tokenizer", "model.init_from", "train.ds_config")
# another world size keeps the global batch through another split of it
UNIVERSAL_MAY_CHANGE = ("train.micro_batch_size", "train.grad_accum", "train.global_batch_size")
CHANGES_FILE = "resume_changes.jsonl"


def _flat(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return {key.rstrip("."): value for key, value in out.items()}


def _absolute(value):
    """A local path (or each of a list) made absolute, against the working directory; URLs as they are."""
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if isinstance(value, str) and local_path(value) is not None:
        return os.path.abspath(local_path(value))
    return value


def _compared(config: dict, section_classes) -> dict:
    """`config` flat, with its defaults filled in, its paths absolute and NOT_COMPARED left out."""
    flat = _flat(with_defaults(config, section_classes(config)))
    return {key: _absolute(value) if key in PATH_KEYS else value for key, value in flat.items()
            if key not in NOT_COMPARED}


def _may_change(key: str) -> bool:
    return any(key == rule or (rule.endswith(".") and key.startswith(rule)) for rule in MAY_CHANGE)


def saved_config(ckpt_dir: Path, tag: str) -> tuple[dict, Path] | None:
    """(config, its file) the checkpoint was written with; None when neither copy exists."""
    for path in (ckpt_dir / tag / TAG_CONFIG, ckpt_dir.parent / "config.yaml"):
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=True), path
    return None


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default is not MISSING else
            f.default_factory() if f.default_factory is not MISSING else None for f in fields(cls)}


def with_defaults(config: dict, classes: dict[str, type]) -> dict:
    """`config` with every option it leaves out at its default (the options class of each section: `classes`),
    so that leaving a key out and giving its default value compare equal."""
    out = {"seed": 42, **config}
    for section, cls in classes.items():
        out[section] = {**_defaults(cls), **(config.get(section) or {})}
    return out


def check_resume(saved: dict, saved_from: Path, config: dict, section_classes: Callable[[dict], dict[str, type]],
                 universal: bool = False) -> dict[str, list]:
    """{key: [checkpoint's value, this run's]} of every difference; ConfigError when one is not in MAY_CHANGE
    (with a universal checkpoint, which resumes at another world size, also UNIVERSAL_MAY_CHANGE) and
    `resume_changes` is not "allow". `section_classes(config)`: the options class of each of its sections (the
    experiment's, RunExperiment.section_classes)."""
    before, after = _compared(saved, section_classes), _compared(config, section_classes)
    changes = {key: [before.get(key), after.get(key)] for key in sorted(set(before) | set(after))
               if before.get(key) != after.get(key)}
    refused = [key for key in changes if not _may_change(key) and not (universal and key in UNIVERSAL_MAY_CHANGE)]
    if refused and config.get("resume_changes") != "allow":
        shown = "; ".join(f"{key}: {changes[key][0]!r} -> {changes[key][1]!r}" for key in refused)
        raise ConfigError(f"resume: this config differs from the checkpoint's ({saved_from}) in {shown}. Resuming "
                          "would continue another experiment on these weights: restore those keys, start a new "
                          "run_dir, or pass resume_changes=allow to continue anyway (recorded in the run)")
    return changes


def record_changes(run_dir: Path, tag: str, changes: dict[str, list], tracker=None) -> None:
    """Append the resume's config changes to run_dir/resume_changes.jsonl and tag the MLflow run with them."""
    if not changes:
        return
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checkpoint": tag, "changes": changes}
    with open(run_dir / CHANGES_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
    if tracker is not None:
        tracker.set_tag(f"pretrieve.resume_changes.{tag}", json.dumps(changes)[:5000])
