"""benchmarks/recipe.py --smoke: BGE's recipe's budget stage end to end on the bundled samples: the study's base,
the weak pairs of its training text (Wikipedia's sections, Wikipedia's and the books' crops), the base
contrastive-trained with mean and with [CLS] pooling, each checkpoint exported and evaluated zero-shot with the
pooling it was trained with; a second run finds its work done and writes the same numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pretrain_env

ROOT = Path(__file__).resolve().parent.parent


def _smoke(tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recipe.py"), "--smoke", "--out",
                           str(tmp_path / "work"), "--results", str(tmp_path / "recipe.json")],
                          env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=900)


@pytest.mark.integration
def test_recipe_smoke_measures_the_budget_curve_and_resumes(tmp_path):
    done = _smoke(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "recipe.json").read_text())
    assert set(results["pairs"]) == {"wiki-sections", "wiki-crops", "books-crops"}
    assert all(count > 0 for count in results["pairs"].values())
    curve = results["budget"]
    assert set(curve) == {"mean", "cls"} and {run["pooling"] for run in curve.values()} == {"mean", "cls"}
    for name, run in curve.items():
        scores = run["ndcg@10"]["scifact-sample"]
        assert list(scores) == ["0", "4"] and all(0 <= s <= 1 for s in scores.values()), (name, scores)
        metrics = json.loads((tmp_path / "work" / "budget" / "eval" / f"{name}-4" / "scifact-sample" /
                              "metrics.json").read_text())
        assert metrics["pooling"] == run["pooling"]  # evaluated as it was trained
    # step 0 is the base itself under each pooling: mean and [CLS] differ there already
    assert curve["mean"]["ndcg@10"]["scifact-sample"]["0"] != curve["cls"]["ndcg@10"]["scifact-sample"]["0"]
    assert {"data", "base", "pairs", "contrastive", "eval"} <= set(results["stage_times"])

    again = _smoke(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs to go" not in again.stderr and "pairs wiki" not in again.stderr  # nothing trained or prepared again
    assert json.loads((tmp_path / "recipe.json").read_text())["budget"] == curve
