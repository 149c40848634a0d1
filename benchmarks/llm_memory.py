"""Memory and step FLOPs of Qwen3-shaped decoder LLMs under Llama2Vec, as `scale plan` estimates them
(pretrieve/scale/memory.py), beside DeepSpeed's own model-states estimators.

    python -m benchmarks.llm_memory [--out benchmarks/results/llm_memory.json]

Shapes: Qwen3 0.6B, 1.7B, 4B and 8B (hidden, layers, heads, FFN, vocabulary 151,669) on pretrieve's qwen3
backbone, whose heads are hidden / heads wide with as many key-value heads as query heads (Qwen3's are 128 wide,
with 8 key-value heads): its parameter counts are not the released models' (0.54B for the 0.6B shape, 8.5B
for the 8B one), and the rows are for those counts. bf16 with AdamW, sequences of 512 tokens (the text and
Llama2Vec's prompts), micro-batch 1, activation checkpointing; ZeRO 2 and 3 on 1 and 8 devices, and ZeRO 3
with parameters and optimizer offloaded to the host; each for full training and for LoRA r 16 on every linear
layer (the base model frozen). Per device: the model states, the activations of the micro-batch, the
workspace, and their sum against an H100's usable 72 GB (90 % of 80). DeepSpeed's figures, for full training:
estimate_zero2_model_states_mem_needs and estimate_zero3_model_states_mem_needs, device bytes (at ZeRO 3 with
the largest layer gathered) and the host's (all of the offloaded states). The step time is the training FLOPs
of one micro-batch (LoRA's without the frozen weights' gradients) over an H100's bf16 peak: the time at 100 %
MFU; divide by the MFU a run reaches. No model is allocated: the heads are built on the meta device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from pretrieve.config import TrainOptions, load_config
from pretrieve.data.masking import Vocabulary
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
from pretrieve.engine.flops import train_flops
from pretrieve.models.lora import adapter_shape
from pretrieve.pretrain_config import method_options, model_options
from pretrieve.scale.memory import GB, USABLE_SHARE, estimate, needed

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = {"0.6B": (1024, 28, 16, 3072), "1.7B": (2048, 28, 16, 6144), "4B": (2560, 36, 32, 9728),
         "8B": (4096, 36, 32, 12288)}  # hidden, layers, heads, FFN (the released configs)
VOCAB, LENGTH, H100_BF16, H100_BYTES = 151669, 512, 989e12, 80 * GB


# how the weights train: every weight, or LoRA r 16 on every linear layer (LLM2Vec's and E5-Mistral's rank)
TUNINGS = {"full": [], "lora": ["model.lora.r=16", "model.lora.alpha=32", "model.lora.dropout=0.05"]}
# (ZeRO stage, parameters and optimizer offloaded to the host)
SETUPS = ((2, False), (3, False), (3, True))


def experiment_of(shape: tuple[int, int, int, int], zero: int, tuning: str = "full",
                  offload: bool = False) -> SimpleNamespace:
    """What scale/memory.py reads of an experiment (configs/pretrain/llama2vec.yaml at this shape; no data)."""
    hidden, layers, heads, ffn = shape
    config = load_config(ROOT / "configs" / "pretrain" / "llama2vec.yaml", [
        "model.backbone=qwen3", f"model.vocab_size={VOCAB}", f"model.hidden_size={hidden}",
        f"model.num_layers={layers}", f"model.num_heads={heads}", f"model.intermediate_size={ffn}",
        "model.max_position_embeddings=32768", f"method.max_len={LENGTH}", *TUNINGS[tuning]])
    method, options = method_options(config)
    train = TrainOptions(precision="bf16", zero_stage=zero, activation_checkpointing=True,
                         offload_optimizer=offload, offload_params=offload)
    return SimpleNamespace(method=method, options=options, model=model_options(config), train=train)


def one_sequence(exp) -> dict:
    """A micro-batch of one text that fills method.max_len with its prompts."""
    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    collate = exp.method.collator.from_options(exp.options, vocab)
    return collate([{"ids": np.full(2 * LENGTH, 2000, dtype=np.int64)}])


def deepspeed_states(params: int, largest_layer: int, zero: int, world: int, offload: bool) -> tuple[int, int]:
    """DeepSpeed's estimate of full training's model states: (bytes per device, bytes on the host)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if zero == 2:
        host, device = estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=offload)
    else:
        host, device, _ = estimate_zero3_model_states_mem_needs(params, largest_layer, num_gpus_per_node=world,
                                                                cpu_offload=offload, cpu_offload_params=offload)
    return device, host


def measure() -> list[dict]:
    rows = []
    for (name, shape), tuning, (zero, offload) in itertools.product(QWEN3.items(), TUNINGS, SETUPS):
        exp = experiment_of(shape, zero, tuning, offload)
        batch = one_sequence(exp)
        with torch.device("meta"):
            head = exp.method.build(exp.options, exp.model)
        params = sum(p.numel() for p in head.parameters())
        trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in head.modules())
        # LoRA: no gradients for the frozen weights (engine/flops.py)
        flops = train_flops(exp.method, exp.options, exp.model.hf_config(), batch,
                            adapter_shape(head.encoder.model))
        for world in (1, 8):
            memory = estimate(exp, world, batch)
            total = needed(memory, 1, True)
            # DeepSpeed's estimators are for full training (device: with the gathered layer; host: offloaded)
            device, host = deepspeed_states(params, largest, zero, world, offload) if tuning == "full" else (None, None)
            rows.append({"model": f"Qwen3-{name} shape", "parameters": params, "trainable": trainable,
                         "tuning": tuning, "zero_stage": zero, "offload": offload, "devices": world,
                         "states_gb": memory["states"] / GB,
                         "deepspeed_states_gb": None if device is None else device / GB,
                         "deepspeed_host_gb": None if host is None else host / GB,
                         "activations_gb": memory["per_sequence_checkpointed"] / GB,
                         "workspace_gb": memory["workspace"] / GB, "total_gb": total / GB,
                         "fits_h100": total <= USABLE_SHARE * H100_BYTES,
                         "train_tflops_per_sequence": flops / 1e12,
                         "seconds_per_sequence_at_full_mfu": flops / H100_BF16})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llm_memory.json"))
    args = parser.parse_args()
    rows = measure()
    for r in rows:
        theirs = f" (DeepSpeed {r['deepspeed_states_gb']:6.1f})" if r["deepspeed_states_gb"] is not None else ""
        print(f"{r['model']:16} {r['parameters'] / 1e9:5.2f}B {r['tuning']:4} ZeRO {r['zero_stage']}"
              f"{' offload' if r['offload'] else ''} x{r['devices']}: states {r['states_gb']:6.1f} GB{theirs}, "
              f"total {r['total_gb']:6.1f} GB{'' if r['fits_h100'] else ' > H100'}, "
              f"{r['seconds_per_sequence_at_full_mfu'] * 1e3:.1f} ms/seq")
    out = {"settings": {"method": "llama2vec", "precision": "bf16", "sequence": LENGTH, "micro_batch": 1,
                        "activation_checkpointing": True, "device": "H100 SXM, 80 GB, 989 TFLOP/s bf16"},
           "machine": platform.machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
