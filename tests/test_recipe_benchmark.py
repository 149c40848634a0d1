"""benchmarks/recipe.py --smoke --stage all: BGE's recipe end to end on the bundled samples. The budget stage: the
study's base, the weak pairs of its training text (Wikipedia's sections, Wikipedia's and the books' crops), the
base contrastive-trained, its checkpoint exported and evaluated zero-shot with the pooling it was trained with.
The arms stage: none and retromae (the quality study's run of it), each contrastive-trained with [CLS] and with
mean pooling, fine-tuned and evaluated with that pooling through the farm, compared with none. A second run finds
its work done and writes the same numbers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pretrain_env

ROOT = Path(__file__).resolve().parent.parent


def _smoke(tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recipe.py"), "--smoke", "--stage", "all",
                           "--out", str(tmp_path / "work"), "--results", str(tmp_path / "recipe.json")],
                          env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True, timeout=900)


@pytest.mark.integration
def test_recipe_smoke_runs_both_stages_and_resumes(tmp_path):
    done = _smoke(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "recipe.json").read_text())
    work = tmp_path / "work"
    assert set(results["pairs"]) == {"wiki-sections", "wiki-crops", "books-crops"}
    assert all(count > 0 for count in results["pairs"].values())
    scores = results["budget"]["cls"]["ndcg@10"]["scifact-sample"]
    assert list(scores) == ["0", "4"] and all(0 <= s <= 1 for s in scores.values()), scores
    assert json.loads((work / "budget" / "eval" / "cls-4" / "scifact-sample" / "metrics.json").read_text())[
        "pooling"] == "cls"  # evaluated as it was trained

    arms = results["arms"]
    assert set(arms) == {"cls", "mean"}
    for pooling, per in arms.items():
        assert set(per) == {"none", "retromae"}
        entry = per["retromae"]["scifact-sample"]
        assert entry["vs_none"]["queries"] == 100 and 0 <= entry["mean"] <= 1
        # the retromae arm's contrastive run started from the quality study's run of it, and each model was
        # fine-tuned and evaluated with its own pooling
        config = (work / "recipe" / "runs" / f"retromae-{pooling}-s0" / "config.yaml").read_text()
        assert f"init_from: {work / 'general' / 'runs' / 'retromae-s0' / 'export'}" in config
        assert json.loads((work / "recipe" / "farm" / f"retromae-{pooling}-s0" / "scifact-sample" / "stage1" /
                           "metrics.json").read_text())["pooling"] == pooling
    assert {"data", "base", "pairs", "contrastive", "eval", "arms.contrastive", "arms.finetune+eval"} <= set(
        results["stage_times"])

    again = _smoke(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs to go" not in again.stderr and "pairs wiki" not in again.stderr  # nothing trained or prepared again
    rerun = json.loads((tmp_path / "recipe.json").read_text())
    assert rerun["budget"] == results["budget"] and rerun["arms"] == results["arms"]
