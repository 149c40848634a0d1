"""scale/memory.py's model states beside DeepSpeed's own estimators (no offload), on a tiny Qwen3 Llama2Vec head
in bf16: at ZeRO 2 they are DeepSpeed's bytes; at ZeRO 3 DeepSpeed counts 18 bytes a parameter over the devices
(no 16-bit parameter partition) and the largest layer gathered at 4 bytes a parameter, pretrieve 20 and no
gathered layer. benchmarks/llm_memory.py tabulates both for Qwen3 shapes of 0.6B-8B."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pretrieve.config import TrainOptions, load_config, method_options, model_options
from pretrieve.scale.memory import estimate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


@pytest.mark.parametrize("world", [1, 8])
def test_model_states_are_deepspeeds_estimate(vocab, world):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    config = load_config(CONFIGS / "tiny-llama2vec.yaml", ["model.vocab_size=30522"])
    method, options = method_options(config)
    batch = method.collator.from_options(options, vocab)([{"ids": np.arange(1000, 1100)}])
    with torch.device("meta"):
        head = method.build(options, model_options(config))
    params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in head.modules())

    def states(zero: int) -> float:
        train = TrainOptions(precision="bf16", zero_stage=zero)
        exp = SimpleNamespace(method=method, options=options, model=model_options(config), train=train)
        return estimate(exp, world, batch)["states"]

    assert states(2) == pytest.approx(
        estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)[1], abs=1)
    _, deepspeed, gathered = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=world,
                                                                   cpu_offload=False, cpu_offload_params=False)
    assert gathered == 4 * largest
    assert states(3) == pytest.approx(deepspeed - gathered + 2 * params / world, abs=1)
