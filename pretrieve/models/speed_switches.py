"""The speed switches in one table: the config keys that change how fast a training step runs (or how much memory
it holds), not what it computes, each with its check, what applies it, its place in the one order, and its rung on
the speed ladder (benchmarks/throughput_ladder.py). Composer keeps its algorithms' passes and their order in one
place the same way (composer/core/passes.py).

  check    the problems a config has with the key, each naming it: config.run_sections checks train's keys here
           (`check_train`) for every kind of experiment, pretrain_config.experiment a pre-training's model and
           method
  apply    a pass on the module the engine trains (a pre-training head, a fine-tuning model), run by the engine
           (`apply_switches`) when the key is on; or none, where the switch is no pass: `read_by` says what
           reads the key (the engine's DeepSpeed config, the optimizer, the encoder when it is built)
  place    the row's place in the table: the engine applies the passes in it, and the ladder climbs the rungs in
           it. Activation checkpointing first, then the LayerNorms swapped, then compile: the compiled layers
           hold the swapped norms; the CUDA graphs last, capturing the step all of them make. The rungs: first
           what the host pays every step (the optimizer's bf16 wrapper), then what the device pays every step
           (the norms, the loss, the optimizer), then what removes work (padding), then the compiler
  rung     (name, overrides) that the ladder adds on top of the rungs before it; `baseline`: the key's value on
           the ladder's first rung; `alternatives`: rungs measured once on top of the whole ladder

A new switch is its option's field, its pass, its row here (`register_switch`), its docs row and its test
(docs/design.md, "Add a speed switch"; tests/test_toy_switch.py).

The checks and passes import what they use when called: the ladder reads the table in a Python that may have
neither torch nor the package's dependencies yet (benchmarks/gpu_job.py plans a GPU job before its install stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from pretrieve.utils.options import Problems


@dataclass(frozen=True)
class Rung:
    """A rung of the speed ladder: its name and the config overrides it sets."""

    name: str
    overrides: tuple[str, ...]
    methods: tuple[str, ...] = ()  # an alternative's methods (empty: every method)


@dataclass(frozen=True)
class Settings:
    """The sections a check reads (None: not checked in this call) and the engine's passes: `train` (TrainOptions),
    `model` (ModelOptions), `method` (the registered Method) and `options` (its options: the `method.` keys)."""

    train: Any = None
    model: Any = None
    method: Any = None
    options: Any = None


@dataclass(frozen=True)
class Switch:
    """A row of the table (the module's docstring says what each column holds)."""

    key: str  # section.option: train., model. or method.
    check: Callable[[Any, Settings], Iterable[str]] | None  # (the key's value, the sections) -> problems
    apply: Callable[[nn.Module, Any], Any] | None = None  # (module, value), when the value is neither None nor False
    read_by: str = ""  # without `apply`: what reads the key
    baseline: str | None = None  # the key's value on the ladder's baseline rung (None: not set there)
    rung: Rung | None = None
    alternatives: tuple[Rung, ...] = ()

    def section(self, settings: Settings) -> Any:
        """The options the key is a field of in `settings` (None: not given): `method.` keys are the options'."""
        section = self.key.split(".", 1)[0]
        return getattr(settings, "options" if section == "method" else section)

    def value(self, settings: Settings) -> Any:
        """The key's value in `settings`; None where its section is not given (or has no such option)."""
        return getattr(self.section(settings), self.key.split(".", 1)[1], None)


def _precision(value: str, _: Settings) -> Iterator[str]:
    from pretrieve.config import PRECISIONS

    if value not in PRECISIONS:
        yield f"train.precision: {value!r} is not one of {', '.join(PRECISIONS)}"


def _low_precision_norm(on: bool, s: Settings) -> Iterator[str]:
    if on and s.train.precision != "bf16-autocast":
        yield (f"train.low_precision_norm: changes only a train.precision bf16-autocast run (its norms run in fp32 "
               f"there), not {s.train.precision}: set train.precision=bf16-autocast or remove it")


def _vocab_loss(value: str, s: Settings) -> Iterator[str]:
    from pretrieve.models.vocab_loss import vocab_loss_problem

    if (problem := vocab_loss_problem(value)) is not None:
        yield problem
    if s.method is not None and value != "auto" and not s.method.head.predicts_tokens:
        yield (f"model.vocab_loss: {value}, but method {s.method.name} computes no vocabulary loss (it sets how "
               "the methods that predict tokens compute theirs): leave it out")


def _optimizer(value: str, _: Settings) -> Iterator[str]:
    from pretrieve.config import OPTIMIZERS

    if value not in OPTIMIZERS:
        yield f"train.optimizer: {value!r} is not one of {', '.join(OPTIMIZERS)}"


def _unpad(on: bool, s: Settings) -> Iterator[str]:
    from pretrieve.models.backbones import UNPADDING, backbone_named

    if not on or s.model.init_from:  # init_from's family: Encoder.enable_unpadding refuses it when built
        return
    try:
        backbone = backbone_named(s.model.backbone)
    except ValueError:  # pretrain_config.py names the unknown backbone
        return
    if not backbone.unpads:
        yield f"model.unpad: the {s.model.backbone} backbone has no unpadded path ({UNPADDING} have)"


CROSS_SECTION = ("train.static_shapes",)  # train keys whose checks read the model and method too (pretrain_config)


def _static_shapes(on: bool, s: Settings) -> Iterator[str]:
    if on and s.model is not None and s.model.unpad:
        yield ("train.static_shapes: model.unpad packs each batch's texts into a row as long as their tokens, a "
               "shape that changes every step; set one of them to false")
    if on and s.method is not None and "static_shapes" not in getattr(s.method.collator, "__dataclass_fields__", {}):
        yield (f"train.static_shapes: method {s.method.name}'s collator pads its batches its own way (only those "
               "built on the MLM collator take it); leave it out")


def _compile(on: bool, s: Settings) -> Iterator[str]:
    if on and s.train.zero_stage == 3:  # measured on CPU: the recompile limit hit at the first step
        yield ("train.compile: ZeRO 3 gathers each layer's parameters by hooks inside it, on which torch.compile "
               "recompiles layer after layer until its limit, then runs them eager; use train.zero_stage 0, 1 or 2")


def _cuda_graphs(on: bool, s: Settings) -> Iterator[str]:
    """What a captured step cannot hold (engine/cuda_graphs.py says why each); the device, the world and the
    module (model.unpad, a loss schedule) are checked at start-up."""
    if not on:
        return
    t = s.train
    if not getattr(t, "static_shapes", False):  # a field of TrainOptions where the padded batches exist
        yield ("train.cuda_graphs: a graph replays the shapes it captured: needs train.static_shapes=true (each batch "
               "padded to max_len and its labelled positions to a fixed count, no reads of the device in the step)")
    if t.grad_accum != 1:
        yield f"train.cuda_graphs: needs train.grad_accum=1, got {t.grad_accum} (the graph writes each gradient anew)"
    if t.precision not in ("fp32", "bf16-autocast"):
        yield (f"train.cuda_graphs: train.precision {t.precision} steps through DeepSpeed's wrapper, which checks the "
               "gradients on the host: use bf16-autocast or fp32")
    if t.zero_stage != 0:
        yield (f"train.cuda_graphs: needs train.zero_stage 0, got {t.zero_stage} (ZeRO's hooks partition and reduce "
               "the gradients inside backward)")
    if t.activation_checkpointing:
        yield ("train.cuda_graphs: train.activation_checkpointing restores the device's random state to recompute "
               "each layer in backward, which a graph capture does not allow: leave one of them out")


def _attention_impl(value: str | None, _: Settings) -> Iterator[str]:
    from pretrieve.kernels import fused_problem

    if value == "fused" and (problem := fused_problem()) is not None:  # the method's own option checks the name
        yield problem


def _checkpoint_activations(module: nn.Module, _: bool) -> None:
    """HF activation checkpointing in the module's own model: a head's or a dual encoder's encoder, a
    cross-encoder's classifier (a second model inside a head, SimLM's generator, keeps its activations)."""
    from pretrieve.models.encoder import Encoder, checkpoint_activations

    encoder = getattr(module, "encoder", None)
    checkpoint_activations(encoder.model if isinstance(encoder, Encoder) else module.model)



def _lower_norm_precision(module: nn.Module, _: bool) -> None:
    from pretrieve.models.low_precision_norm import lower_norm_precision

    lower_norm_precision(module)


def _compile_layers(module: nn.Module, _: bool) -> None:
    from pretrieve.models.regional_compile import compile_layers

    compile_layers(module)


_SWITCHES: list[Switch] = [
    Switch("train.activation_checkpointing", None, _checkpoint_activations),
    # bf16 steps through DeepSpeed's bf16 wrapper: fp32 masters and checks a parameter at a time, most of the step's
    # kernel launches. Under autocast the module keeps fp32 weights and no wrapper is built
    Switch("train.precision", _precision, read_by="the engine: DeepSpeed's config (engine/ds_config.py)",
           rung=Rung("autocast", ("train.precision=bf16-autocast",))),
    # autocast runs each LayerNorm in fp32, and with it the residual stream, its adds and dropouts
    Switch("train.low_precision_norm", _low_precision_norm, _lower_norm_precision,
           rung=Rung("lp-norm", ("train.low_precision_norm=true",))),
    # plain: bf16 F.linear + cross-entropy on the masked positions; liger replaces it, measured on top of the ladder
    Switch("model.vocab_loss", _vocab_loss, read_by="the encoder's token loss (models/vocab_loss.py)",
           baseline="chunked", rung=Rung("vocab-plain", ("model.vocab_loss=plain",)),
           alternatives=(Rung("vocab-liger", ("model.vocab_loss=liger",), methods=("mlm", "retromae")),)),
    Switch("train.optimizer", _optimizer, read_by="the engine: the optimizer it hands DeepSpeed (engine/optimizer.py)",
           baseline="deepspeed", rung=Rung("fused-adamw", ("train.optimizer=torch-fused",))),
    # varlen attention, no compute on padding
    Switch("model.unpad", _unpad, read_by="the encoder, when built (Encoder.enable_unpadding)", baseline="false",
           rung=Rung("unpad", ("model.unpad=true",))),
    # regional torch.compile of each layer, after every pass that changes the layers
    Switch("train.compile", _compile, _compile_layers, baseline="false",
           rung=Rung("compile", ("train.compile=true",))),
    # the step's forward and backward replayed as one CUDA graph: the host's launches gone, on padded batches of one
    # shape (unpadding off), measured on top of the ladder
    Switch("train.cuda_graphs", _cuda_graphs, read_by="the engine's loop: the step captured and replayed "
           "(engine/cuda_graphs.py)", alternatives=(Rung("cuda-graphs", (
               "model.unpad=false", "train.static_shapes=true", "train.cuda_graphs=true")),)),
    # one set of tensor shapes for every step (the CUDA graphs need it): padding costs again (unpad is refused with
    # it). Measured on top of the ladder without the graph, what the cuda-graphs rung gains against, not as a rung
    # of it: alone it removes no work, so the ladder's top stays unpadded
    Switch("train.static_shapes", _static_shapes,
           read_by="the method's collator, when the job builds it (data/collators.py, MLMCollator)",
           alternatives=(Rung("static-shapes", ("train.static_shapes=true", "model.unpad=false"), methods=("mlm",)),)),
    # the fused two-stream kernel has no attention dropout: it changes what is computed, measured on top of the ladder
    Switch("method.attention_impl", _attention_impl, read_by="the two-stream decoder of retromae and dupmae (kernels/)",
           alternatives=(Rung("decoder-fused", ("method.attention_impl=fused", "method.decoder_attention_dropout=0"),
                              methods=("retromae", "dupmae")),)),
]


def switches() -> tuple[Switch, ...]:
    """The switches in their one order."""
    return tuple(_SWITCHES)


def register_switch(switch: Switch, after: str) -> Switch:
    """Add `switch` to the table right after the switch of key `after` (its place in the one order)."""
    keys = [s.key for s in _SWITCHES]
    if switch.key in keys:
        raise ValueError(f"speed switch {switch.key} is registered already")
    if after not in keys:
        raise ValueError(f"speed switch {switch.key}: after {after!r}, which is no switch ({', '.join(keys)})")
    names = {r.name for s in _SWITCHES for r in (s.rung, *s.alternatives) if r is not None}
    if taken := names & {r.name for r in (switch.rung, *switch.alternatives) if r is not None}:
        raise ValueError(f"speed switch {switch.key}: rung {', '.join(sorted(taken))} is another switch's")
    _SWITCHES.insert(keys.index(after) + 1, switch)
    return switch


def unregister_switch(key: str) -> None:
    _SWITCHES[:] = [s for s in _SWITCHES if s.key != key]


def check_switches(problems: Problems, keys: Iterable[str] | None = None, **sections: Any) -> None:
    """Add to `problems` what each switch's check finds in `sections` (Settings' fields), in the table's order; a
    switch whose section is not given is not checked. `keys`: only those switches (a check across sections, run
    once they are all read)."""
    settings = Settings(**sections)
    for switch in _SWITCHES:
        if keys is not None and switch.key not in keys:
            continue
        if switch.check is not None and switch.section(settings) is not None:
            for problem in switch.check(switch.value(settings), settings):
                problems.add(problem)


def check_train(train: Any, problems: Problems) -> None:
    """The checks of the switches among train's keys, as config.run_sections calls them (the run level sits on
    the floor below this table)."""
    check_switches(problems, train=train)


def apply_switches(module: nn.Module, settings: Settings) -> list[str]:
    """Run the pass of each switch that is on in `settings` on `module`, in the table's order; the keys applied."""
    applied = []
    for switch in _SWITCHES:
        value = switch.value(settings)
        if switch.apply is not None and value is not None and value is not False:
            switch.apply(module, value)
            applied.append(switch.key)
    return applied
