"""The analytic FLOPs formula (engine.flops) against DeepSpeed's flops profiler, for every method."""

import pytest
import torch

from conftest import text_methods
from pretrieve.engine.flops import forward_flops, measured_cpu_peak, train_flops
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import METHODS

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
    analytic = forward_flops(name, options, head.encoder.config, batch)
    if name == "dupmae":  # the OT projection's matmul carries two extra columns (mask offset, bias)
        macs -= 2 * batch["input_ids"].numel() * head.encoder.config.vocab_size
    # costa's contrastive logits (anchors x candidates x h) are left out of the formula: well under 1%
    assert analytic == pytest.approx(2 * macs, rel=0.01 if name == "costa" else 1e-9)
    trained = train_flops(name, options, head.encoder.config, batch)
    assert trained == 3 * analytic if name != "dupmae" else 3 * analytic > trained > analytic


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
    assert forward_flops(name, options, head.encoder.config, batch) == pytest.approx(2 * macs, rel=1e-9)
