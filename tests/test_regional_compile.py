"""Regional compilation (`train.compile`, models/regional_compile.py): each layer compiled by inductor on CPU
computes what the eager layer computes, forward and backward; one graph serves both layers of the stack and
every sequence length; a short pre-training run gives the eager run's losses. Dropout is off throughout:
inductor draws its own dropout masks."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from support import pretrain_env
from pretrieve.config import ConfigError, load_config
from pretrieve.models.encoder import Encoder, ModelOptions
from pretrieve.models.heads import get_method
from pretrieve.models.low_precision_norm import lower_norm_precision
from pretrieve.models.regional_compile import compile_layers, compiled_layers
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
LENGTHS = (16, 24, 40, 33)
TINY = dict(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, pad_token_id=0,
            dropout=0.0)
# inductor's CPU backend builds C++ (torch._inductor.config.cpp.cxx: $CXX, else g++)
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                    reason="inductor compiles C++ on CPU: no C++ compiler ($CXX or g++) on PATH")


@pytest.fixture(scope="module")
def eager_and_compiled():
    """A tiny BERT encoder and its compiled copy, each run forward and backward on batches of four lengths (a
    padded text in each): [(eager states, compiled states, eager grads, compiled grads)], and how many graphs
    dynamo compiled for them."""
    torch.manual_seed(0)
    eager = Encoder.build(ModelOptions(**TINY))
    compiled = Encoder.build(ModelOptions(**TINY))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled)
    runs = []
    for width in LENGTHS:
        ids = torch.randint(3, 1000, (4, width))
        mask = torch.ones_like(ids)
        mask[1, width // 2:] = 0
        weights = torch.randn(4, width, TINY["hidden_size"])  # a loss whose gradient differs at every state
        states = []
        for encoder in (eager, compiled):
            encoder.zero_grad()
            out = encoder(ids, mask)
            (out * weights).sum().backward()
            states.append((out.detach(), {n: p.grad.clone() for n, p in encoder.named_parameters()
                                          if p.grad is not None}))
        runs.append((states[0][0], states[1][0], states[0][1], states[1][1]))
    return runs, counters["stats"]["unique_graphs"]


def test_the_layers_compile_in_place():
    """Every encoder layer and the decoder's, compiled where they are: the state dict keeps its keys."""
    method = get_method("retromae")
    head = method.build(method.options_from({}), ModelOptions(**TINY))
    keys = list(head.state_dict())
    layers = compile_layers(head)
    assert [type(layer).__name__ for layer in layers] == ["BertLayer", "BertLayer", "BertDecoderLayer"]
    assert layers == compiled_layers(head) and all(layer._compiled_call_impl is not None for layer in layers)
    assert list(head.state_dict()) == keys


@needs_compiler
def test_compiled_layers_compute_the_eager_states_and_gradients(eager_and_compiled):
    """fp32: states within 1e-5 (measured: 7e-7); each gradient within 1e-5 of its largest entry, plus 1e-6
    for the key biases' gradients, zero but for rounding (measured: 7e-7 of the largest entry), as inductor fuses
    and reorders the sums (the embeddings' gradients add up thousands of terms)."""
    runs, _ = eager_and_compiled
    for eager, compiled, eager_grads, compiled_grads in runs:
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        assert compiled_grads.keys() == eager_grads.keys() and len(eager_grads) > 10
        for name, grad in eager_grads.items():
            error = (compiled_grads[name] - grad).abs().max()
            assert error <= 1e-5 * grad.abs().max() + 1e-6, (name, error.item(), grad.abs().max().item())


@needs_compiler
def test_one_graph_serves_every_layer_and_length(eager_and_compiled):
    """Symbolic sizes from the first compile: both layers and four lengths run one graph (measured: 1)."""
    _, graphs = eager_and_compiled
    assert graphs == 1


@needs_compiler
def test_compiled_layers_with_low_precision_norms_under_autocast():
    """train.low_precision_norm with train.compile (the speed ladder's compile rung is on top of it): under bf16
    autocast the compiled layers with the swapped norms run as one graph without a break, their states within
    bf16's rounding of the eager ones (measured: one bf16 step, 0.03 at |states| up to 4) and each gradient
    within 5 % of its largest entry (measured: 1.9 %; inductor keeps fused intermediates in fp32)."""
    torch.manual_seed(0)
    eager = Encoder.build(ModelOptions(**TINY))
    lower_norm_precision(eager)
    compiled = Encoder.build(ModelOptions(**TINY))
    lower_norm_precision(compiled)
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled)
    for width in LENGTHS[:3]:
        ids = torch.randint(3, 1000, (4, width))
        mask = torch.ones_like(ids)
        mask[1, width // 2:] = 0
        weights = torch.randn(4, width, TINY["hidden_size"])
        runs = []
        for encoder in (eager, compiled):
            encoder.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = encoder(ids, mask)
            (out.float() * weights).sum().backward()
            runs.append((out.detach().float(), {n: p.grad for n, p in encoder.named_parameters() if p.grad is not None}))
        (states, grads), (compiled_states, compiled_grads) = runs
        assert out.dtype == torch.bfloat16  # the last norm ran in bf16
        torch.testing.assert_close(compiled_states, states, rtol=1.6e-2, atol=1.6e-2)
        scale = max(g.abs().max() for g in grads.values())
        for name, grad in grads.items():
            if grad.abs().max() > 1e-6 * scale:  # not the key biases', zero but for rounding
                assert (compiled_grads[name] - grad).abs().max() <= 0.05 * grad.abs().max(), name
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_compile_under_zero_3_is_refused(wiki_shards):
    with pytest.raises(ConfigError, match="train.compile: ZeRO 3 gathers each layer's parameters"):
        experiment(load_config(CONFIGS / "tiny-mlm.yaml", [
            f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "train.compile=true",
            "train.zero_stage=3"]))


def _losses(run_dir: Path, wiki_shards: Path, compile_layers: bool) -> list[dict]:
    """The run's metrics records; its inductor cache in run_dir/inductor (what was compiled, if anything)."""
    done = subprocess.run(
        [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-retromae.yaml"), f"run_dir={run_dir}",
         f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
         "model.dropout=0.0", "train.max_steps=3", "train.log_every=1", "checkpoint.every=3",
         "tracking.enabled=false", "train.zero_stage=2", f"train.compile={str(compile_layers).lower()}"],
        env=pretrain_env(TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor")), capture_output=True, text=True,
        timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recompile_limit" not in done.stderr  # no layer gave up compiling and fell back to eager
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs_compiler
def test_pretraining_with_compiled_layers_gives_the_eager_losses(tmp_path, wiki_shards):
    """Three RetroMAE steps (its encoder's MLM loss and its decoder's) under DeepSpeed ZeRO 2: each loss within
    1e-5 of the eager run's, the gradient norms within 1e-4 (measured: losses equal, norms within 1e-7)."""
    eager = _losses(tmp_path / "eager", wiki_shards, compile_layers=False)
    compiled = _losses(tmp_path / "compiled", wiki_shards, compile_layers=True)
    assert [r["step"] for r in compiled] == [1, 2, 3]
    # inductor's generated code (measured: 4 files, forward and backward of the encoder and decoder layers)
    assert any((tmp_path / "compiled" / "inductor").rglob("*.py"))
    assert not any((tmp_path / "eager" / "inductor").rglob("*.py"))
    for key, rel in (("loss", 1e-5), ("mlm", 1e-5), ("dec", 1e-5), ("grad_norm", 1e-4)):
        assert [r[key] for r in compiled] == pytest.approx([r[key] for r in eager], rel=rel), key
