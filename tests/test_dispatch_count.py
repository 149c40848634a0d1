"""benchmarks/dispatch_count.py: the torch ops the engine's step dispatches beyond the bare loop's, per parameter
tensor, on CPU. On a GPU each is a kernel launch the host pays, and the H200 step was bound by them
(docs/benchmarks.md, "Three H200 jobs"): the fast path (torch-fused at ZeRO 0 on one rank, the loop clipping,
no one-rank all-reduce) is held to a fraction of an op a parameter, and the count sees the bf16 wrapper's
per-parameter work."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import pretrain_env

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "dispatch_count.py"


def _count(tmp_path, *overrides) -> dict:
    out = tmp_path / f"counts-{len(list(tmp_path.glob('counts-*')))}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *(a for o in overrides for a in ("--set", o)),
                           "--out", str(out)], env=pretrain_env(), capture_output=True, text=True, timeout=600,
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
