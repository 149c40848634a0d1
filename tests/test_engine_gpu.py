"""The engine on a GPU (`make test-gpu`; skipped without CUDA): one step of every method in bf16 and fp16 at
ZeRO 2; a resume reproduces the uninterrupted run's losses bit for bit with `train.deterministic: true` (the
CUDA generators travel in the checkpoint: dropout is on), in bf16 and in fp16 with dynamic loss scaling; and
no micro-step of the loop waits for the device."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import json_lines

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parent.parent
METHODS = "mlm,retromae,dupmae,seed,costa,cotmae,cotmote"


def gpu_env() -> dict:
    """A `pretrieve` subprocess on the GPU: its own world of one rank."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "DS_ACCELERATOR")}
    return {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0")}


def _run(args: list[str], timeout: int = 900) -> str:
    done = subprocess.run([sys.executable, *args], env=gpu_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_step_of_every_method_at_zero2(tmp_path, wiki_shards, precision):
    out = _run([str(ROOT / "tests" / "one_step.py"), str(tmp_path), str(wiki_shards / "manifest.json"), METHODS,
                "2", precision])
    results = json_lines(out)
    assert sorted(r["method"] for r in results) == sorted(METHODS.split(","))
    for r in results:
        assert r["finite"] and r["step"] == 3 and r["changed"] == r["trainable"], r


def _pretrain(run_dir: Path, wiki_shards: Path, *overrides: str) -> list[dict]:
    _run(["-m", "pretrieve", "pretrain", str(ROOT / "configs" / "pretrain" / "tiny-retromae.yaml"),
          f"run_dir={run_dir}", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
          "method.max_len=128", "train.max_steps=6", "train.log_every=1", "checkpoint.every=100",
          "tracking.enabled=false", "train.deterministic=true", "train.zero_stage=2",
          "method.decoder_attention_dropout=0", *overrides])  # the fused kernel: no attention dropout
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_deterministic_resume_reproduces_the_uninterrupted_run(tmp_path, wiki_shards, precision):
    full = _pretrain(tmp_path / "full", wiki_shards, f"train.precision={precision}")
    _pretrain(tmp_path / "split", wiki_shards, f"train.precision={precision}", "train.stop_at=3")
    split = _pretrain(tmp_path / "split", wiki_shards, f"train.precision={precision}", "resume=auto")
    assert [r["step"] for r in split] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in split] == [r["loss"] for r in full]
    if precision == "fp16":  # dynamic loss scaling: the scale is logged and resumes with the run
        assert [r["loss_scale"] for r in split] == [r["loss_scale"] for r in full]


_SYNC_SITES = """
import collections, json, sys, warnings, torch
from pretrieve.config import load_config
from pretrieve.pretrain import train
from pretrieve.pretrain_config import experiment
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")  # every synchronising CUDA call warns, from the Python line that made it
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    train(experiment(load_config(sys.argv[1], json.loads(sys.argv[2]))))
sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
print(json.dumps(sites))
"""


def test_micro_steps_do_not_wait_for_the_device(tmp_path, wiki_shards):
    """torch's sync debug mode on a bf16 run with the fused kernel: the training loop's own lines make no
    synchronising call outside its log step (engine/metrics.py: the window's `log`, `plain_grad_norm`) and its
    checkpoints (engine/checkpoint.py). DeepSpeed's step and the heads' count of each token loss's labelled
    positions (models/encoder.py; benchmarks/dispatch_count.py counts these reads on CPU) may; their sites are
    printed."""
    from pretrieve.engine import train as engine

    overrides = [f"run_dir={tmp_path}", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                 "method.max_len=128", "train.max_steps=4", "train.log_every=4", "checkpoint.every=100",
                 "tracking.enabled=false", "train.precision=bf16", "method.decoder_attention_dropout=0"]
    out = _run(["-c", _SYNC_SITES, str(ROOT / "configs" / "pretrain" / "tiny-retromae.yaml"), json.dumps(overrides)])
    sites = json_lines(out)[-1]
    print(json.dumps(sites, indent=1))
    loop = [site for site in sites if site.rsplit(":", 1)[0] == engine.__file__]
    assert not loop, loop
