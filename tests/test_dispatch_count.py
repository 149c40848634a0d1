"""benchmarks/dispatch_count.py: the torch ops the engine's step dispatches beyond the bare loop's, per parameter
tensor, on CPU. On a GPU each is a kernel launch the host pays, and the H200 step was bound by them
(docs/benchmarks.md, "Three H200 jobs"): the fast path (torch-fused at ZeRO 0 on one rank, the loop clipping,
no one-rank all-reduce) is held to a fraction of an op a parameter, and the count sees the bf16 wrapper's
per-parameter work. The host reads of a step (on a GPU each a wait for the device) are counted by the file that
asks for them."""

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pretrain_env

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
    # measured 0.15 (31 ops a step: the log line, the batch's count): 5.2 with DeepSpeed's one-rank gradient
    # bucket, 10.2 with its clipping as well
    assert 0 < fast["extra_ops_per_parameter"] <= 0.5, fast
    wrapped = _count(tmp_path, "train.optimizer=torch-fused", "train.precision=bf16")
    assert wrapped["extra_ops_per_parameter"] >= 20, wrapped  # measured 25.7: the wrapper's masters and checks


def _by_file(reads: dict) -> dict:
    files = collections.Counter()
    for site, count in reads.items():
        files[site.rsplit(":", 1)[0]] += count
    return dict(files)


# the engine's reads of the host batch before its copy to the device (its count, its FLOPs), and of the log step
HOST_SIDE = ("pretrieve/pretrain.py", "pretrieve/models/flops.py", "pretrieve/engine/train.py")


@pytest.mark.parametrize("method,token_losses", [("mlm", 1), ("retromae", 2)])
def test_a_step_reads_the_device_once_a_token_loss_and_once_for_padding(tmp_path, method, token_losses):
    """With the GPU's vocabulary loss (plain): the head reads the count of each token loss's labelled positions
    (models/encoder.py) and HF's mask builder checks the padding (transformers' masking_utils); measured before
    the count replaced boolean indexing, which read the mask again for the states, the labels and once in
    backward: 5 reads a step for mlm, 9 for retromae, now 2 and 3. The engine's step reads nothing of the device
    beyond the head's but at its log step."""
    record = _count(tmp_path, "train.optimizer=torch-fused", "model.vocab_loss=plain", method=method)
    floor = _by_file(record["floor_reads_per_step"])
    assert floor == {"pretrieve/models/encoder.py": token_losses, "transformers/masking_utils.py": 1}, record
    engine = _by_file(record["engine_reads_per_step"])
    assert {f: n for f, n in engine.items() if f not in HOST_SIDE} == floor, record
    assert engine.get("pretrieve/engine/train.py") == 1  # every step logs here: the gradient norm (log_every=1)
