"""The chunked vocabulary projections equal their plain formulas in value and in every gradient."""

import pytest
import torch
import torch.nn.functional as F

from pretrieve.models import vocab_projection
from pretrieve.models.heads.dupmae import ot_vector
from pretrieve.models.vocab_projection import linear_cross_entropy, max_pooled_linear


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 1000])  # chunks of 4 (= hidden) rows, of 7 (ragged), one
@pytest.mark.parametrize("frozen_weight", [False, True])  # LoRA's tied embeddings: no weight gradient made
def test_matches_cross_entropy_of_the_logits(monkeypatch, rows_per_chunk, frozen_weight):
    vocab = 300
    monkeypatch.setitem(vocab_projection.CHUNK_ELEMENTS, "cpu", rows_per_chunk * vocab)
    torch.manual_seed(0)
    x = torch.randn(45, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 4, dtype=torch.float64, requires_grad=not frozen_weight)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (45,))
    inputs = (x, bias) if frozen_weight else (x, weight, bias)

    reference = F.cross_entropy(F.linear(x, weight, bias), labels)
    expected = torch.autograd.grad(reference * 3.0, inputs)  # a scaled upstream gradient
    loss = linear_cross_entropy(x, weight, bias, labels)
    got = torch.autograd.grad(loss * 3.0, inputs)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-12)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_without_gradients_it_is_the_plain_loss():
    x, weight, bias = torch.randn(5, 8), torch.randn(20, 8), torch.randn(20)
    labels = torch.randint(0, 20, (5,))
    with torch.no_grad():
        assert torch.equal(linear_cross_entropy(x, weight, bias, labels),
                           F.cross_entropy(F.linear(x, weight, bias), labels))


@pytest.mark.parametrize("columns_per_chunk", [1, 7, 1000])
def test_max_pooled_linear_matches_the_max_of_the_logits(monkeypatch, columns_per_chunk):
    batch, width, vocab = 3, 6, 50
    monkeypatch.setitem(vocab_projection.CHUNK_ELEMENTS, "cpu", columns_per_chunk * batch * width)
    torch.manual_seed(1)
    x = torch.randn(batch, width, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(batch, width) < 0.6
    mask[2] = False  # a text without positions: zeros, no gradient
    upstream = torch.randn(batch, vocab, dtype=torch.float64)

    reference = ot_vector(F.linear(x, weight, bias), mask)
    expected = torch.autograd.grad((reference * upstream).sum(), (x, weight, bias))
    pooled = max_pooled_linear(x, weight, bias, mask)
    got = torch.autograd.grad((pooled * upstream).sum(), (x, weight, bias))
    torch.testing.assert_close(pooled, reference, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
