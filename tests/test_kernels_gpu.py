"""The fused two-stream attention on a GPU (kernel issue, item 4): bf16 / fp16 parity with the fp32 reference
on real shapes (head dims 32, 64, 128; L up to 1,000, ragged and not a block multiple), and one RetroMAE decoder
training step giving the same loss and gradients with the fused kernel and eager. Skipped without CUDA; on a
GPU machine `make test-gpu` runs them (the interpreter tests of test_kernels.py are for CPUs)."""

import pytest
import torch

from pretrieve.kernels import two_stream_attention
from pretrieve.kernels.fused import available
from test_kernels import _mask, decoder_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and available()), reason="needs CUDA and triton")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width,head_dim", [(512, 64), (1000, 32), (257, 128), (128, 64)])
def test_fused_matches_reference_on_real_shapes(width, head_dim, dtype):
    torch.manual_seed(0)
    lengths = [width, width // 2 + 3, 40, width - 7]  # ragged; the widest sets L
    mask = _mask(lengths, width, seed=1)
    mask = type(mask)(*(t.cuda() for t in (mask.dec_pool, mask.dec_row, mask.lengths)))
    q, k, v = (torch.randn(4, 12, width, head_dim, device="cuda").to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(4, 12, width, head_dim, device="cuda").to(dtype)
    out = two_stream_attention(q, k, v, mask, impl="fused")
    out.backward(grad)
    fused = [out.detach()] + [x.grad for x in (q, k, v)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = two_stream_attention(q32, k32, v32, mask, impl="eager")
    ref.backward(grad.float())
    # bf16 keeps 8 bits of mantissa: the inputs' own rounding bounds how close any bf16 kernel gets
    tolerance = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for name, got, want in zip(("out", "dq", "dk", "dv"), fused, (ref.detach(), q32.grad, k32.grad, v32.grad)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("backbone", ["bert", "modernbert"])
def test_decoder_step_fused_equals_eager_on_gpu(wiki_samples, vocab, backbone):
    """One RetroMAE training step at BERT-base width in bf16 autocast: loss and gradients of fused vs eager
    (ModernBERT: queries and keys rotated before the kernel)."""
    from pretrieve.models.encoder import ModelOptions

    model = ModelOptions(backbone=backbone, pad_token_id=0, hidden_size=768, num_layers=2, num_heads=12,
                         intermediate_size=3072, dropout=0.0)
    results = decoder_steps(wiki_samples[:8], vocab, model, max_len=512, device="cuda",
                            autocast=torch.autocast("cuda", dtype=torch.bfloat16))
    assert results["fused"][0] == pytest.approx(results["eager"][0], rel=1e-2)
    eager, fused = results["eager"][1], results["fused"][1]
    for name, grad in eager.items():
        if name.endswith("key.bias"):
            # a bias added to every key shifts each query's scores alike, which softmax ignores: its gradient is
            # zero but for rounding, which differs between kernels (seen on an H100), so both stay at that level
            weight = eager[name.replace("bias", "weight")].abs().max().item()
            assert max(fused[name].abs().max().item(), grad.abs().max().item()) <= 5e-2 * weight, name
            continue
        scale = grad.abs().max().item() or 1.0
        torch.testing.assert_close(fused[name] / scale, grad / scale, atol=3e-2, rtol=0, msg=name)
