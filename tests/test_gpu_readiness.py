"""What a GPU run needs from the engine, checked on CPU: device RNG states saved and restored by checkpoints,
`train.deterministic`, no host read of device values in the training loop's micro-steps, and the peak FLOPs
table behind MFU. The CUDA branches run in tests/test_engine_gpu.py (`make test-gpu`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import json_lines, pretrain_env
from pretrieve.config import ConfigError, load_config
from pretrieve.engine.determinism import CUBLAS_WORKSPACE, deterministic
from pretrieve.engine.flops import device_peak, gpu_peak
from pretrieve.engine.rng import generator_states, rng_state, set_generator_states, set_rng_state
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-retromae.yaml"


def _dropout_masks(generators):
    return [torch.bernoulli(torch.full((64,), 0.5), generator=g) for g in generators]


def test_device_generator_states_replay_the_draws():
    """The helper that carries every CUDA device's generator through a checkpoint, on CPU generators: restored
    states replay the draws (dropout masks) exactly; another count of devices is refused by name."""
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    saved = generator_states(generators)
    first = _dropout_masks(generators)
    assert not torch.equal(first[0], first[1])
    set_generator_states(generators, saved, "ckpt/step00000002")
    assert all(torch.equal(a, b) for a, b in zip(first, _dropout_masks(generators)))
    with pytest.raises(ValueError, match="ckpt/step00000002: the checkpoint holds 2 device RNG states, this "
                                         "process has 1 devices"):
        set_generator_states(generators[:1], saved, "ckpt/step00000002")


def test_rng_state_round_trip_and_older_checkpoints():
    state = rng_state()
    assert state["devices"] == [] and not torch.cuda.is_available()  # no CUDA here: the CPU path
    expected = torch.rand(3)
    set_rng_state(state, "ckpt")
    assert torch.equal(torch.rand(3), expected)
    older = {key: value for key, value in state.items() if key != "devices"}  # written before devices were saved
    set_rng_state(older, "ckpt")
    assert torch.equal(torch.rand(3), expected)


def test_deterministic_switches_are_set_for_the_run_and_restored():
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
              os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    with deterministic(True):
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before
    with deterministic(False):
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("name,part,peak", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA A10", "A10", 125e12),
])
def test_peak_flops_by_device_name(name, part, peak):
    assert gpu_peak(name, "bf16") == (part, peak) and gpu_peak(name, "fp16") == (part, peak)


def test_a_turing_gpu_has_an_fp16_peak_and_no_bf16_one():
    """Turing computes no bf16: MFU is left out of such a run, and the estimates refuse bf16 on it."""
    name = "NVIDIA GeForce RTX 2080 Ti"
    assert gpu_peak(name, "fp16") == ("RTX 2080 Ti", 53.8e12) and gpu_peak(name, "fp32") == ("RTX 2080 Ti", 13.4e12)
    assert gpu_peak(name, "bf16") == ("RTX 2080 Ti", None)


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA L40", "Tesla V100-SXM2-16GB", "NVIDIA GeForce RTX 4090"])
def test_an_unknown_gpu_has_no_peak(name):
    """Not in the table: MFU is left out rather than computed against another part's peak."""
    assert gpu_peak(name, "bf16") is None


def test_peak_flops_override(wiki_shards):
    assert device_peak(torch.device("cpu"), "fp32", override=2.5e14) == 2.5e14
    with pytest.raises(ConfigError, match="train.peak_flops: must be > 0"):
        experiment(load_config(CONFIG, [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                                        "train.peak_flops=-1"]))


# Counts host reads of tensor values (item, tolist, float, int, bool) by the function of the loop, its metrics
# window or the recipe that makes them; run in a fresh process (DeepSpeed's process-wide state stays out of the
# test process).
_COUNT_READS = """
import collections, json, sys, torch
from pretrieve import pretrain
from pretrieve.config import load_config
from pretrieve.engine import metrics, train as loop
from pretrieve.pretrain_config import experiment
reads = collections.Counter()
def counting(name):
    original = getattr(torch.Tensor, name)
    def read(self, *args):
        caller = sys._getframe(1).f_code
        if caller.co_filename in (loop.__file__, metrics.__file__, pretrain.__file__):
            reads[caller.co_name] += 1
        return original(self, *args)
    setattr(torch.Tensor, name, read)
for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
    counting(name)
pretrain.train(experiment(load_config(sys.argv[1], json.loads(sys.argv[2]))))
print(json.dumps(reads))
"""


def test_micro_steps_read_nothing_back_from_the_device(tmp_path, wiki_shards):
    """8 micro-steps (4 steps x 2 accumulated), one log step, train.deterministic and a peak override on:
    the loop body itself reads no tensor value (on a GPU each read waits for the device); losses are read
    once, at the log step. The job's count of a batch reads the host copy by numpy, before the transfer. MFU
    is tflops / train.peak_flops."""
    overrides = [f"run_dir={tmp_path / 'run'}", f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                 "data.weights=null", "method.max_len=64", "train.micro_batch_size=4", "train.grad_accum=2",
                 "train.max_steps=4", "train.log_every=4", "checkpoint.every=4", "tracking.enabled=false",
                 "train.deterministic=true", "train.peak_flops=1e9"]
    done = subprocess.run([sys.executable, "-c", _COUNT_READS, str(CONFIG), json.dumps(overrides)],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reads = json_lines(done.stdout)[-1]
    assert "_train_steps" not in reads, reads  # the loop body: the old code read every loss part, every micro-step
    assert "add" not in reads, reads  # the metrics window sums on the device
    assert reads["log"] == 1  # one tolist of the stacked sums
    assert "count_texts" not in reads, reads  # the job's count: numpy on the host batch, before the transfer
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["loss"] > 0
    assert record["mfu"] == pytest.approx(record["tflops_per_device"] * 1e12 / 1e9, rel=1e-12)
