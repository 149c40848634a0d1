"""benchmarks/pretrain_throughput.py --profile: the summary a GPU job brings back for the MFU work (the ops by
self time, their shares, the host syncs), here on CPU with a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import pretrain_env

ROOT = Path(__file__).resolve().parent.parent


def test_a_profiled_run_says_where_the_time_went(tmp_path):
    profile, out = tmp_path / "profile.json", tmp_path / "throughput.json"
    # run in tmp_path (what the engine writes beside it stays there), the benchmarks package from the repository
    done = subprocess.run([sys.executable, "-m", "benchmarks.pretrain_throughput", "--size", "tiny", "--seq-len", "64",
                           "--batch", "4", "--steps", "3", "--warmup", "1", "--method", "mlm", "--profile",
                           str(profile), "--out", str(out)], env=pretrain_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(profile.read_text())
    assert summary["sorted_by"] == "self_cpu_time_total" and 0 < len(summary["top"]) <= 40
    times = [row["self_ms"] for row in summary["top"]]
    assert times == sorted(times, reverse=True) and 0 < sum(row["share"] for row in summary["top"]) <= 1.0001
    assert {"aten::mm", "aten::addmm"} & {row["name"] for row in summary["top"][:5]}  # matmuls lead
    assert summary["syncs"].get("aten::item", 0) > 0  # the loop's log steps read values back
    assert len(json.loads(out.read_text())) == 1  # the throughput record beside it
