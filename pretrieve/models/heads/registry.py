"""Method registry: a method name selects everything about it, registered by its head file (fairseq-style: a
method is a file; docs/methods.md, "Add a method"):

    method = get_method("dupmae")
    options = method.options_from({"bow_weight": 0.5})   # paper defaults for everything not given
    head = method.build(options, ModelOptions(...))
    collate = method.collator.from_options(options, vocab, seed)
    method.flops(options, hf_config, batch)               # the head's forward FLOPs beyond the encoder's
    method.eval_pooling, method.study_arm                 # what the method study reads (study/plan.py)

An options dataclass declares each option's valid values beside it, with `option(default, at_least=...,
choices=...)`: ranges are checked when the config is read (every violation named at once), choices when the
options are made.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

import torch

from pretrieve.models.encoder import Encoder, ModelOptions
from pretrieve.models.lora import add_lora


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric option, from `low` to `high` (None: unbounded), each end open or closed.
    Outside them a run trains to rc 0 on nonsense (a masking ratio of 1.5) or crashes steps later."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    why: str = ""  # said after the rule: what the bound leaves room for

    def __contains__(self, value: float) -> bool:
        return (math.isfinite(value)
                and (self.low is None or (value > self.low if self.low_open else value >= self.low))
                and (self.high is None or (value < self.high if self.high_open else value <= self.high)))

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            rule = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            rule = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            rule = f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{rule} ({self.why})" if self.why else rule


def option(default: Any = MISSING, *, at_least: float | None = None, above: float | None = None,
           at_most: float | None = None, below: float | None = None, why: str = "",
           choices: tuple[str, ...] | None = None, **field_kwargs) -> Any:
    """A field of a method's options with its valid values beside it: a range (`at_least` / `above` for the low
    end, `at_most` / `below` for the high one) for a number, `choices` for a string."""
    metadata = {}
    if (at_least, above, at_most, below) != (None,) * 4:
        if at_least is not None and above is not None or at_most is not None and below is not None:
            raise TypeError("option: give at most one of at_least / above and one of at_most / below")
        metadata["range"] = Range(above if at_least is None else at_least, below if at_most is None else at_most,
                                  low_open=above is not None, high_open=below is not None, why=why)
    if choices is not None:
        metadata["choices"] = tuple(choices)
    return field(default=default, metadata=metadata, **field_kwargs)


def option_range(f) -> Range | None:
    """The range a field of an options dataclass declares (None: not a ranged option)."""
    return f.metadata.get("range")


@dataclass
class MethodOptions:
    """Base of every method's options: a value outside its field's `choices` is refused when the options are
    made, by name (a typo in a config or a test fails here, not steps into a run)."""

    def __post_init__(self):
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"method.{f.name}: {getattr(self, f.name)!r} is not one of {', '.join(choices)}")

    @classmethod
    def saved(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The options an export's pretrieve_head.json records, as this version reads them: a method whose
        defaults changed maps what an older export left out to what it trained with."""
        return values


def option_range_problems(options: Any, where: str) -> list[str]:
    """One message per option outside its range."""
    problems = []
    for f in fields(options):
        value, valid = getattr(options, f.name), option_range(f)
        if valid is not None and value is not None and value not in valid:
            problems.append(f"{where}.{f.name}: must be {valid}, got {value!r}")
    return problems


def no_flops(options: Any, config, batch: dict[str, torch.Tensor]) -> int:
    return 0


# flops(options, hf_config, batch) -> int: FLOPs on one micro-batch
Flops = Callable[[Any, Any, dict], int]


