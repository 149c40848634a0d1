"""Options dataclasses from plain values: `options_of` checks every key and type and names the bad one; errors
are collected (Problems) so a user fixes a config in one round. The ground floor of config files, method options
and command-line defaults alike (docs/design.md, "Layers")."""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file and key. `problems`: each error's message."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


class Problems:
    """The errors of one config, collected: `add` one, `parse(fn, ...)` keeps going past fn's ConfigError (None
    then stands for what it would have returned, and checks that need it are skipped), `raise_any` raises one
    ConfigError listing each."""

    def __init__(self):
        self.messages: list[str] = []
        self.bad_keys: set[str] = set()  # keys whose value was refused: a later check of their stand-in says nothing

    def add(self, message: str) -> None:
        if message.split(":", 1)[0] not in self.bad_keys:
            self.messages.append(message)

    def parse(self, fn, *args):
        try:
            return fn(*args)
        except ConfigError as e:
            self.messages += e.problems
            return None

    def raise_any(self) -> None:
        if len(self.messages) == 1:
            raise ConfigError(self.messages[0])
        if self.messages:
            raise ConfigError(f"{len(self.messages)} errors in the config:\n" + "\n".join(
                f"  {message}" for message in self.messages), list(self.messages))


def options_of(cls, values: dict[str, Any], where: str, noun: str = "key", problems: Problems | None = None):
    """`cls(**values)` for an options dataclass, after checking every key is a field and every value has the
    field's type (the error names `where.key`): a YAML or override typo fails here, not steps into a run.

    With `problems`, the errors go there instead and the options are built from the values that passed (the
    others at their defaults), so that the checks of their ranges still run: a typo beside a value out of range
    reports both. None when not even that can be built."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    found = Problems()
    for key in sorted(set(values) - known):
        found.add(f"{where}.{key}: unknown {noun} (known: {', '.join(sorted(known))})")
    for key, value in values.items():
        if key in known and not _has_type(value, hints[key]):
            found.add(f"{where}.{key}: expected {_type_name(hints[key])}, got {value!r}")
    good = {key: value for key, value in values.items() if key in known and _has_type(value, hints[key])}
    if problems is None:
        found.raise_any()
    else:
        problems.messages += found.messages
        problems.bad_keys |= {f"{where}.{key}" for key in set(values) - set(good)}
    try:
        return cls(**good)
    except ConfigError as e:  # a nested section's (model.lora): its messages name their keys already
        if problems is None:
            raise
        problems.messages += e.problems
        return None
    except (TypeError, ValueError) as e:
        message = _under(where, str(e))
        if problems is None:
            raise ConfigError(message) from e
        problems.add(message)
        return None


def _under(where: str, message: str) -> str:
    """`message` under section `where`: prefixed with it unless it names its key in that section already
    (`method.grad_cache.chunk: ...`, not `method: method.grad_cache.chunk: ...`)."""
    return message if message.startswith((f"{where}.", f"{where}:")) else f"{where}: {message}"


def default_of(owner, name: str) -> Any:
    """The default of `owner`'s `name`: an options dataclass's field (its default_factory called) or a function's
    parameter. A command-line flag takes its default from here, so each default is written once."""
    if is_dataclass(owner):
        field = {f.name: f for f in fields(owner)}[name]
        default = field.default_factory() if field.default_factory is not MISSING else field.default
        missing = MISSING
    else:
        default, missing = inspect.signature(owner).parameters[name].default, inspect.Parameter.empty
    if default is missing:
        raise TypeError(f"{owner.__qualname__}.{name} has no default")
    return default


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_has_type(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):  # an int where a float is asked is fine; True is not a number here
        return isinstance(value, int if hint is int else (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # Any and other annotations: not checked


def _type_name(hint) -> str:
    return hint.__name__ if typing.get_origin(hint) is None else str(hint).replace("NoneType", "None")
