"""Devices for `pretrieve scale plan --device` and `pretrieve estimate --devices`, whether a micro-batch fits one of
them, and what a checkpoint holds.

Memory of one device while training a micro-batch of b sequences of length s (bytes); a sequence is what one
sample puts through the encoder (CoT-MAE's anchor and context, coCondenser's two spans: two rows each) and
through the decoders, each at its own rows per sample:

    states       = P (w / Z3 + g / Z2 + o / Z1)      P trainable parameters (the head built on the meta device),
                   + F w / Z3                        F frozen ones (LoRA's base model, a [CLS] pooler): weights only;
                                                     (w, g, o) = (4, 4, 8) in fp32, (2, 2, 16) in bf16 / fp16
                                                     (fp32 master weights and Adam's moments: ZeRO, Rajbhandari et
                                                     al. 2020, sec. 3; and the fp32 copy of its gradient partition
                                                     DeepSpeed makes for the step, which its own estimator counts);
                                                     Zk = world size where ZeRO stage >= k partitions that part,
                                                     else 1; g = o = 0 with offload_optimizer. At ZeRO 2 this is
                                                     DeepSpeed's estimate_zero2_model_states_mem_needs; at ZeRO 3
                                                     DeepSpeed's counts 18 P / N (no 16-bit parameter partition);
                                                     with offload_params the weights are on the host: w = 0
                   + (w + g) x largest layer         ZeRO 3: the layer computed, gathered (its weights, and its
                                                     gradients if it trains), as DeepSpeed's estimator counts it
    layer(b, s)  = s b h (8e + 2) + n e s b f + (2e + 1) a s^2 b
                                                     activations one transformer layer keeps for backward
                                                     (Korthikanti et al. 2022, eq. 2, for element size e = 2 in
                                                     bf16 / fp16, 4 in fp32, FFN width f, a heads; the dropout
                                                     masks take 1 byte an element); n = the f-wide tensors of the
                                                     backbone's feed-forward block (BERT's 2, ModernBERT's GeGLU
                                                     4); an upper bound where the attention kernel keeps no
                                                     score matrix (the a s^2 terms)
    adapters     = with LoRA's dropout, each adapted layer keeps its dropped input: s b (e + 1) bytes per input
                   feature of the adapted layers, added to layer(b, s)
    encoder      = L layer(b, s), or with activation checkpointing L e s b h + layer(b, s) (the layer inputs,
                   and one layer's activations while it is recomputed)
    decoders     = retromae, dupmae: layer(b, s); seed: decoder_layers x layer(b, s_dec); cotmae, cotmote:
                   decoder_layers x layer(b, s_ctx), s_ctx the decoder's input (never checkpointed)
    vocabulary   = per vocabulary projection 4 V (h + 1), its fp32 gradient kept from forward to backward, and
                   one chunk of logits (models/vocab_projection.py keeps no [positions, V] tensor)

All but the states grow linearly with b, so a point keeps its estimate as states + workspace + b x (bytes per
sequence, without and with activation checkpointing), and the plan can price another micro-batch. A device
counts as full at USABLE_SHARE of its memory: the CUDA context and the caching allocator's fragmentation take
the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GB = 1e9
USABLE_SHARE = 0.9
LOGITS_CHUNK_BYTES = 4 * (1 << 26)  # models/vocab_projection.py: CHUNK_ELEMENTS on CUDA, fp32


@dataclass(frozen=True)
class Device:
    part: str | None  # engine/flops.py GPU_PEAKS part (its peak FLOP/s); None: this machine's CPU, measured
    memory: float  # bytes


def host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# --device NAME: the part of engine/flops.py's peak table and its memory (vendors' data sheets)
DEVICES = {
    "h100": Device("H100 SXM", 80 * GB), "h100-pcie": Device("H100 PCIe", 80 * GB),
    "h100-nvl": Device("H100 NVL", 94 * GB), "h200": Device("H200", 141 * GB),
    "a100": Device("A100", 80 * GB), "a100-40gb": Device("A100", 40 * GB),
    "l40s": Device("L40S", 48 * GB), "a10": Device("A10", 24 * GB), "rtx2080ti": Device("RTX 2080 Ti", 11 * GB),
    "cpu": Device(None, 0.0),
}


def device(name: str) -> Device:
    """The device called `name`; cpu: this machine's memory."""
    if name not in DEVICES:
        raise ValueError(f"--device {name!r}: choose one of {', '.join(DEVICES)}")
    return Device(None, host_memory()) if name == "cpu" else DEVICES[name]


