"""model.vocab_loss: every path of models/vocab_loss.py computes F.cross_entropy(F.linear(x, weight, bias), labels)
and its gradients, with labels of -100 left out, in fp32 and in bf16; a head trains alike by each; a value that
cannot run is refused naming the key. Liger-Kernel's path runs where it is installed, on CPU under the Triton
interpreter (TRITON_INTERPRET=1, set in conftest.py) in fp32; bf16 through it needs a GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pretrieve.config import ConfigError, load_config
from pretrieve.models import vocab_projection
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import get_method
from pretrieve.models.vocab_loss import VOCAB_LOSSES, resolve, vocab_cross_entropy, vocab_loss_problem
from pretrieve.pretrain_config import experiment

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
PATHS = ["chunked", "plain", pytest.param("liger", marks=pytest.mark.skipif(
    not HAS_LIGER, reason="liger-kernel is installed by the gpu and dev extras"))]
# the autograd node each path leaves on the loss: how a test sees which path ran, without replacing any part
NODES = {"chunked": "_LinearCrossEntropyBackward", "plain": "NllLossBackward0",
         "liger": "LigerFusedLinearCrossEntropyFunctionBackward"}


def _inputs(dtype, vocab=300, rows=45, hidden=16, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(rows, hidden).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden) / hidden ** 0.5).to(dtype).requires_grad_()
    bias = torch.randn(vocab).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,))
    labels[::4] = -100  # every 4th position unlabelled, the first among them
    return x, weight, bias, labels


def _loss_and_grads(fn, x, weight, bias, labels):
    loss = fn(x, weight, bias, labels)
    return (loss.detach().float(), *(g.float() for g in torch.autograd.grad(loss * 3.0, (x, weight, bias))))


def _reference(x, weight, bias, labels):
    """F.cross_entropy of the logits, in fp32 from the (rounded) inputs."""
    x, weight, bias = (t.detach().float().requires_grad_() for t in (x, weight, bias))
    return _loss_and_grads(lambda *a: F.cross_entropy(F.linear(*a[:3]), a[3]), x, weight, bias, labels)


def _near(got, expected, share: float, name: str, floor: float = 0.0) -> None:
    """Asserts `got` is within `share` of the largest entry of `expected` (a tensor's float rounding scales with
    its largest terms, not with each entry), or within `floor` of it: a gradient that is 0 in exact arithmetic
    (a key bias: the softmax does not see it) is rounding noise alone."""
    apart = (got - expected).abs().max().item()
    largest = expected.abs().max().item()
    assert apart <= max(share * largest, floor), f"{name}: {apart:.2e} apart, the largest entry {largest:.2e}"


@pytest.fixture
def small_chunks(monkeypatch):
    """The chunked path in several chunks here (7 rows asked; at least `hidden` = 16 rows a chunk: 3 chunks)."""
    monkeypatch.setitem(vocab_projection.CHUNK_ELEMENTS, "cpu", 7 * 300)


@pytest.mark.parametrize("path", PATHS)
def test_each_path_is_the_cross_entropy_of_the_logits_fp32(path, small_chunks):
    x, weight, bias, labels = _inputs(torch.float32)
    got = _loss_and_grads(lambda *a: vocab_cross_entropy(*a, impl=path), x, weight, bias, labels)
    # measured: at most 1e-6 of the largest entry apart (plain: its gradients bit for bit); sums in another order
    for name, a, b in zip(("loss", "grad_x", "grad_weight", "grad_bias"), got, _reference(x, weight, bias, labels)):
        _near(a, b, 1e-5, name)
    # an unlabelled position gets no gradient at all
    assert torch.equal(torch.autograd.grad(vocab_cross_entropy(x, weight, bias, labels, path), x)[0][::4],
                       torch.zeros_like(x[::4]))


@pytest.mark.parametrize("path", ["chunked", "plain", pytest.param("liger", marks=pytest.mark.skipif(
    not (HAS_LIGER and torch.cuda.is_available()), reason="the Triton interpreter has no bf16 arithmetic"))])
def test_each_path_is_the_cross_entropy_of_the_logits_bf16(path, small_chunks):
    """bf16 inputs against the fp32 formula on the same (rounded) inputs. Each path rounds its GEMM outputs to bf16
    (8 significant bits: a relative step of 2^-8 = 0.4%), the logits and each gradient; the softmax and the sums
    over positions run in fp32. So each result is held to 1% of its largest entry (2.5 bf16 steps; measured:
    0.5% at most, the loss 1e-5 relative), far below what a wrong result moves (a label off by one, an unlabelled
    position counted: ~10% of the loss)."""
    x, weight, bias, labels = _inputs(torch.bfloat16)
    got = _loss_and_grads(lambda *a: vocab_cross_entropy(*a, impl=path), x, weight, bias, labels)
    for name, a, b in zip(("loss", "grad_x", "grad_weight", "grad_bias"), got, _reference(x, weight, bias, labels)):
        _near(a, b, 1e-2, name)


def test_auto_is_chunked_on_cpu_and_plain_on_cuda():
    assert resolve("auto", torch.device("cpu")) == "chunked"
    assert resolve("auto", torch.device("cuda")) == "plain"
    assert [resolve(path, torch.device("cpu")) for path in ("chunked", "plain")] == ["chunked", "plain"]


def _tiny_head(method, path, seed=0):
    spec = get_method(method)
    options = spec.options_from({"max_len": 64})
    model = ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, vocab_loss=path)
    return spec, options, spec.build(options, model, seed=seed)


@pytest.mark.parametrize("method", ["mlm", "retromae"])  # retromae: two vocabulary losses, encoder and decoder
def test_a_head_trains_one_step_alike_by_each_path(method, wiki_samples, vocab):
    """One training step's forward and backward of a head per path, from the same weights and dropout: the loss
    and every gradient equal the plain path's to fp32 rounding."""
    results = {}
    paths = [p for p in VOCAB_LOSSES if p != "auto" and (p != "liger" or HAS_LIGER)]
    for path in paths:
        spec, options, head = _tiny_head(method, path)
        batch = spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
        torch.manual_seed(1)  # the same dropout masks
        out = head(batch)
        out["loss"].backward()
        results[path] = out["loss"].item(), {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
        hidden = head.encoder(batch["input_ids"], batch["attention_mask"])  # the path token_loss took
        node = head.encoder.token_loss(hidden, batch["mlm_labels"]).grad_fn
        if type(node).__name__ == "WhereBackward0":  # the guard of a batch without labels (zero_without_labels)
            node = next(f for f, _ in node.next_functions if f is not None)
        assert type(node).__name__ == NODES[path]
    loss, grads = results["plain"]
    assert "encoder.model.embeddings.word_embeddings.weight" in grads  # the tied vocabulary projection trains
    for path in paths:
        assert results[path][0] == pytest.approx(loss, rel=1e-6), path
        assert results[path][1].keys() == grads.keys()
        for name in grads:  # fp32 rounding through the network: measured at most 5e-6 of its largest entry apart
            _near(results[path][1][name], grads[name], 2e-5, f"{path}: {name}", floor=1e-9)


def test_an_unknown_or_unusable_path_is_refused_naming_the_key(wiki_shards, monkeypatch):
    config = load_config(CONFIGS / "tiny-mlm.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                     "data.weights=null", "model.vocab_loss=fast"])
    with pytest.raises(ConfigError, match="model.vocab_loss: 'fast' is not one of auto, chunked, plain, liger"):
        experiment(config)
    with pytest.raises(ValueError, match="model.vocab_loss: 'fast'"):  # a head built without the config check
        _tiny_head("mlm", "fast")[2]({"input_ids": torch.ones(1, 4, dtype=torch.long),
                                      "attention_mask": torch.ones(1, 4, dtype=torch.long),
                                      "mlm_labels": torch.tensor([[-100, 5, -100, -100]])})
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # as Python sees an uninstalled package
    assert vocab_loss_problem("liger") == ("model.vocab_loss: liger needs liger_kernel, which is not installed: "
                                           "pip install 'pretrieve[gpu]' (or pip install liger-kernel)")


@pytest.mark.skipif(not HAS_LIGER or torch.cuda.is_available(), reason="liger-kernel installed, no GPU")
def test_liger_without_a_gpu_or_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert "model.vocab_loss: liger runs Liger-Kernel's Triton kernels, which need a CUDA device" in \
        vocab_loss_problem("liger")