@dataclass(frozen=True)
class Method:
    name: str
    head: type  # a PretrainingHead subclass
    collator: type  # a collator class with `from_options` (pretrieve.data.collators.MLMCollator's subclasses)
    options: type  # a MethodOptions dataclass; its defaults are the paper's settings
    flops: Flops  # forward FLOPs of the head beyond the encoder's (decoders, projections; engine/flops.py)
    no_backward_flops: Flops = no_flops  # the part of `flops` whose backward does no matmul (a gather instead)
    # the pooling the method's export is fine-tuned and evaluated with (`pretrieve eval --pooling`): "cls" where
    # the method trains its [CLS] vector as the text's representation, "dupmae" / "sparse" for the vocabulary
    # ones (lexmae's model card says so); None: none of its own, the export's (the sentence-transformers vector)
    eval_pooling: str | None = None
    # its place among the method study's arms (study/plan.py: its tables and plots in this order, the cpu study
    # ran the first six, the GPU check's ladder measures those after them); None: not an arm
    study_arm: int | None = None
    # overrides of a run on a tiny model (the method study's arms): what a paper-sized run needs and such a
    # model does not (coCondenser's GradCache: without it, the one-graph loss, each span encoded once)
    tiny_overrides: tuple[str, ...] = ()
    # overrides of a BERT-base run (the GPU check's speed ladder) to train as the paper does where the options'
    # defaults leave it out (coCondenser's GradCache)
    paper_overrides: tuple[str, ...] = ()

    def options_from(self, values: dict[str, Any] | None = None, where: str = "method") -> Any:
        """Options with `values` over the defaults; an unknown key or a value out of range is a ConfigError
        naming it (each of them, when there are several)."""
        from pretrieve.utils.options import Problems, options_of

        values = dict(values or {})
        values.pop("name", None)
        problems = Problems()  # an unknown key does not hide a value out of range: each is reported
        options = options_of(self.options, values, where, noun=f"option of method {self.name!r}", problems=problems)
        for message in option_range_problems(options, where) if options is not None else ():
            problems.add(message)
        problems.raise_any()
        return options

    def build(self, options: Any, model: ModelOptions, seed: int = 0):
        """The head on a new encoder (random init from `seed`, or `model.init_from`)."""
        torch.manual_seed(seed)
        head = self.head(Encoder.build(model), options)
        if model.init_from:
            head.load_extra_weights(model.init_from, self.name)
        if model.lora.r:  # after the head: its new weights (decoders, projections) are not frozen
            add_lora(head.encoder.model, model.lora)
            if head.encoder.lm_head is not None:  # an untied LM head stays the checkpoint's, as tied embeddings do
                head.encoder.lm_head.requires_grad_(False)
        return head


METHODS: dict[str, Method] = {}


def register_method(name: str, head: type, collator: type, options: type, *, flops: Flops,
                    no_backward_flops: Flops = no_flops, eval_pooling: str | None = None,
                    study_arm: int | None = None, tiny_overrides: tuple[str, ...] = (),
                    paper_overrides: tuple[str, ...] = ()) -> Method:
    """Make method `name` known to configs, training, FLOPs counting, export and the method study; its head file
    calls this."""
    if name in METHODS:
        raise ValueError(f"method {name!r} registered twice")
    taken = {m.study_arm: m.name for m in METHODS.values() if m.study_arm is not None}
    if study_arm is not None and study_arm in taken:
        raise ValueError(f"method {name!r}: study arm {study_arm} is {taken[study_arm]!r}'s")
    METHODS[name] = Method(name, head, collator, options, flops, no_backward_flops, eval_pooling, study_arm,
                           tuple(tiny_overrides), tuple(paper_overrides))
    return METHODS[name]


def unregister_method(name: str) -> None:
    """Forget method `name` (a method registered for a while, such as a test's)."""
    del METHODS[name]


def study_arms() -> list[Method]:
    """The methods that are arms of the method study, in their order (`study_arm`)."""
    return sorted((m for m in METHODS.values() if m.study_arm is not None), key=lambda m: m.study_arm)


def get_method(name: str) -> Method:
    """The method registered as `name`. The built-in ones are registered by the time this module can be used:
    importing it runs the package's __init__.py first, which imports every method's file."""
    if name not in METHODS:
        raise KeyError(f"method {name!r} is not registered (known: {', '.join(sorted(METHODS))})")
    return METHODS[name]
