"""The analytic FLOPs formula (engine.flops) against DeepSpeed's flops profiler, for every method."""

import pytest
import torch

from support import text_methods
from pretrieve.engine.flops import forward_flops, measured_cpu_peak, train_flops
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import METHODS
from pretrieve.models.heads.registry import no_flops

TINY = ModelOptions(vocab_size=30522, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
                    max_position_embeddings=512)


@pytest.mark.parametrize("name", text_methods(METHODS))
def test_analytic_flops_match_the_deepspeed_profiler(name, vocab, wiki_samples):
    from deepspeed.profiling.flops_profiler import get_model_profile

    method = METHODS[name]
    options = method.options_from({"max_len": 128})
    head = method.build(options, TINY, seed=0).eval()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    with torch.no_grad():  # with gradients on, the fused vocabulary losses do their backward matmuls in forward
        _, macs, _ = get_model_profile(head, kwargs={"batch": batch}, print_profile=False, as_string=False,
                                       warm_up=0)
    analytic = forward_flops(method, options, head.encoder.config, batch)
    if name in ("dupmae", "lexmae"):  # the max-pooled projection's matmul carries two extra columns (mask, bias)
        macs -= 2 * batch["input_ids"].numel() * head.encoder.config.vocab_size
    # costa's and cocondenser's contrastive logits (anchors x candidates x h) are left out of the formula: well
    # under 1%
    assert analytic == pytest.approx(2 * macs, rel=0.01 if name in ("costa", "cocondenser") else 1e-9)
    trained = train_flops(method, options, head.encoder.config, batch)
    # the part a method registers as `no_backward_flops` takes no backward matmul (dupmae's and lexmae's max-pooled
    # projections, simlm's generator pass over the decoder's text)
    if method.no_backward_flops is no_flops:
        assert trained == 3 * analytic
    else:
        assert 3 * analytic > trained > analytic


def test_measured_cpu_peak_is_plausible():
    torch.set_num_threads(1)
    assert 1e8 < measured_cpu_peak(size=512, repeats=2) < 1e13


@pytest.mark.parametrize("name", ["mlm", "retromae", "seed"])
def test_analytic_flops_count_modernbert_geglu_and_no_pooler(name, vocab, wiki_samples):
    """ModernBERT's feed-forward block has three h x f matrices (GeGLU) and the model no pooler."""
    from dataclasses import replace

    from deepspeed.profiling.flops_profiler import get_model_profile

    method = METHODS[name]
    options = method.options_from({"max_len": 128})
    head = method.build(options, replace(TINY, backbone="modernbert", pad_token_id=0, num_layers=3), seed=0).eval()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    with torch.no_grad():
        _, macs, _ = get_model_profile(head, kwargs={"batch": batch}, print_profile=False, as_string=False,
                                       warm_up=0)
    assert forward_flops(method, options, head.encoder.config, batch) == pytest.approx(2 * macs, rel=1e-9)


@pytest.mark.parametrize("name", ["llama2vec", "mntp"])
def test_lora_flops_are_the_matmuls_autograd_runs(name, llm):
    """Under LoRA the frozen weights get no gradients: train_flops with the adapters equals what torch's
    FlopCounterMode counts over a forward and backward, plus the attention scores' 3x (CPU's fused attention
    is not counted by it), to the first layer's adapters' input gradients (which need none; 0.1 % here). The
    full-training count, 3x the forward, would be a third higher."""
    import numpy as np
    from torch.utils.flop_counter import FlopCounterMode

    from pretrieve.data.masking import Vocabulary
    from pretrieve.models.flops import attention_flops
    from pretrieve.models.lora import LoraOptions, adapter_shape

    vocab = Vocabulary.of_tokenizer(llm[0])
    method = METHODS[name]
    options = method.options_from({"max_len": 128})
    rng = np.random.default_rng(0)
    batch = method.collator.from_options(options, vocab, seed=0)([{"ids": rng.integers(300, 3000, 240)}
                                                                   for _ in range(4)])
    model = ModelOptions(backbone="qwen3", vocab_size=vocab.size, hidden_size=256, num_layers=2, num_heads=4,
                         intermediate_size=768, pad_token_id=vocab.pad_id, dropout=0.0, bidirectional=name == "mntp",
                         lora=LoraOptions(r=8, dropout=0.0))
    head = method.build(options, model, seed=0)
    with FlopCounterMode(display=False) as counter:
        head(batch)["loss"].backward()
    config = head.encoder.config
    counted = counter.get_total_flops() + 3 * attention_flops(config, batch)
    ours = train_flops(method, options, config, batch, adapter_shape(head.encoder.model))
    assert ours == pytest.approx(counted, rel=2e-3)
    assert train_flops(method, options, config, batch) > 1.3 * counted
