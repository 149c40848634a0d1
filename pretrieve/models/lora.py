"""LoRA (Hu et al. 2022, eq. 3: h = W0 x + (alpha / r) B A x) on the base model of an encoder, through peft:
`model.lora.r > 0` injects a rank-r adapter beside each adapted linear layer and freezes the base model's own
weights; the adapters and the head's new weights (MLM bias, decoders, projections) train.

The adapted model keeps peft's module layout (`q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`), which
checkpoints hold as they are; `pretrieve export` rebuilds the same layout, loads the checkpoint, then folds each
adapter into its layer (W0 + (alpha / r) B A: a plain HF model again) or, with `model.lora.keep_adapter`, writes
the base weights and the adapter apart, the adapter in peft's own files under `adapter/`
(`PeftModel.from_pretrained(AutoModel.from_pretrained(out), out / "adapter")`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from torch import nn

from pretrieve.utils.options import ConfigError

ADAPTER_DIR = "adapter"  # in an export with model.lora.keep_adapter: peft's adapter_config.json and weights
_PEFT_PREFIX = "base_model.model."  # the keys of peft's adapter files, as PeftModel.save_pretrained writes them


@dataclass
class LoraOptions:
    """`model.lora:`; r = 0 (the default) trains every weight."""

    r: int = 0  # the adapters' rank
    alpha: float = 16.0  # the update is scaled by alpha / r
    dropout: float = 0.05  # on an adapter's input
    # the linear layers to adapt: names or their last parts (q_proj, v_proj); null: every linear layer of the
    # base model but a [CLS] pooler's, which pre-training does not use
    targets: list[str] | None = None
    keep_adapter: bool = False  # export the base weights and the adapter apart, instead of merged

    def __post_init__(self):
        problems = [f"model.lora.{key}: {why}" for key, bad, why in (
            ("r", self.r < 0, f"must be >= 0 (0: no LoRA), got {self.r}"),
            ("alpha", not self.alpha > 0, f"must be > 0, got {self.alpha}"),
            ("dropout", not 0 <= self.dropout < 1, f"must be in [0, 1), got {self.dropout}"),
            ("targets", self.targets is not None and not self.targets, "empty: null adapts every linear layer"))
            if bad]
        if problems:
            raise ConfigError("; ".join(problems), problems)


def lora_options(values: dict, where: str) -> LoraOptions:
    """A config's mapping as LoraOptions, each error naming its key under `where` (`finetune.lora`; the checks
    themselves name `model.lora`, the pre-training section)."""
    from pretrieve.utils.options import options_of

    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of r, alpha, dropout, targets, keep_adapter; got {values!r}")
    try:
        return options_of(LoraOptions, values, where)
    except ConfigError as e:
        named = [where + problem.removeprefix("model.lora") if problem.startswith("model.lora") else problem
                 for problem in e.problems]
        raise ConfigError("; ".join(named), named) from None


def settings_without_lora(values, where: str) -> list[str]:
    """The errors of a `lora:` mapping whose r is 0 (no LoRA: every weight trains) but which sets the adapters'
    other keys: they would do nothing, so each is refused by name. A config switches LoRA off with `lora: null`
    or `r: 0` alone."""
    if not isinstance(values, dict) or values.get("r", 0) != 0:
        return []
    return [f"{where}.{key}: set, but {where}.r is 0: no LoRA, every weight of the model trains; give "
            f"{where}.r > 0 for adapters, or leave {key} out ({where}=null: no LoRA)"
            for key in sorted(values) if key != "r" and key in {f.name for f in fields(LoraOptions)}]


def no_adapter(run_dir: Path, key: str) -> str:
    """The error of `pretrieve export --keep-adapter` on a run without LoRA (`key`: its section's lora)."""
    return (f"--keep-adapter: {run_dir} trained without LoRA ({key}.r is 0): it has no adapter to keep apart; "
            "leave the flag out")


def add_lora(model: nn.Module, options: LoraOptions, where: str = "model.lora") -> int:
    """Inject the adapters into `model` (an HF base model) in place, and freeze every other weight of it;
    returns the number of adapter parameters. A target that names no layer of the model is an error naming the
    key (`where`.targets), also beside targets that do."""
    from peft import LoraConfig, inject_adapter_in_model

    if options.targets:  # peft adapts the targets it finds and drops the others without a word
        names = [name for name, _ in model.named_modules()]
        missing = [t for t in options.targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"{where}.targets: {missing} adapt no layer of this model (its linear layers: "
                             f"{', '.join(linear)})")
    targets = options.targets or sorted(name for name, module in model.named_modules()
                                        if isinstance(module, nn.Linear) and not name.startswith("pooler."))
    config = LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout, target_modules=targets,
                        bias="none")
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(f"{where}.targets: {options.targets} adapt no layer of this model (its linear layers: "
                         f"{', '.join(linear)}): {e}") from None
    for name, param in model.named_parameters():  # peft freezes the rest already; said here, where it is relied on
        param.requires_grad_(".lora_" in name)
    return sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)


