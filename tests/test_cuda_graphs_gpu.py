"""`train.cuda_graphs` on a GPU (`make test-gpu`; skipped without CUDA): the tiny `mlm` and `retromae`, dropout off,
trained 8 steps with the step captured and replayed give the eager run's losses (within 1e-4 relative in fp32,
1e-2 under bf16-autocast, with and without compiled layers), every full batch after the warm-up replayed; a
ds_config with ZeRO is refused at start-up, naming the key. The refusals by config are tested on CPU
(tests/test_cuda_graphs.py)."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrieve.config import TrainOptions
from pretrieve.engine.cuda_graphs import WARMUP_STEPS

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # the batches of one shape the switch needs (train.static_shapes) are a field of TrainOptions where they exist
    pytest.mark.skipif("static_shapes" not in {f.name for f in dataclasses.fields(TrainOptions)},
                       reason="needs train.static_shapes"),
]


def _pretrain(run_dir: Path, wiki_shards: Path, method: str, *overrides: str) -> subprocess.CompletedProcess:
    from test_engine_gpu import gpu_env

    return subprocess.run(
        [sys.executable, "-m", "pretrieve", "pretrain", str(ROOT / "configs" / "pretrain" / f"tiny-{method}.yaml"),
         f"run_dir={run_dir}", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
         "method.max_len=128", f"train.max_steps={STEPS}", "train.log_every=1", "checkpoint.every=100",
         "tracking.enabled=false", "train.deterministic=true", "train.zero_stage=0", "model.dropout=0",
         "train.static_shapes=true", *(["method.decoder_attention_dropout=0"] if method == "retromae" else []),
         *overrides], env=gpu_env(), capture_output=True, text=True, timeout=900, cwd=ROOT, check=False)


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records]


@pytest.mark.parametrize("method", ["mlm", "retromae"])
@pytest.mark.parametrize("precision,compiled,tolerance", [("fp32", "false", 1e-4), ("bf16-autocast", "false", 1e-2),
                                                         ("bf16-autocast", "true", 1e-2)])  # the ladder's rung
def test_the_replayed_step_gives_the_eager_steps_losses(tmp_path, wiki_shards, method, precision, compiled,
                                                        tolerance):
    runs = {}
    for graphs in ("false", "true"):
        done = _pretrain(tmp_path / graphs, wiki_shards, method, f"train.precision={precision}",
                         f"train.compile={compiled}", f"train.cuda_graphs={graphs}")
        assert done.returncode == 0, done.stderr[-4000:]
        runs[graphs] = (_losses(tmp_path / graphs), done.stderr)
    (eager, _), (graphed, said) = runs["false"], runs["true"]
    assert all(abs(g - e) <= tolerance * abs(e) for g, e in zip(graphed, eager)), (eager, graphed)
    counts = re.search(r"train\.cuda_graphs: (\d+) micro-batches replayed, (\d+) eager", said)
    assert counts and [int(n) for n in counts.groups()] == [STEPS - WARMUP_STEPS, WARMUP_STEPS], said[-2000:]


def test_a_ds_config_with_zero_is_refused_at_start_up(tmp_path, wiki_shards):
    """train.zero_stage says 0, the ds_config it names partitions: the engine built says so, before a step."""
    done = _pretrain(tmp_path, wiki_shards, "mlm", "train.cuda_graphs=true", "train.precision=bf16-autocast",
                     f"train.ds_config={ROOT / 'ds_configs' / 'zero2.json'}")
    assert done.returncode != 0 and "train.cuda_graphs: needs ZeRO stage 0" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").is_file()
