"""Low-precision LayerNorm (`train.low_precision_norm`, models/low_precision_norm.py): under bf16 autocast on CPU
every nn.LayerNorm of a head normalises in bf16 (autocast alone returns fp32 from the residual stream's), and one forward and backward
gives fp32's loss and gradients within bf16's rounding, as autocast alone does; outside autocast the step is the
plain one bit for bit; the parameters, and so the state dict and what the optimizer steps, are the same tensors."""

import copy
from itertools import islice

import pytest
import torch
from torch import nn

from support import TINY_CONFIGS, tiny_head
from pretrieve.config import ConfigError, load_config
from pretrieve.data.stream import ShardStream
from pretrieve.models.low_precision_norm import LowPrecisionLayerNorm, lower_norm_precision
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

BACKBONES = ("bert", "roberta", "xlm-roberta", "modernbert")
CASES = [(backbone, method) for backbone in BACKBONES for method in ("mlm", "retromae")] + [("bert", "dupmae")]


@pytest.fixture(scope="module")
def samples(wiki_shards):
    return list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=8)), 8))


def head_and_batch(backbone: str, method: str, samples, vocab):
    # ModernBERT's own pad id is outside the tiny configs' vocabulary
    spec, options, head = tiny_head(method, f"model.backbone={backbone}", "method.max_len=96",
                                    *(["model.pad_token_id=0"] if backbone == "modernbert" else []))
    return head, spec.collator.from_options(options, vocab, seed=0)(samples)


def step(head: nn.Module, batch: dict, autocast: bool) -> tuple[float, dict, set]:
    """(loss, gradients, the dtypes the LayerNorms returned) of one forward and backward."""
    dtypes = set()
    hooks = [m.register_forward_hook(lambda m, i, out: dtypes.add(out.dtype)) for m in head.modules()
             if isinstance(m, nn.LayerNorm)]
    head.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = head(batch)["loss"]
    loss.backward()
    for hook in hooks:
        hook.remove()
    return loss.item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}, dtypes


def worst_error(grads: dict, reference: dict) -> float:
    """The largest error of a gradient relative to its own largest entry, over the gradients that are not zero
    but for rounding (a key bias's)."""
    scale = max(g.abs().max() for g in reference.values())
    return max(((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in reference.items()
               if g.abs().max() > 1e-6 * scale)


def cosine(grads: dict, reference: dict) -> float:
    a, b = (torch.cat([d[n].flatten().double() for n in reference]) for d in (grads, reference))
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("backbone,method", CASES)
def test_norms_run_in_bf16_within_autocasts_rounding(backbone, method, samples, vocab):
    """Loss within 1e-4 of fp32's (measured: 1.1e-5; autocast alone 9e-6), each gradient within 10 % of its
    largest entry (measured: 6.2 %, a decoder norm's; autocast alone 4.6 %), the whole gradient's cosine with
    fp32's above 0.999 (measured: 1 - 8e-5)."""
    head, batch = head_and_batch(backbone, method, samples, vocab)
    low = copy.deepcopy(head)
    norms = sum(type(m) is nn.LayerNorm for m in head.modules())
    assert lower_norm_precision(low) == norms > 0
    assert not any(type(m) is nn.LayerNorm for m in low.modules())
    fp32_loss, fp32_grads, _ = step(head, batch, autocast=False)
    _, _, autocast_dtypes = step(head, batch, autocast=True)
    loss, grads, dtypes = step(low, batch, autocast=True)
    # autocast alone: the residual stream's norms return fp32 (on a GPU every norm runs in fp32 under autocast;
    # on CPU a norm runs in its input's dtype, so the MLM transform's is bf16 there)
    assert torch.float32 in autocast_dtypes and dtypes == {torch.bfloat16}
    assert loss == pytest.approx(fp32_loss, rel=1e-4)
    assert grads.keys() == fp32_grads.keys()
    assert worst_error(grads, fp32_grads) <= 0.10
    assert cosine(grads, fp32_grads) > 0.999


def test_outside_autocast_the_step_is_the_plain_one(samples, vocab):
    """fp32, no autocast: loss and every gradient equal bit for bit; the state dict's keys and tensors are the
    plain head's."""
    head, batch = head_and_batch("bert", "retromae", samples, vocab)
    low = copy.deepcopy(head)
    before = {n: p for n, p in low.named_parameters()}
    lower_norm_precision(low)
    assert {n: p for n, p in low.named_parameters()} == before  # the same Parameter objects
    assert list(low.state_dict()) == list(head.state_dict())
    assert any(isinstance(m, LowPrecisionLayerNorm) for m in low.modules())
    plain_loss, plain_grads, _ = step(head, batch, autocast=False)
    loss, grads, dtypes = step(low, batch, autocast=False)
    assert loss == plain_loss and dtypes == {torch.float32}
    assert all(torch.equal(grads[n], g) for n, g in plain_grads.items())


def test_low_precision_norm_needs_bf16_autocast(wiki_shards):
    base = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "train.low_precision_norm=true"]
    config = load_config(TINY_CONFIGS / "tiny-mlm.yaml",
                         [*base, "train.precision=bf16-autocast"])
    assert experiment(config).train.low_precision_norm
    for precision in ("fp32", "bf16"):
        with pytest.raises(ConfigError, match=f"train.low_precision_norm: changes only a train.precision "
                                              f"bf16-autocast run .* not {precision}"):
            experiment(load_config(TINY_CONFIGS / "tiny-mlm.yaml",
                                   [*base, f"train.precision={precision}"]))


def test_a_model_without_a_layer_norm_is_refused():
    """A decoder LLM's RMSNorms keep their own precision: the switch would change nothing, so it says so."""
    with pytest.raises(ValueError, match="train.low_precision_norm: Sequential has no nn.LayerNorm"):
        lower_norm_precision(nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4)))