def has_lora(model: nn.Module) -> bool:
    return any(_is_lora_layer(m) for m in model.modules())


def unadapt_for_saving(model: nn.Module, out: Path, keep_adapter: bool) -> None:
    """Before `model` is saved to `out`: its adapters folded into their layers, or written apart to `out`/adapter/
    (the base weights then saved as they were); nothing without adapters."""
    if has_lora(model):
        if keep_adapter:
            save_adapter_apart(model, out)
        else:
            merge_lora(model)


def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its layer's weight (W0 + (alpha / r) B A) and put the plain layer back: `model`
    has its HF layout again, and computes what the adapted model computed (up to rounding)."""
    for parent, name, layer in _lora_layers(model):
        layer.merge(safe_merge=True)  # safe: refuses a merge that makes NaNs
        setattr(parent, name, layer.get_base_layer())
    _forget_peft_config(model)


def save_adapter_apart(model: nn.Module, out: Path) -> None:
    """Write the adapters to `out`/adapter/ in peft's files and put the plain (unmerged) layers back."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    config = model.peft_config["default"]
    state = get_peft_model_state_dict(model)
    folder = out / ADAPTER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    save_file({_PEFT_PREFIX + key: value.detach().contiguous() for key, value in state.items()},
              str(folder / "adapter_model.safetensors"))
    for parent, name, layer in _lora_layers(model):
        setattr(parent, name, layer.get_base_layer())
    _forget_peft_config(model)


def merge_saved_adapter(model: nn.Module, path: Path) -> nn.Module:
    """`model` with the adapter an export kept apart (`path`/adapter/) folded in; `model` itself when it has none."""
    if not (path / ADAPTER_DIR / "adapter_config.json").is_file():
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path / ADAPTER_DIR)).merge_and_unload()


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _lora_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, adapted layer) of each adapted layer, listed before any is replaced."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _is_lora_layer(child):
                found.append((parent, name, child))
    return found


def _forget_peft_config(model: nn.Module) -> None:
    """peft leaves its config on the model; a plain model saved with it would carry a stale adapter config."""
    if hasattr(model, "peft_config"):
        del model.peft_config


def trained_summary(module: nn.Module, rank: int) -> str:
    """The line a LoRA run prints at its start: what trains and what is frozen."""
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    return (f"pretrieve: LoRA r={rank}: {trained:,} weights train (adapters and the head's own), {frozen:,} of the "
            "base model are frozen")


def lora_input_width(model: nn.Module) -> int:
    """The input features of every adapted layer together (what adapter dropout copies, per token)."""
    return sum(layer.in_features for _, _, layer in _lora_layers(model))


def adapter_shape(model: nn.Module) -> tuple[int, int] | None:
    """(rank, in + out features of every adapted layer together) for engine/flops.py; None without LoRA."""
    layers = [layer for _, _, layer in _lora_layers(model)]
    if not layers:
        return None
    return layers[0].r["default"], sum(layer.in_features + layer.out_features for layer in layers)
