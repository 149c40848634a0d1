"""Attention in training takes one of SDPA's fused kernels on a GPU (`make test-gpu`; skipped without CUDA): every
encoder backbone's stack, padded and unpadded, and RetroMAE's two-stream decoder under `method.attention_impl:
sdpa`, each a training step (bf16 autocast, attention dropout 0.1, a padded batch, forward and backward) with SDPA's
math fallback turned off. torch then raises "No available kernel" where no fused kernel (FlashAttention,
memory-efficient or cuDNN) takes the inputs, as a mask of the wrong dtype or layout would make it: the step would
otherwise run the math kernel unseen, materialising every [L, L] score matrix."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from support import tiny_head
from test_unpadding_gpu import batch as padded_batch  # 8 texts of 20 to `width` tokens, padded
from pretrieve.models.encoder import Encoder, ModelOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
BACKBONES = ("bert", "roberta", "xlm-roberta", "modernbert")


def trained(module) -> bool:
    """Whether every weight of `module`'s layers received a finite gradient."""
    grads = [p.grad for name, p in module.named_parameters() if "layer" in name]
    return bool(grads) and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("unpad", [False, True])
@pytest.mark.parametrize("backbone", BACKBONES)
def test_the_encoders_attention_trains_without_the_math_kernel(backbone, unpad):
    """Head dim 64, as BERT-base's; under dropout the unpadded stack takes padded SDPA (the varlen kernel has no
    dropout), which must be a fused kernel too."""
    torch.manual_seed(0)
    encoder = Encoder.build(ModelOptions(backbone=backbone, vocab_size=1000, hidden_size=128, num_layers=2,
                                         num_heads=2, intermediate_size=256, max_position_embeddings=512,
                                         dropout=0.1, pad_token_id=0, unpad=unpad)).cuda().train()
    ids, mask = padded_batch(width=256)
    with sdpa_kernel(FUSED), torch.autocast("cuda", dtype=torch.bfloat16):
        states = encoder(ids, mask)
        states[mask.bool()].float().square().mean().backward()
    assert torch.isfinite(states).all() and trained(encoder)


def test_retromaes_decoder_trains_without_the_math_kernel(wiki_samples, vocab):
    """The two-stream decoder's SDPA path reads a dense [B, 1, L, L] mask: the memory-efficient or cuDNN kernel
    must take it, with the decoder's attention dropout."""
    spec, options, head = tiny_head("retromae", "model.hidden_size=128", "model.num_heads=2", "model.dropout=0.1",
                                    "method.attention_impl=sdpa", "method.decoder_attention_dropout=0.1")
    batch = {k: v.cuda() for k, v in spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:8]).items()}
    head = head.cuda().train()
    with sdpa_kernel(FUSED), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = head(batch)["loss"]
        loss.backward()
    assert torch.isfinite(loss) and trained(head.decoder)
