"""benchmarks/quality.py --smoke: the whole benchmark (prepare with a held-out split, the FLOPs budget, DeepSpeed
pre-training, the farm's zero-shot evaluation incl. DupMAE's joint representation, continued pre-training on the
target corpus) on the bundled samples, a tiny encoder, 2 steps; the result file has the issue's format, and a
second run finds its work done. (The bundled SciFact sample has no training queries: the stage-1 fine-tune
path of the domain adaptation runs in the real benchmark only.)"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pretrain_env

ROOT = Path(__file__).resolve().parent.parent


def _smoke(tmp_path, *extra):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality.py"), "--smoke", "--methods",
                           "mlm,dupmae", "--out", str(tmp_path / "work"), "--results", str(tmp_path / "quality.json"),
                           *extra], env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=600)


@pytest.mark.integration
def test_quality_benchmark_smoke_writes_the_result_format(tmp_path):
    results = tmp_path / "quality.json"
    done = _smoke(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(results.read_text())
    assert set(out) == {"from_scratch", "domain_adaptation", "setup"}
    scratch = dict(out["from_scratch"])
    budget = scratch.pop("budget")
    assert set(scratch) == {"mlm", "dupmae", "dupmae-joint"}
    for method, per_dataset in scratch.items():
        entry = per_dataset["scifact-sample"]
        assert len(entry["ndcg@10"]) == 1 and 0 <= entry["ndcg@10"][0] <= 1
        if method != "mlm":  # a p-value against mlm, from the per-query NDCG@10 of both
            assert 0 <= entry["p_vs_mlm"] <= 1 and entry["diff_ci95"][0] <= entry["diff_ci95"][1]
    assert budget["methods"]["dupmae"]["flops_per_step"] > budget["methods"]["mlm"]["flops_per_step"] > 0
    assert all(entry["steps"] == 2 for entry in budget["methods"].values())
    da = out["domain_adaptation"]["scifact-sample"]
    assert len(da["adapted"]) == len(da["unadapted"]) == 1 and 0 <= da["p"] <= 1 and da["stage"] == "zero-shot"
    setup = out["setup"]
    split = setup["from_scratch"]["split"]
    assert split["wiki_heldout_articles"] > 0 and split["wiki_train_articles"] > split["wiki_heldout_articles"]
    assert setup["from_scratch"]["data"]["wiki-heldout"]["num_samples"] > 0
    assert not math.isnan(setup["from_scratch"]["references"]["bm25"]["scifact-sample"])
    # resumable: a second run finds every stage done and rewrites the same numbers
    again = _smoke(tmp_path, "--part", "from_scratch")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2 of 2 runs already done" in again.stderr and "pretrain mlm-s0 done" not in again.stderr
    rewritten = json.loads(results.read_text())
    assert rewritten["from_scratch"] == out["from_scratch"]
    assert rewritten["domain_adaptation"] == out["domain_adaptation"]  # kept from the first run
