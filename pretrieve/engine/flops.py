"""Analytic FLOPs of one training micro-batch (encoder + head) and model FLOPs utilisation (MFU).

Counted: the matrix multiplications, 2 FLOPs per multiply-accumulate, on the shapes the hardware computes
(padded batch x length, dense attention scores, masked entries included). Not counted: embeddings lookups,
LayerNorm, softmax, activations, losses (a few % at BERT sizes). A training step costs 3x the forward pass
(backward: gradients for activations and for weights). Formulas, with h = hidden, f = FFN width, V = vocab:

    layer(B, q, k)  = 2 B (q (2 h^2 + 2 h f) + k 2 h^2 + 2 q k h)   Q, O and FFN on q query positions,
                                                                    K and V on k key positions, QK^T and PV
    encoder         = n_layers x layer(B, L, L) + pooler 2 B h^2 + vocab(masked positions)
    vocab(P)        = 2 P (h^2 + h V)                                  BERT's MLM transform + tied decoder

and per method, on top of the encoder: retromae + layer(B, L, L) + vocab(decoder targets); dupmae: retromae
+ vocab(B L), the OT projection of every position (eq. 6), whose 2 B L h V projection has no backward
matmul (each vocabulary entry's gradient goes to its winning position: models.vocab_projection); seed,
cotmae, cotmote: decoder_layers x layer(B, L_dec, L_dec) + vocab(decoder targets); costa: the projector
4 B h^2 (its contrastive matrix, anchors x candidates x h, is left out); mlm: the encoder alone.
tests/test_flops.py checks these against DeepSpeed's flops profiler.
"""

from __future__ import annotations

import re
import time

import torch

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
]


def layer_flops(config, batch: int, queries: int, keys: int) -> int:
    h, f = config.hidden_size, config.intermediate_size
    return 2 * batch * (queries * (2 * h * h + 2 * h * f) + keys * 2 * h * h + 2 * queries * keys * h)


def vocab_flops(config, positions: int) -> int:
    h = config.hidden_size
    return 2 * positions * (h * h + h * config.vocab_size)


def _targets(labels: torch.Tensor) -> int:
    return int((labels != -100).sum())


def forward_flops(method: str, options, config, batch: dict[str, torch.Tensor]) -> int:
    """Forward FLOPs of `method`'s head (options: its options; config: the encoder's BertConfig) on `batch`."""
    b, length = batch["input_ids"].shape
    h = config.hidden_size
    total = (config.num_hidden_layers * layer_flops(config, b, length, length) + 2 * b * h * h
             + vocab_flops(config, _targets(batch["mlm_labels"])))
    if method in ("retromae", "dupmae"):
        total += layer_flops(config, b, length, length) + vocab_flops(config, _targets(batch["dec_labels"]))
    if method == "dupmae":
        total += _ot_flops(options, config, b * length)
    if method in ("seed", "cotmae", "cotmote"):
        ids, labels = (batch["dec_input_ids"], batch["dec_labels"]) if method == "seed" else \
            (batch["ctx_input_ids"], batch["ctx_labels"])
        total += options.decoder_layers * layer_flops(config, b, ids.shape[1], ids.shape[1])
        total += vocab_flops(config, _targets(labels))
    if method == "costa":
        total += 4 * b * h * h
    return total


def _ot_flops(options, config, positions: int) -> int:
    """DupMAE's OT projection of every position to the vocabulary (eq. 6)."""
    return vocab_flops(config, positions) if options.lpu == "mlm_head" else 2 * positions * config.hidden_size * config.vocab_size


def train_flops(method: str, options, config, batch: dict[str, torch.Tensor]) -> int:
    """Forward + backward FLOPs of one micro-batch: 3x the forward, less the backward of DupMAE's OT
    projection to the vocabulary (a gather of the winners, no matmul)."""
    total = 3 * forward_flops(method, options, config, batch)
    if method == "dupmae":
        total -= 2 * 2 * batch["input_ids"].numel() * config.hidden_size * config.vocab_size
    return total


def measured_cpu_peak(size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` fp32 size x size matmuls with torch's threads: the CPU's MFU peak."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: a resumed run must replay its dropout
    a, b = torch.randn(size, size, generator=generator), torch.randn(size, size, generator=generator)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def gpu_peak(name: str, precision: str) -> tuple[str, float] | None:
    """(part, peak FLOP/s) of the GPU called `name` (torch.cuda.get_device_name) at `precision`; None when the
    name is not in GPU_PEAKS."""
    for pattern, part, peaks in GPU_PEAKS:
        if re.search(pattern, name):
            return part, peaks[precision]
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
