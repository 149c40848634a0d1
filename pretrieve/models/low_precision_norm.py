"""Low-precision LayerNorm (`train.low_precision_norm`): under bf16 autocast, every `nn.LayerNorm` of a module
normalises in bf16, as MosaicBERT trained (Portes et al. 2023; Composer's LowPrecisionLayerNorm).

Why: autocast runs `layer_norm` in fp32, so in a post-norm encoder (BERT, RoBERTa, XLM-R) each norm's output,
and with it the residual stream, the residual adds and the dropouts, are fp32 tensors, cast back to bf16 before
every product, which made the bare BERT-base step under autocast slower than the same step with bf16 weights on
a GPU (docs/benchmarks.md, "Three H200 jobs", has the numbers). Here the norm's input, weight and bias are cast to autocast's dtype and
it runs with autocast off: its statistics still accumulate in fp32 inside the kernel (CUDA and CPU alike), its
output is bf16. Outside autocast (fp32 runs, bf16 weights) the norm is the plain one, bit for bit.

The swap keeps each norm's parameters (the same tensors), so the state dict, the checkpoints, the export and
what the optimizer steps are unchanged; only the module's class differs while training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowPrecisionLayerNorm(nn.LayerNorm):
    """nn.LayerNorm that, under autocast, normalises in autocast's dtype instead of fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        weight = None if self.weight is None else self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


def lower_norm_precision(module: nn.Module) -> int:
    """Swap each nn.LayerNorm in `module` for a LowPrecisionLayerNorm holding the same parameters; how many.
    Refuses a module without one (a decoder LLM's RMSNorms), where the switch would change nothing unseen."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.LayerNorm:  # subclasses (and RMSNorms) keep their own forward
                continue
            low = LowPrecisionLayerNorm(child.normalized_shape, eps=child.eps,
                                        elementwise_affine=child.elementwise_affine, bias=child.bias is not None,
                                        device="meta")
            low.weight, low.bias = child.weight, child.bias
            low.train(child.training)
            setattr(parent, name, low)
            swapped += 1
    if not swapped:
        raise ValueError(f"train.low_precision_norm: {type(module).__name__} has no nn.LayerNorm to run in bf16 "
                         "(RMSNorms keep their own precision); remove it")
    return swapped
