"""Method registry: a method name selects its head, collator and options (fairseq-style: a method is a file).

    method = get_method("dupmae")
    options = method.options_from({"bow_weight": 0.5})   # paper defaults for everything not given
    head = method.build(options, ModelOptions(...))
    collate = method.collator.from_options(options, vocab, seed)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from pretrieve.models.encoder import Encoder, ModelOptions


# The valid values of every numeric method option, checked when the config is read: outside them a run trains
# to rc 0 on nonsense (a masking ratio of 1.5) or crashes steps later. tests/test_method_option_ranges.py checks
# that every numeric option of every registered method is listed.
OPTION_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "max_len": (">= 3 ([CLS], a token, [SEP])", lambda v: v >= 3),
    "mlm_ratio": ("in (0, 1]", lambda v: 0 < v <= 1),
    "decoder_hide_ratio": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "decoder_pool_size": (">= 1", lambda v: v >= 1),
    "decoder_attention_dropout": ("in [0, 1)", lambda v: 0 <= v < 1),
    "decoder_layers": (">= 1", lambda v: v >= 1),
    "decoder_window": (">= 1", lambda v: v >= 1),
    "bow_weight": (">= 0", lambda v: v >= 0),
    "mlm_weight": (">= 0", lambda v: v >= 0),
    "spans_per_level": (">= 1", lambda v: v >= 1),
    "span_alpha": ("> 0", lambda v: v > 0),
    "span_beta": ("> 0", lambda v: v > 0),
    "temperature": ("> 0", lambda v: v > 0),
}


def option_range_problems(options: Any, where: str) -> list[str]:
    """One message per option outside its range."""
    problems = []
    for f in fields(options):
        value = getattr(options, f.name)
        if f.name in OPTION_RANGES and value is not None:
            rule, ok = OPTION_RANGES[f.name]
            if not (math.isfinite(value) and ok(value)):
                problems.append(f"{where}.{f.name}: must be {rule}, got {value!r}")
    return problems


@dataclass(frozen=True)
class Method:
    name: str
    head: type  # a PretrainingHead subclass
    collator: type  # from pretrieve.data.collators
    options: type  # dataclass; its defaults are the paper's settings

    def options_from(self, values: dict[str, Any] | None = None, where: str = "method") -> Any:
        """Options with `values` over the defaults; an unknown key or a value out of range is a ConfigError
        naming it (each of them, when there are several)."""
        from pretrieve.utils.options import Problems, options_of

        values = dict(values or {})
        values.pop("name", None)
        options = options_of(self.options, values, where, noun=f"option of method {self.name!r}")
        problems = Problems()
        for message in option_range_problems(options, where):
            problems.add(message)
        problems.raise_any()
        return options

    def build(self, options: Any, model: ModelOptions, seed: int = 0):
        """The head on a new encoder (random init from `seed`, or `model.init_from`)."""
        torch.manual_seed(seed)
        head = self.head(Encoder.build(model), options)
        if model.init_from:
            head.load_extra_weights(model.init_from)
        return head


METHODS: dict[str, Method] = {}


def register_method(name: str, head: type, collator: type, options: type) -> None:
    if name in METHODS:
        raise ValueError(f"method {name!r} registered twice")
    METHODS[name] = Method(name, head, collator, options)


def get_method(name: str) -> Method:
    import pretrieve.models.heads  # noqa: F401  (registers the built-in methods)

    if name not in METHODS:
        raise KeyError(f"method {name!r} is not registered (known: {', '.join(sorted(METHODS))})")
    return METHODS[name]

