"""scale/memory.py's model states beside DeepSpeed's own estimators, on a tiny Qwen3 Llama2Vec head in bf16: at
ZeRO 2 they are DeepSpeed's bytes; at ZeRO 3 both count the largest layer gathered at 4 bytes a parameter, and
DeepSpeed 18 bytes a parameter over the devices (no 16-bit parameter partition), pretrieve 20; LoRA's frozen
weights and the offloaded states. benchmarks/llm_memory.py tabulates both for Qwen3 shapes of 0.6B-8B."""

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pretrieve.config import TrainOptions, load_config
from pretrieve.pretrain_config import method_options, model_options
from pretrieve.scale.memory import estimate

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _states(vocab, world: int, overrides: list[str], **train) -> tuple[float, int, int, int]:
    """(estimated model states, trainable parameters, all parameters, the largest layer's) of the tiny Llama2Vec
    head with `overrides`, in bf16 with `train`'s options, on `world` devices."""
    config = load_config(CONFIGS / "tiny-llama2vec.yaml", ["model.vocab_size=30522", *overrides])
    method, options = method_options(config)
    batch = method.collator.from_options(options, vocab)([{"ids": np.arange(1000, 1100)}])
    with torch.device("meta"):
        head = method.build(options, model_options(config))
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in head.modules())
    exp = SimpleNamespace(method=method, options=options, model=model_options(config),
                          train=TrainOptions(precision="bf16", **train))
    return estimate(exp, world, batch)["states"], trained, sum(p.numel() for p in head.parameters()), largest


@pytest.mark.parametrize("world", [1, 8])
def test_model_states_are_deepspeeds_estimate(vocab, world):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    zero2, params, _, largest = _states(vocab, world, [], zero_stage=2)
    assert zero2 == pytest.approx(
        estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=False)[1], abs=1)
    _, deepspeed, gathered = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=world,
                                                                   cpu_offload=False, cpu_offload_params=False)
    assert gathered == 4 * largest
    assert _states(vocab, world, [], zero_stage=3)[0] == pytest.approx(deepspeed + 2 * params / world, abs=1)


@pytest.mark.parametrize("world", [1, 8])
def test_lora_and_offload_states(vocab, world):
    """LoRA: the trainable weights (adapters, the head's bias) cost what DeepSpeed's ZeRO-2 estimate says of
    them, the frozen base model 2 bytes a weight (bf16, partitioned at ZeRO 3 only), and nothing else.
    Offloaded optimizer: DeepSpeed's cpu_offload estimate (the 16-bit weights alone); parameters offloaded too
    at ZeRO 3: nothing on the device but the gathered layer, as DeepSpeed counts it."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for zero in (2, 3):
        ours, trained, total, largest = _states(vocab, world, ["model.lora.r=8"], zero_stage=zero)
        frozen = total - trained
        assert trained < total / 10
        gathered = 2 * largest if zero == 3 else 0  # the frozen embedding: weights, no gradients
        assert ours == pytest.approx(estimate_zero2_model_states_mem_needs(trained, num_gpus_per_node=world,
                                                                           cpu_offload=False)[1]
                                     - 2 * trained + 2 * trained / (world if zero == 3 else 1)
                                     + 2 * frozen / (world if zero == 3 else 1) + gathered, abs=1)
    ours, trained, _, _ = _states(vocab, world, [], zero_stage=2, offload_optimizer=True)
    assert ours == pytest.approx(estimate_zero2_model_states_mem_needs(trained, num_gpus_per_node=world,
                                                                       cpu_offload=True)[1], abs=1)
    ours, trained, _, largest = _states(vocab, world, [], zero_stage=3, offload_optimizer=True, offload_params=True)
    assert ours == estimate_zero3_model_states_mem_needs(trained, largest, num_gpus_per_node=world, cpu_offload=True,
                                                         cpu_offload_params=True)[1] == 4 * largest


@pytest.mark.parametrize("name", ["0.6B", "1.7B", "4B", "8B"])
def test_model_states_at_qwen3_shapes_are_deepspeeds(name):
    """benchmarks/llm_memory.py's Qwen3 shapes (built on the meta device), full training in bf16, on 1, 2, 4 and 8
    devices: at ZeRO 2 DeepSpeed's bytes; at ZeRO 3 DeepSpeed's plus the 16-bit weights' partition (2 bytes a
    parameter over the devices, which its estimate leaves out); at ZeRO 3 with both offloaded, DeepSpeed's."""
    from benchmarks import llm_memory

    for zero, offload in llm_memory.SETUPS:
        exp = llm_memory.experiment_of(llm_memory.QWEN3[name], zero, "full", offload)
        batch = llm_memory.one_sequence(exp)
        with torch.device("meta"):
            head = exp.method.build(exp.options, exp.model)
        params = sum(p.numel() for p in head.parameters())
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in head.modules())
        for world in (1, 2, 4, 8):
            device, _ = llm_memory.deepspeed_states(params, largest, zero, world, offload)
            partition = 2 * params / world if zero == 3 and not offload else 0
            assert estimate(exp, world, batch)["states"] == pytest.approx(device + partition, abs=1), \
                (zero, offload, world)


def test_a_sample_counts_every_row_it_puts_through_the_encoder_and_the_decoder(vocab):
    """CoT-MAE encodes each sample's anchor and its context (two encoder rows) and decodes each row from the
    other's [CLS] (two decoder rows): a sequence of the memory model is both, not one row."""
    from pretrieve.scale.memory import layer_activations

    config = load_config(CONFIGS / "tiny-cotmae.yaml", ["model.vocab_size=30522"])
    method, options = method_options(config)
    samples = [{"ids": np.arange(1000, 1040), "doc": "d", "block": i, "source": "s", "shard": 0, "index": i}
               for i in range(4)]
    batch = method.collator.from_options(options, vocab, seed=0)(samples)
    model = model_options(config)
    exp = SimpleNamespace(method=method, options=options, model=model, train=TrainOptions())
    (rows, s), (dec_rows, dec_s) = batch["input_ids"].shape, batch["dec_input_ids"].shape
    assert rows == dec_rows == 2 * len(samples)
    layer = partial(layer_activations, 1, h=model.hidden_size, f=model.intermediate_size, heads=model.num_heads,
                    element=4)
    assert estimate(exp, 1, batch, len(samples))["per_sequence"] == pytest.approx(
        2 * model.num_layers * layer(s) + 2 * options.decoder_layers * layer(dec_s))
