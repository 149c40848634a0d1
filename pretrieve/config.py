"""Experiment configs: YAML files (configs/), dotted `key=value` overrides, validation naming the bad key.

A config has `seed`, `model:` (models.encoder.ModelOptions), `method:` (`name` + the method's options, whose
defaults are the paper settings), and the `data:` and `train:` sections the training engine reads.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pretrieve.models.encoder import ModelOptions


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and key."""


def load_config(path: str | Path, overrides: list[str] | None = None) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        config = OmegaConf.load(path)
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r}: expected key=value")
        config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(overrides or [])))
    except ConfigError:
        raise
    except Exception as e:  # omegaconf/yaml raise many types for bad syntax
        raise ConfigError(f"{path}: {e}") from e
    for section in ("model", "method"):
        if section not in config:
            raise ConfigError(f"{path}: missing section {section!r}")
    return config


def model_options(config: DictConfig) -> ModelOptions:
    values = OmegaConf.to_container(config.model, resolve=True)
    known = {f.name for f in fields(ModelOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})")
    return ModelOptions(**values)


def method_options(config: DictConfig) -> tuple[Any, Any]:
    """(registered Method, its options) from the `method:` section."""
    from pretrieve.models.heads import get_method

    values = OmegaConf.to_container(config.method, resolve=True)
    if "name" not in values:
        raise ConfigError("method.name: missing (one of the registered methods, e.g. retromae)")
    try:
        method = get_method(values["name"])
        return method, method.options_from(values)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(str(e).strip('"')) from e
