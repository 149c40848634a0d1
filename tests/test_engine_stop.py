"""Preemption and export from the training loop: SIGTERM -> checkpoint -> exit 85 -> resume=auto finishes with
the same final weights as an uninterrupted run; the run's export loads in AutoModel."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import pretrain_env
from safetensors.torch import load_file
from transformers import AutoModel

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _command(run_dir, wiki_shards, *overrides):
    return [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-mlm.yaml"), f"run_dir={run_dir}",
            f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
            "train.log_every=1", "checkpoint.every=1000", *overrides]


def test_sigterm_checkpoints_exits_85_and_resume_matches(tmp_path, wiki_shards):
    steps = "train.max_steps=12"
    subprocess.run(_command(tmp_path / "full", wiki_shards, steps), env=pretrain_env(), check=True, capture_output=True)

    run = tmp_path / "stopped"
    proc = subprocess.Popen(_command(run, wiki_shards, steps), env=pretrain_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # wait for the first steps, then preempt
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 85, err[-2000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert 3 <= stopped_at < 12
    assert not (run / "export").exists()

    done = subprocess.run(_command(run, wiki_shards, steps, "resume=auto"), env=pretrain_env(), capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    split = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["loss"] for r in split] == [r["loss"] for r in full]
    ours, reference = load_file(run / "export" / "model.safetensors"), load_file(tmp_path / "full" / "export" / "model.safetensors")
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)

    model = AutoModel.from_pretrained(run / "export")
    assert model.config.hidden_size == 64