def device_flops(name: str, precision: str) -> float:
    """Peak FLOP/s of one `name` device at `precision` (cpu: a measured fp32 matmul, as for MFU)."""
    from pretrieve.engine.flops import GPU_PEAKS, matmul_precision, measured_cpu_peak

    part = device(name).part
    if part is None:
        return measured_cpu_peak()
    peak = next(peaks[matmul_precision(precision)] for _, known, peaks in GPU_PEAKS if known == part)
    if peak is None:
        raise ValueError(f"train.precision: {precision}: the {part} computes no {matmul_precision(precision)}; "
                         "use fp16 or fp32 on it")
    return peak


def layer_activations(b: int, s: int, h: int, f: int, heads: int, element: int, ffn: int = 2) -> int:
    return s * b * h * (8 * element + 2) + ffn * element * s * b * f + (2 * element + 1) * heads * s * s * b


def meta_head(exp):
    """`exp`'s head built on the meta device: exact parameter counts of every head, nothing allocated."""
    import torch

    with torch.device("meta"):
        return exp.method.build(exp.options, exp.model)


def estimate(exp, world_size: int, batch: dict, samples: int | None = None, head=None) -> dict:
    """The memory model of the module docstring for `exp`'s training on `batch` (its collated micro-batch of
    `samples` stream samples; default one a row): {"states", "workspace", "per_sequence",
    "per_sequence_checkpointed"} in bytes, a sequence being a sample with every row it puts through the encoder
    and the decoders (CoT-MAE's anchor and context, coCondenser's two spans), and the configured
    "activation_checkpointing". `head`: exp's head on the meta device, when built already."""
    from pretrieve.models.backbones import backbone_of

    head = meta_head(exp) if head is None else head
    params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in head.parameters() if not p.requires_grad)  # LoRA's base model, a pooler
    t, config = exp.train, exp.model.hf_config()
    element = 2 if t.precision != "fp32" else 4  # activations: 16 bits under autocast too
    # bf16/fp16: 16-bit weights and gradients, fp32 masters in the optimizer; fp32 and bf16-autocast: no copy
    w, g, o = (2, 2, 16) if t.precision in ("bf16", "fp16") else (4, 4, 8)
    split = [world_size if t.zero_stage >= k else 1 for k in (1, 2, 3)]
    # ZeRO 3: the layer being computed is gathered whole, its weights and (made here, offloaded or not) gradients
    gathered = max(sum((w + g * p.requires_grad) * p.numel() for p in m.parameters(recurse=False))
                   for m in head.modules()) if t.zero_stage == 3 else 0
    weights = 0 if t.offload_params else w  # offloaded: on the host, a layer at a time here
    if t.offload_optimizer:  # the optimizer's step, its states and the gradient partitions it reads: all on the host
        g = o = 0
    states = params * (weights / split[2] + g / split[1] + o / split[0]) + frozen * weights / split[2] + gathered
    b, s = batch["input_ids"].shape
    rows = b / (samples or b)  # the encoder's rows per sample
    h, f, heads, layers = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                           config.num_hidden_layers)
    ffn = backbone_of(config).ffn_activations
    layer = layer_activations(1, s, h, f, heads, element, ffn) + adapter_activations(head, exp.model, s, element)
    decoders = sum(n * decoder_rows / (samples or b) * layer_activations(1, length, h, f, heads, element, ffn)
                   for n, decoder_rows, length in decoder_layers(exp.method.name, exp.options, batch))
    projections = 1 + bool(decoder_layers(exp.method.name, exp.options, batch))
    return {"states": states, "workspace": projections * (4 * config.vocab_size * (h + 1) + LOGITS_CHUNK_BYTES),
            "per_sequence": rows * layers * layer + decoders,
            "per_sequence_checkpointed": rows * (layers * element * s * h + layer) + decoders,
            "activation_checkpointing": t.activation_checkpointing}


def adapter_activations(head, model, s: int, element: int) -> float:
    """Bytes one layer's LoRA adapters keep for backward for one sequence: with adapter dropout, the dropped
    copy of each adapted layer's input and its mask (the r-wide products are left out)."""
    from pretrieve.models.lora import lora_input_width

    if not model.lora.r or not model.lora.dropout:
        return 0
    return lora_input_width(head.encoder.model) / head.encoder.config.num_hidden_layers * s * (element + 1)


def decoder_layers(method: str, options, batch: dict) -> list[tuple[int, int, int]]:
    """(layers, rows, sequence length) of the decoders `method` trains beside the encoder."""
    if method in ("retromae", "dupmae"):
        return [(1, *batch["input_ids"].shape)]
    if method == "seed":
        return [(options.decoder_layers, *batch["dec_input_ids"].shape)]
    if method in ("cotmae", "cotmote"):  # clm: over the contexts; mlm: over the partners' texts
        ctx = batch["ctx_input_ids"] if options.decoder_objective == "clm" else batch["dec_input_ids"]
        return [(options.decoder_layers, *ctx.shape)]
    return []


