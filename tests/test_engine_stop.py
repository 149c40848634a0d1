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


def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, wiki_shards):
    """The step-4 checkpoint fails half-written (ZeRO 2): the error names the tag, `latest` still names step 2,
    and resume=auto from there reproduces the uninterrupted run."""
    steps = ["train.max_steps=6", "checkpoint.every=2", "train.zero_stage=2", "tracking.enabled=false"]
    subprocess.run(_command(tmp_path / "full", wiki_shards, *steps), env=pretrain_env(), check=True,
                   capture_output=True)
    run = tmp_path / "crashed"
    crashed = subprocess.run([sys.executable, str(Path(__file__).parent / "crash_save.py"),
                              *_command(run, wiki_shards, *steps)[4:]], env=pretrain_env(), capture_output=True,
                             text=True)
    assert crashed.returncode != 0 and "injected by tests/crash_save.py" in crashed.stderr
    assert f"{run / 'checkpoints' / 'step00000004'}: saving the checkpoint failed: no space left on device" in \
        crashed.stderr
    assert (run / "checkpoints" / "latest").read_text() == "step00000002"
    assert not (run / "checkpoints" / "step00000004").exists()  # the broken tag is removed: its space is free

    done = subprocess.run(_command(run, wiki_shards, *steps, "resume=auto"), env=pretrain_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in logged] == [(r["step"], r["loss"]) for r in full]  # steps 3-4 once


def test_a_second_signal_exits_at_once():
    """The first SIGUSR1 asks for a checkpoint at the next step boundary; the second ends the process now
    (the last complete checkpoint stays `latest`: it moves only after a finished save)."""
    script = ("import os, signal, time\n"
              "from pretrieve.engine.train import StopFlag\n"
              "stop = StopFlag(max_runtime=None)\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "assert stop.should_stop(world=1)\n"
              "print('asked', flush=True)\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\n"
              "time.sleep(30)\n"
              "print('still running')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == "asked\n" and done.returncode == 128 + signal.SIGUSR1, done.stderr[-2000:]
