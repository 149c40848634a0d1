"""benchmarks/dispatch_count.py: the torch ops the engine's step dispatches beyond the bare loop's, per parameter
tensor, on CPU. On a GPU each is a kernel launch the host pays, and the H200 step was bound by them
(docs/benchmarks.md, "Three H200 jobs"): the fast path (torch-fused at ZeRO 0 on one rank, the loop clipping,
no one-rank all-reduce) is held to a fraction of an op a parameter, and the count sees the bf16 wrapper's
per-parameter work. The host reads of a step (on a GPU each a wait for the device) are counted by the file that
asks for them, for a step that logs (train.log_every 2) and one that does not."""

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import pretrain_env

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent


def _count(tmp_path, *overrides, method: str = "mlm") -> dict:
    out = tmp_path / f"counts-{len(list(tmp_path.glob('counts-*')))}.json"
    # run in tmp_path (what the engine writes beside it stays there), the benchmarks package from the repository
    done = subprocess.run([sys.executable, "-m", "benchmarks.dispatch_count", "--method", method,
                           *(a for o in overrides for a in ("--set", o)), "--out", str(out)],
                          env=pretrain_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    [record] = json.loads(out.read_text())
    return record


def test_the_fast_path_dispatches_a_few_ops_a_parameter_beyond_the_bare_loop(tmp_path):
    fast = _count(tmp_path, "train.optimizer=torch-fused")
    assert fast["parameter_tensors"] == 202  # BERT-base's count of tensors, at a tiny width
    # measured 0.22 (45 ops a step that does not log; 0.15 when every step logged and the batch was counted by
    # torch, before the ready attention mask and the token losses' guard): 5.2 with DeepSpeed's one-rank gradient
    # bucket, 10.2 with its clipping as well
    assert 0 < fast["extra_ops_per_parameter"] <= 0.5, fast
    wrapped = _count(tmp_path, "train.optimizer=torch-fused", "train.precision=bf16")
    assert wrapped["extra_ops_per_parameter"] >= 20, wrapped  # measured 25.7: the wrapper's masters and checks


def _by_file(reads: dict) -> dict:
    files = collections.Counter()
    for site, count in reads.items():
        files[site.rsplit(":", 1)[0]] += count
    return dict(files)


@pytest.mark.parametrize("method", ["mlm", "retromae"])
def test_a_step_that_does_not_log_reads_nothing_of_the_device(tmp_path, method):
    """With the GPU's vocabulary loss (plain): measured 2 reads a step for mlm and 3 for retromae in the head (the
    count of each token loss's labelled positions by nonzero, models/encoder.py; HF's mask builder checking the
    padding, transformers' masking_utils) and 2 and 3 more of the host batch in the engine (its token count,
    pretrieve/pretrain.py, and each token loss's count for the FLOPs, models/flops.py), before the collators
    handed over the positions, the padded forward its ready mask and the counts went through numpy. Now a step
    that does not log reads nothing, in the bare loop and in the engine; the log step reads the gradient norm."""
    record = _count(tmp_path, "train.optimizer=torch-fused", "model.vocab_loss=plain", method=method)
    assert [(s["step"], s["logs"]) for s in record["steps"]] == [(2, True), (3, False)], record  # log_every 2
    assert record["floor_reads_per_step"] == {}, record
    assert record["engine_reads_per_step"] == {}, record
    assert _by_file(record["engine_reads_per_log_step"]) == {"pretrieve/engine/train.py": 1}, record
