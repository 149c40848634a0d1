"""Analytic FLOPs of one training micro-batch (encoder + head) and model FLOPs utilisation (MFU).

A micro-batch's forward pass costs the shared encoder's FLOPs (models/flops.py: the matmuls, on the shapes the
hardware computes) plus its method's: the `flops` its head file registers (a decoder, a projection; 0 for mlm).
A training step costs 3x the forward pass (backward: gradients for activations and for weights), less twice the
forward FLOPs the method registers as `no_backward_flops`, whose backward is no matmul (DupMAE's projection of
every position to the vocabulary: each entry's gradient goes to its winning position, models.vocab_projection).
Under LoRA the base model's weights are frozen: 2x the forward, plus the attention scores' second backward
matmul, less the first layer's Q, K, V backward (their input, the frozen embeddings, needs no gradient), plus
3x the adapters' forward. The head's own matmuls (a decoder, a projection) are counted as frozen too: an
undercount where a head trains a matmul of its own (RetroMAE's decoder), exact for llama2vec and mntp.
tests/test_flops.py checks these against DeepSpeed's flops profiler.
"""

from __future__ import annotations

import re
import time

import torch

from pretrieve.models.flops import adapter_flops, attention_flops, encoder_flops, first_projections_flops
from pretrieve.models.heads.registry import Method

# Dense peak FLOP/s per GPU for MFU, from the vendors' data sheets: tensor cores without sparsity for bf16/fp16,
# plain FP32 for fp32 (PyTorch does not use TF32 for matmuls by default). The first pattern matching
# torch.cuda.get_device_name wins: the PCIe and NVL parts of H100 before the SXM part, whose names carry
# neither ("NVIDIA H100 80GB HBM3"); A10 as a whole word (not A100, not A10G, another part).
GPU_PEAKS = [
    (r"H100.*(PCIE|PCIe)", "H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    (r"H100.*NVL", "H100 NVL", {"bf16": 835e12, "fp16": 835e12, "fp32": 60e12}),
    (r"H100", "H100 SXM", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"H200", "H200", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (r"A100", "A100", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
    (r"L40S", "L40S", {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12}),
    (r"\bA10\b", "A10", {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12}),
    # Turing: no bf16; fp16 tensor cores at the fp32 accumulation PyTorch's matmuls use (the Turing whitepaper's
    # reference-clock figure; fp16 accumulation would double it)
    (r"2080 Ti", "RTX 2080 Ti", {"bf16": None, "fp16": 53.8e12, "fp32": 13.4e12}),
]


def forward_flops(method: Method, options, config, batch: dict[str, torch.Tensor]) -> int:
    """Forward FLOPs of `method`'s head (its registry entry; options: its options; config: the encoder's
    BertConfig) on `batch`."""
    return encoder_flops(config, batch) + method.flops(options, config, batch)


def train_flops(method: Method, options, config, batch: dict[str, torch.Tensor],
                adapters: tuple[int, int] | None = None) -> int:
    """Forward + backward FLOPs of one micro-batch: 3x the forward, less the backward the method's
    `no_backward_flops` does without a matmul. With LoRA `adapters` (rank, in + out features of the adapted
    layers: models/lora.py's adapter_shape), a frozen weight gets no gradient: its matmul costs 2x its forward
    (the input's gradient), the attention scores still 3x, the adapters 3x theirs. `method`: its registry entry,
    as a recipe holds it (`Experiment.method`)."""
    no_backward = method.no_backward_flops(options, config, batch)
    return with_backward(forward_flops(method, options, config, batch), config, batch, adapters, no_backward)


def with_backward(forward: int, config, batch: dict[str, torch.Tensor], adapters: tuple[int, int] | None = None,
                  no_backward: int = 0) -> int:
    """Forward + backward FLOPs from the `forward` FLOPs of the encoder's passes over `batch` (the module
    docstring's rule; `adapters`: LoRA's, as in train_flops)."""
    if adapters is None:
        return 3 * forward - 2 * no_backward
    return (2 * forward + attention_flops(config, batch) - first_projections_flops(config, batch)
            + 3 * adapter_flops(*adapters, batch) - no_backward)  # a no-matmul backward: 2x less 1x


def measured_cpu_peak(size: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` fp32 size x size matmuls with torch's threads: the CPU's MFU peak. Every CPU
    run measures it at start-up: 1024 is within 3 % of 2048's peak on a 2-core machine, in 0.4 s instead of 2.8."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: a resumed run must replay its dropout
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def matmul_precision(precision: str) -> str:
    """The precision the matrix products of a train.precision run at (bf16-autocast: bf16), for its peak."""
    return "bf16" if precision == "bf16-autocast" else precision


def gpu_peak(name: str, precision: str) -> tuple[str, float] | None:
    """(part, peak FLOP/s) of the GPU called `name` (torch.cuda.get_device_name) at `precision`; None when the
    name is not in GPU_PEAKS, (part, None) at a precision the part does not compute (bf16 on a Turing GPU)."""
    for pattern, part, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            return part, peaks[matmul_precision(precision)]
    return None


def device_peak(device: torch.device, precision: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device at `precision`: `override` (train.peak_flops) when given, else the table for
    known GPUs (None for another GPU: MFU is then left out, not guessed), a measured matmul on CPU."""
    if override is not None:
        return override
    if device.type == "cpu":
        return measured_cpu_peak()
    known = gpu_peak(torch.cuda.get_device_name(device), precision)
    return None if known is None else known[1]
