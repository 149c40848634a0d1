"""The fused two-stream attention against the reference: outputs and dq/dk/dv, ragged lengths, L not a block
multiple, head dims 16-64, fp32 and fp16, and each tile width of the in-kernel mask words (16-128 keys) on pools
of random bits. Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set in
conftest.py); bf16 needs a GPU (the interpreter has no bf16 arithmetic)."""

import numpy as np
import pytest
import torch

from pretrieve.data.masking import decoder_mask_pool
from pretrieve.kernels import CompactMask, resolve, two_stream_attention
from pretrieve.kernels import fused
from pretrieve.kernels.fused import available

pytestmark = [pytest.mark.system,  # Triton's interpreter: seconds a kernel call
              pytest.mark.skipif(not available(), reason="triton is installed by `make install` ([dev])"),
              # CPU tensors through the Triton interpreter; on a GPU machine test_kernels_gpu.py runs the kernels
              pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; see test_kernels_gpu.py")]


def _mask(lengths, width, seed=0, pool_size=256):
    lengths = np.asarray(lengths)
    pos = np.arange(width)[None]
    words = np.where((pos >= 1) & (pos < lengths[:, None] - 1), (pos - 1) // 2, -1)  # two-token words
    pool, rows = decoder_mask_pool(words, (lengths - 1) // 2, lengths, pool_size, 0.5, np.random.default_rng(seed))
    return CompactMask(torch.from_numpy(pool), torch.from_numpy(rows), torch.from_numpy(lengths))


def _random_mask(lengths, width, pool_size, seed=0):
    """Pool rows of random bits, padding and every row's own position included, so that the kernel's own j != i
    and j < length do the hiding (a collated pool never shows padding). Keys 0 and 1 stay visible, so every
    query row sees one at least (the reference gives NaN for a row that sees nothing)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (len(lengths), pool_size, -(-width // 8)), generator=gen, dtype=torch.uint8)
    pool[..., 0] |= 0b11
    rows = torch.randint(0, pool_size, (len(lengths), width), generator=gen).to(torch.int16)
    return CompactMask(pool, rows, torch.tensor(lengths))


def _parity(batch, heads, width, head_dim, lengths, dtype, atol, seed=0, mask=None):
    torch.manual_seed(seed)
    mask = _mask(lengths, width, seed) if mask is None else mask
    q, k, v = (torch.randn(batch, heads, width, head_dim).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, width, head_dim).to(dtype)
    out = two_stream_attention(q, k, v, mask, impl="fused")
    out.backward(grad)
    fused = [out.detach()] + [x.grad.clone() for x in (q, k, v)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = two_stream_attention(q32, k32, v32, mask, impl="eager")
    ref.backward(grad.float())
    expected = [ref.detach(), q32.grad, k32.grad, v32.grad]
    for name, got, want in zip(("out", "dq", "dk", "dv"), fused, expected):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize("width,head_dim,lengths", [
    (37, 32, [37, 20]),  # L not a multiple of the block, ragged lengths
    (48, 16, [48, 33]),
    (20, 64, [20, 5]),
])
def test_fused_matches_reference_fp32(width, head_dim, lengths):
    _parity(2, 2, width, head_dim, lengths, torch.float32, atol=2e-5)


@pytest.mark.parametrize("tile,width,lengths", [
    (fused.Launch(16, 16, 1, 1), 37, [37, 20, 2]),  # 32-bit shifts, one word
    (fused.Launch(16, 32, 1, 1), 70, [70, 33, 64]),  # a length at a word's end
    (fused.Launch(32, 64, 1, 1), 150, [150, 77, 65]),  # 64-bit shifts, a whole word a tile
    (fused.Launch(16, 128, 1, 1), 150, [150, 128, 9]),  # two words a tile; a length at the second's end
], ids=lambda value: "{}x{}".format(*value) if isinstance(value, fused.Launch) else None)
def test_fused_mask_words_match_reference(monkeypatch, tile, width, lengths):
    """Forward and backward of every tile width against eager, batch 3, L not a multiple of the tile, random
    pools (bits past the length and on the diagonal set: the kernel hides them) and rows drawn from 5."""
    monkeypatch.setattr(fused, "INTERPRETER", tile)
    _parity(3, 2, width, 16, lengths, torch.float32, atol=2e-5, mask=_random_mask(lengths, width, 5, seed=3))


def test_pool_words_keep_every_bit():
    """The uint8 pool as the kernel's int64 words: bit j of a row is bit j % 64 of word j // 64, any offset."""
    pool = torch.randint(0, 256, (3, 4, 10), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    words = fused.pool_words(pool[1:])
    assert words.dtype == torch.int64 and words.shape == (2, 4, 2)
    j = torch.arange(80)
    bits = (words[..., j // 64] >> (j % 64)) & 1
    expected = (pool[1:, :, j // 8] >> (j % 8)) & 1
    assert torch.equal(bits, expected.long())


def test_fused_matches_reference_fp16():
    _parity(2, 2, 40, 32, [40, 23], torch.float16, atol=5e-3)


def test_fused_on_a_collated_batch(wiki_samples, vocab):
    from pretrieve.models.heads.retromae import RetroMAECollator

    batch = RetroMAECollator(vocab, max_len=72, seed=4)(wiki_samples[:2])
    mask = CompactMask(batch["dec_pool"], batch["dec_row"], batch["attention_mask"].sum(1))
    width = batch["input_ids"].shape[1]
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, width, 16) for _ in range(3))
    torch.testing.assert_close(two_stream_attention(q, k, v, mask, impl="fused"),
                               two_stream_attention(q, k, v, mask, impl="sdpa"), atol=2e-5, rtol=2e-5)


def test_dispatch_rules():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu) == "sdpa"
    assert resolve("auto", cpu, length=512) == "sdpa"
    assert resolve("fused", cpu) == "fused"
    with pytest.raises(ValueError, match="no attention dropout"):
        resolve("fused", cpu, dropout_p=0.1)
    with pytest.raises(ValueError, match="not one of"):
        resolve("flash", cpu)


def decoder_steps(samples, vocab, model, max_len: int, device: str = "cpu", autocast=None) -> dict:
    """{impl: (loss, {parameter: gradient})} of one RetroMAE training step with the fused kernel and eager."""
    from contextlib import nullcontext

    from pretrieve.models.heads import get_method

    method = get_method("retromae")
    results = {}
    for impl in ("fused", "eager"):
        options = method.options_from({"max_len": max_len, "attention_impl": impl})
        head = method.build(options, model, seed=0).to(device)
        batch = {k: v.to(device) for k, v in method.collator.from_options(options, vocab, seed=0)(samples).items()}
        with autocast or nullcontext():
            loss = head(batch)["loss"]
        loss.backward()
        results[impl] = (loss.item(), {n: p.grad.float() for n, p in head.named_parameters() if p.grad is not None})
    return results


def test_modernbert_decoder_step_fused_equals_eager(wiki_samples, vocab):
    """The fused kernel takes ModernBERT's decoder queries and keys after their rotation (RoPE) unchanged."""
    from pretrieve.models.encoder import ModelOptions

    model = ModelOptions(backbone="modernbert", pad_token_id=0, hidden_size=32, num_layers=1, num_heads=2,
                         intermediate_size=64, dropout=0.0)
    results = decoder_steps(wiki_samples[:2], vocab, model, max_len=40)
    assert results["fused"][0] == pytest.approx(results["eager"][0], rel=1e-5)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["fused"][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_decoder_step_fused_equals_eager(wiki_samples, vocab):
    """One RetroMAE decoder training step: the same loss and gradients with the fused kernel and eager."""
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    model = ModelOptions(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, dropout=0.0)
    results = decoder_steps(wiki_samples[:2], vocab, model, max_len=40)
    assert results["fused"][0] == pytest.approx(results["eager"][0], rel=1e-5)
    for name, grad in results["eager"][1].items():
        torch.testing.assert_close(results["fused"][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)

    method = get_method("retromae")
    with pytest.raises(ValueError, match="no attention dropout"):
        method.build(method.options_from({"attention_impl": "fused", "decoder_attention_dropout": 0.1}), model)
