"""`train.health`: what the training loop's alarms do (engine/health.py). Each alarm is `warn` (a line, the
progress line's `alarm` figure and an MLflow tag; training goes on), `stop` (the same, then the run ends with the
alarm's own exit code) or `off`. Light enough for the config's checks: no torch."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from pretrieve.utils.options import ConfigError, options_of
from pretrieve.utils.stop_signals import HEALTH_EXIT_CODES

ACTIONS = ("warn", "stop", "off")


@dataclass
class HealthOptions:
    """Each alarm's action (YAML reads a bare `off` as false: that is off too) and collapse's threshold."""

    nonfinite: str | bool = "stop"  # a NaN or inf loss, or gradient norm (fp16's skipped overflow steps aside)
    collapse: str | bool = "warn"  # the loss of a log window below collapse_fraction of the run's first window's
    collapse_fraction: float = 0.02  # an MLM's loss never gets there (ln of the vocabulary to ~2); a leak does
    zero_grad_norm: str | bool = "stop"  # the gradient norm 0 at every step of a log window
    zero_lr: str | bool = "stop"  # the learning rate 0 at a step after the warm-up

    def __post_init__(self):
        for name in HEALTH_EXIT_CODES:
            if getattr(self, name) is False:
                setattr(self, name, "off")
        problems = [f"train.health.{name}: {getattr(self, name)!r} is not one of {', '.join(ACTIONS)}"
                    for name in HEALTH_EXIT_CODES if getattr(self, name) not in ACTIONS]
        if not 0 < self.collapse_fraction < 1:
            problems.append(f"train.health.collapse_fraction: must be > 0 and < 1, got {self.collapse_fraction}")
        if problems:
            raise ConfigError("; ".join(problems), problems)


def health_options(values: dict | None) -> HealthOptions:
    """`train.health` (a mapping, or null: every default) as HealthOptions; each error names its key."""
    if values is None:
        return HealthOptions()
    if not isinstance(values, dict):
        raise ConfigError(f"train.health: expected a mapping of {', '.join(f.name for f in fields(HealthOptions))}; "
                          f"got {values!r}")
    return options_of(HealthOptions, values, "train.health")


def optimizer_lr_problem(ds_config: Path) -> str | None:
    """The ds_config's optimizer lr when it is a number that is 0 (not "auto", which is train.lr): every step of
    the schedule would then have lr 0, the schedule ending before its first step."""
    try:
        lr = json.loads(ds_config.read_text()).get("optimizer", {}).get("params", {}).get("lr")
    except (OSError, ValueError, AttributeError):  # unreadable or malformed: deepspeed_config reports it
        return None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr == 0:
        return (f"train.ds_config: {ds_config} sets the optimizer's lr to 0: every step would train at lr 0; write "
                "\"auto\" (train.lr) or a positive lr (train.health.zero_lr: warn or off lets it run)")
    return None


def check_health(values: dict | None, ds_config: str | None) -> HealthOptions:
    """`train.health` checked as the config is read; a `train.ds_config` whose lr is 0 is refused there (zero_lr:
    stop) or warned about (warn): the alarm would otherwise fire at the first log step after the warm-up. (The
    shipped ds_configs' lr is "auto", train.lr.)"""
    health = health_options(values)
    problem = optimizer_lr_problem(Path(ds_config)) if ds_config and health.zero_lr != "off" else None
    if problem and health.zero_lr == "stop":
        raise ConfigError(problem)
    if problem:
        print(f"pretrieve: warning: {problem}", file=sys.stderr)
    return health
