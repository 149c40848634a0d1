"""Method registry: a method name selects its head, collator and options (fairseq-style: a method is a file).

    method = get_method("dupmae")
    options = method.options_from({"bow_weight": 0.5})   # paper defaults for everything not given
    head = method.build(options, ModelOptions(...))
    collate = method.collator.from_options(options, vocab, seed)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pretrieve.models.encoder import Encoder, ModelOptions


@dataclass(frozen=True)
class Method:
    name: str
    head: type  # a PretrainingHead subclass
    collator: type  # from pretrieve.data.collators
    options: type  # dataclass; its defaults are the paper's settings

    def options_from(self, values: dict[str, Any] | None = None, where: str = "method") -> Any:
        """Options with `values` over the defaults; an unknown key is an error naming it."""
        from pretrieve.config import options_of

        values = dict(values or {})
        values.pop("name", None)
        return options_of(self.options, values, where, noun=f"option of method {self.name!r}")

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