def needed(memory: dict, micro_batch: int, checkpointing: bool) -> float:
    per_sequence = memory["per_sequence_checkpointed" if checkpointing else "per_sequence"]
    return memory["states"] + memory["workspace"] + micro_batch * per_sequence


@dataclass(frozen=True)
class Wording:
    """How advice names the settings it changes: a study's (`scale plan`) or a config's (`pretrieve estimate`)."""

    checkpointing: str
    batch: str  # formatted with micro, accum
    also: str = " and train.activation_checkpointing=true"


STUDY_WORDING = Wording("add train.activation_checkpointing=true to train.overrides",
                        "set train.batch_size: {micro} with train.grad_accum={accum}")
CONFIG_WORDING = Wording("set train.activation_checkpointing=true",
                         "set train.micro_batch_size={micro} and train.grad_accum={accum}")
NO_FIX = ("even a micro-batch of 1 with activation checkpointing does not fit: raise train.zero_stage (ZeRO "
          "partitions the model states over the ranks), train.offload_optimizer, or the world size")


def fit_advice(point, device_name: str, capacity: float) -> str | None:
    """None when `point`'s micro-batch fits `capacity` bytes, else the warning with what would make it fit."""
    memory, b = point.memory, point.micro_batch_size
    usable = USABLE_SHARE * capacity
    fixes = fit_fixes(memory, b, point.grad_accum, usable, STUDY_WORDING)
    if fixes is None:
        return None
    need = needed(memory, b, memory["activation_checkpointing"])
    head = (f"point {point.id}: about {need / GB:.1f} GB per device (model states {memory['states'] / GB:.1f} GB) "
            f"for a micro-batch of {b} x {point.seq_len} tokens, over the {usable / GB:.1f} GB usable of "
            f"{device_name} ({capacity / GB:.0f} GB)")
    return f"{head}: {'; or '.join(fixes)}"


def fit_fixes(memory: dict, b: int, accum: int, usable: float, wording: Wording,
              zero_states: dict[int, float] | None = None) -> list[str] | None:
    """None when a micro-batch of `b` fits `usable` bytes, else what would make it fit, each with the GB it
    needs: the lowest higher ZeRO stage that does (`zero_states`: the model states at each higher stage),
    activation checkpointing, the largest smaller micro-batch (with as much more accumulation: the same tokens
    per step)."""
    checkpointing = memory["activation_checkpointing"]
    if needed(memory, b, checkpointing) <= usable:
        return None
    fixes = []
    for stage, states in sorted((zero_states or {}).items()):
        need = needed({**memory, "states": states}, b, checkpointing)
        if need <= usable:
            fixes.append(f"set train.zero_stage={stage} ({need / GB:.1f} GB)")
            break
    if not checkpointing and needed(memory, b, True) <= usable:
        fixes.append(f"{wording.checkpointing} ({needed(memory, b, True) / GB:.1f} GB, about 1/3 more compute)")
    for ckpt in (checkpointing, True):
        smaller = next((k for k in range(2, b + 1) if b % k == 0 and needed(memory, b // k, ckpt) <= usable), None)
        if smaller is not None:
            also = wording.also if ckpt and not checkpointing else ""
            fixes.append(f"{wording.batch.format(micro=b // smaller, accum=accum * smaller)}{also} "
                         f"(the same tokens per step; {needed(memory, b // smaller, ckpt) / GB:.1f} GB)")
            break
    return fixes or [NO_FIX]


def checkpoint_bytes(head, train) -> dict:
    """What one checkpoint tag holds of `head` trained with `train` (a TrainOptions), in bytes: {"weights": the
    module's, 16-bit in bf16 / fp16 and fp32 otherwise, none at ZeRO 3 (its partitions hold them), "optimizer":
    Adam's two fp32 moments and, but for a ZeRO 0 run without a 16-bit module, an fp32 copy of the weights}.
    Measured on CPU (tiny mlm, every precision at ZeRO 0, 2 and 3): within 0.3 % of the tag's files."""
    params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in head.parameters() if not p.requires_grad)
    sixteen = train.precision in ("bf16", "fp16")
    weights = 0 if train.zero_stage == 3 else (2 if sixteen else 4) * (params + frozen)
    return {"weights": weights, "optimizer": (8 if train.zero_stage == 0 and not sixteen else 12) * params}
