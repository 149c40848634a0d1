"""Unpadded batches on a GPU (`make test-gpu`; skipped without CUDA): ModernBERT's packed stack takes torch's
varlen FlashAttention kernel by cu_seqlens, global and sliding-window layers alike, and so do BERT's and
RoBERTa's (positions from padding_idx + 1), each giving the padded batch's states and gradients within bf16's
precision; under attention dropout or in fp32 it takes padded attention."""

import pytest
import torch

from pretrieve.models import unpadding
from pretrieve.models.encoder import Encoder, ModelOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def encoders(dropout: float = 0.0, backbone: str = "modernbert"):
    """A padded and an unpadding copy of one encoder (ModernBERT: 3 layers, global, local, local; a 16-token
    window)."""
    config = ModelOptions(backbone=backbone, vocab_size=1000, hidden_size=128, num_layers=3, num_heads=2,
                          intermediate_size=256, max_position_embeddings=256, dropout=dropout,
                          pad_token_id=0).hf_config()
    if backbone == "modernbert":
        config.local_attention = 16
    torch.manual_seed(0)
    padded = Encoder(config).cuda()
    unpadded = Encoder(config).cuda()
    unpadded.load_state_dict(padded.state_dict())
    unpadded.enable_unpadding()
    return padded, unpadded


def batch(rows: int = 8, width: int = 200):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 1000, (rows, width), generator=generator) * mask
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("backbone", ["modernbert", "bert", "roberta"])
def test_varlen_states_and_gradients_equal_the_padded(backbone):
    if unpadding.varlen_attn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    padded, unpadded = encoders(backbone=backbone)
    ids, mask = batch()
    packed = unpadding.Packed.of(mask)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        unpadded.backbone.packed_forward(unpadded.model, packed.pack(ids), packed, mask)
        assert packed.varlen  # CUDA, bf16, no dropout: the varlen kernel
        a = padded(ids, mask)
        b = unpadded(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(b[real].float(), a[real].float(), rtol=2e-2, atol=2e-2)
    a[real].float().square().mean().backward()
    b[real].float().square().mean().backward()
    for (name, p), q in zip(padded.named_parameters(), unpadded.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=5e-2, atol=5e-3, msg=name)


def test_dropout_and_fp32_take_padded_attention():
    # HF's attention modules read the dropout at construction, so it is built in (the varlen kernel has none)
    padded, unpadded = encoders(dropout=0.1)
    ids, mask = batch()
    packed = unpadding.Packed.of(mask)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        unpadded.train().backbone.packed_forward(unpadded.model, packed.pack(ids), packed, mask)
    assert not packed.varlen
    with torch.no_grad():  # fp32: padded attention too, within 1e-5 of the padded batch (dropout off in eval)
        packed = unpadding.Packed.of(mask)
        out = unpadded.eval().backbone.packed_forward(unpadded.model, packed.pack(ids), packed, mask)
        assert not packed.varlen
        torch.testing.assert_close(packed.unpack(out)[mask.bool()], padded.eval()(ids, mask)[mask.bool()],
                                   rtol=1e-5, atol=1e-5)
