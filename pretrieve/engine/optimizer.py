"""Which AdamW steps the weights (`train.optimizer`).

  deepspeed    the ds_config's "optimizer" section: DeepSpeed builds it (ds_configs/: torch's AdamW, "torch_adam":
               true, the multi-tensor foreach kernels on a GPU)
  torch-fused  torch.optim.AdamW(fused=True), one fused kernel for all the step's tensors, built here with the
               section's own settings (lr, betas, eps, weight_decay) and handed to deepspeed.initialize as the
               client optimizer; the section is removed, so the two never both apply
  auto         deepspeed (until the GPU ladder has measured them)

Both see the same parameters in one group, as DeepSpeed's path always did (`model_parameters`: every trainable
one; biases and norms decay too), and DeepSpeed wraps either the same way: the train.lr_schedule drives the
optimizer it is given, gradient clipping stays DeepSpeed's (but where the loop clips, below), and under bf16 (or
ZeRO) the optimizer steps the fp32 master weights (or partitions) that DeepSpeed's wrapper made, the one copy
either path has: the client optimizer holds the module's parameters only until the wrapper replaces them by its
masters. Gradient
accumulation sums into DeepSpeed's gradient buffers, whichever optimizer then steps. Its state (exp_avg,
exp_avg_sq, step) is torch's AdamW state in both, saved in every checkpoint; a run resumes with the optimizer it
was written with (resume_check refuses a change of train.optimizer).

With torch-fused at ZeRO 0 and no fp16/bf16 wrapper (train.precision fp32 or bf16-autocast), the gradients are
the module's own, and the training loop clips them with torch's foreach `clip_grad_norm_` (a few kernels for all
of them) instead of DeepSpeed, whose clipping takes a norm and scales a gradient at a time: two kernel launches
a parameter, which a GPU step bound by its host's launches pays in full (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

from pretrieve.utils.options import ConfigError

# keys of a ds_config AdamW section that tell DeepSpeed which implementation to build, not how it steps
_DEEPSPEED_KEYS = ("torch_adam", "adam_w_mode", "foreach", "fp32_optimizer_states")
DEEPSPEED_CLIP = 1.0  # deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT: a ds_config without the key clips


def resolve(name: str) -> str:
    """The optimizer `name` stands for (auto: deepspeed)."""
    return "deepspeed" if name == "auto" else name


def clip_in_loop(train, ds_config: dict) -> float | None:
    """The max norm the training loop clips the gradients to, taken out of `ds_config` (DeepSpeed then clips
    nothing), where torch-fused steps the module's own gradients (ZeRO 0, no fp16/bf16 wrapper); None: DeepSpeed
    clips, in its wrapper or its ZeRO buffers, as the ds_config says."""
    wrapped = any(ds_config.get(name, {}).get("enabled", False) for name in ("bf16", "fp16"))
    if resolve(train.optimizer) != "torch-fused" or wrapped or ds_config.get("zero_optimization", {}).get("stage", 0):
        return None
    clip = ds_config.get("gradient_clipping", DEEPSPEED_CLIP)
    ds_config["gradient_clipping"] = 0.0  # an absent key would clip to DeepSpeed's default
    return clip or None


def client_optimizer(train, ds_config: dict, parameters: list) -> torch.optim.Optimizer | None:
    """The optimizer to hand to deepspeed.initialize, or None for the ds_config's own. For torch-fused, the
    ds_config's AdamW section is taken out of `ds_config` and built as torch's fused AdamW over `parameters`."""
    if resolve(train.optimizer) == "deepspeed":
        return None
    section = ds_config.pop("optimizer", None) or {}
    if str(section.get("type", "")).lower() != "adamw":
        raise ConfigError(f"train.optimizer: {train.optimizer} builds AdamW from the DeepSpeed config's \"optimizer\" "
                          f"section (type AdamW and its params), which has type {section.get('type')!r}")
    settings = {key: value for key, value in section.get("params", {}).items() if key not in _DEEPSPEED_KEYS}
    if "betas" in settings:
        settings["betas"] = tuple(settings["betas"])
    return torch.optim.AdamW(parameters, **settings, fused=True)
