"""`pretrieve study run studies/quality/<scale>.yaml --smoke`: the protocol end to end on the bundled samples with a
hidden-64 encoder and a few steps: settings fixed first, the labelled set, the base trained by MLM, each arm's
continued pre-training (DeepSpeed), the farm's fine-tuning (`finetune-stages` up to stage 1, each arm with its
paper's pooling) and evaluation, the paired bootstrap against none and mlm, the steps curve from one run's
checkpoints, the domain adaptation on a target corpus, the plots; a second run finds its work done; other settings
on the same work directory are refused; the gpu-short plan (make gpu-check's, whose settings
tests/test_study_files.py checks) runs as two GPU jobs whose seeds merge. On the smoke run's work directory,
`pretrieve study run studies/recipe/cpu.yaml --smoke --part all` (BGE's recipe): the weak pairs of the study's
training text, the base contrastive-trained and evaluated zero-shot with its pooling; none and retromae (the
study's own run of it, not trained again), each contrastive-trained with [CLS] and with mean pooling, scored
zero-shot and after the farm's fine-tuning with that pooling, normalised, compared with none; a job of other seeds
keeps the first job's scores. `pretrieve study run studies/matryoshka/cpu.yaml --smoke`, on the same work
directory: the recipe's contrastive stage from the same base, without and with matryoshka_dims, each model scored
at every dimension. (The bundled SciFact sample stands in for every collection.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import pretrain_env

ROOT = Path(__file__).resolve().parent.parent
ARMS = '{"none": 1, "mlm": 1, "retromae": 1, "dupmae": 1, "bow": 1, "lexmae": 1}'


def _study(name: str, tmp_path, *args, scale: str = "cpu") -> subprocess.CompletedProcess:
    """`pretrieve study run studies/NAME/SCALE.yaml --smoke` in tmp_path/work, its results to tmp_path/NAME.json."""
    return subprocess.run([sys.executable, "-m", "pretrieve", "study", "run", f"studies/{name}/{scale}.yaml", "--smoke",
                           "--out", str(tmp_path / "work"), "--results", str(tmp_path / f"{name}.json"), *args],
                          cwd=ROOT, env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True,
                          timeout=900, check=False)


def _smoke(tmp_path, *extra, scale="cpu"):
    return _study("quality", tmp_path, "--set", f"general.arms={ARMS}", "--set", 'domain.arms={"none": 1, "dupmae": 1}',
                  *extra, scale=scale)


def _recipe(tmp_path, *extra):
    return _study("recipe", tmp_path, "--part", "all", *extra)


def _finetuned(work: Path, arm: str) -> dict:
    """What the farm's fine-tuning of the arm's seed-0 model recorded (pretrieve_finetune.json)."""
    meta = json.loads((work / "general" / "farm" / f"{arm}-s0" / "finetune" / "stage1" / "export" /
                       "pretrieve_finetune.json").read_text())
    assert meta["options"]["data"] == [str(work / "labelled" / "general.jsonl")]
    return meta


def _check_general(general: dict, work: Path) -> None:
    assert set(general["arms"]) == {"none", "mlm", "retromae", "dupmae", "bow", "lexmae"}
    for arm, per in general["arms"].items():
        entry = per["scifact-sample"]
        assert len(entry["ndcg@10"]) == 1 and 0 <= entry["ci95"][0] <= entry["mean"] <= entry["ci95"][1] <= 1
        for ref in ("none", "mlm"):  # paired bootstrap against both references, on the same 100 queries
            assert (f"vs_{ref}" in entry) == (arm != ref)
            if arm != ref:
                assert entry[f"vs_{ref}"]["queries"] == 100 and 0 <= entry[f"vs_{ref}"]["p"] <= 1
    budget = general["budget"]
    assert len({b["encoder_tokens"] for b in budget.values()}) == 1  # the equal token budget
    assert budget["dupmae"]["flops"] > budget["retromae"]["flops"] > budget["bow"]["flops"] > budget["mlm"]["flops"] > 0
    # every arm fine-tuned on the same labelled set with its paper's pooling (DupMAE: eq. 12; LexMAE: sparse),
    # evaluated with it
    for arm, pooling in (("none", "cls"), ("mlm", "cls"), ("retromae", "cls"), ("dupmae", "dupmae"), ("bow", "cls"),
                         ("lexmae", "sparse")):
        assert _finetuned(work, arm)["pooling"] == pooling
        assert json.loads((work / "general" / "farm" / f"{arm}-s0" / "scifact-sample" / "stage1" /
                           "metrics.json").read_text())["pooling"] == pooling
    assert [p["step"] for p in general["curve"]] == [0, 2, 4]  # the base, a kept checkpoint, the run's export
    assert general["curve"][-1]["ndcg@10"]["scifact-sample"] == general["arms"]["retromae"]["scifact-sample"]["mean"]
    assert Path(general["plot"]).stat().st_size > 0 and Path(general["curve_plot"]).stat().st_size > 0


@pytest.mark.integration
def test_quality_smoke_runs_the_protocol_and_resumes(tmp_path):
    done = _smoke(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "quality.json").read_text())
    assert out["protocol"] == "pretrain-finetune-eval" and out["settings"]["fixed_before_test_results"]
    assert out["settings"]["settings"]["general"]["arms"] == json.loads(ARMS)
    _check_general(out["general"], tmp_path / "work")
    domain = out["domain"]["base"]
    assert set(domain["arms"]) == {"none", "dupmae"} and domain["pooling_of_none_and_mlm"] == "cls"
    assert domain["arms"]["dupmae"]["scifact-sample"]["vs_none"]["queries"] == 100
    assert all(0 <= per["scifact-sample"]["mean"] <= 1 for per in domain["arms"].values())
    assert domain["target_corpora"]["scifact-sample"]["num_samples"] > 0
    labelled = out["data"]["labelled"]["general"]
    assert len(labelled["sha256"]) == 64 and labelled["evaluated_on"] == ["scifact-sample"]
    assert out["base"]["val_loss"] > 0 and set(out["stage_times"]) >= {"base", "general.pretrain"}

    again = _smoke(tmp_path)  # resumed: every run and job is found done, the same numbers come out
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs to go" not in again.stderr and "/finetune done" not in again.stderr
    rewritten = json.loads((tmp_path / "quality.json").read_text())
    assert rewritten["general"]["arms"] == out["general"]["arms"] and rewritten["domain"] == out["domain"]

    changed = _smoke(tmp_path, "--set", "finetune.lr=0.5")
    assert changed.returncode == 2 and re.search(r"with finetune\.lr = [0-9.e-]+; this run has 0\.5", changed.stderr)

    _check_recipe(tmp_path)
    _check_matryoshka(tmp_path)


def _check_matryoshka(tmp_path: Path) -> None:
    """The Matryoshka benchmark on the same work directory: two contrastive runs from the study's base, each
    evaluated at every dimension, the Matryoshka one logging each dimension's loss."""
    done = _study("matryoshka", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _check_matryoshka_results(json.loads((tmp_path / "matryoshka.json").read_text()), tmp_path / "work")


def _check_matryoshka_results(results: dict, work: Path) -> None:
    dims = ["64", "32", "16"]  # the smoke encoder's 64, halved down to 16
    assert results["settings"]["matryoshka_dims"] == [int(d) for d in dims]
    for run in ("plain", "matryoshka"):
        scores = results["ndcg@10"][run]["scifact-sample"]
        assert list(scores) == dims and all(0 <= s <= 1 for s in scores.values()), scores
        assert results["share_of_full_width"][run]["64"] == 1.0
        metrics = json.loads((work / "eval" / run / "scifact-sample" / "dim16" / "metrics.json").read_text())
        assert metrics["dim"] == 16 and metrics["pooling"] == "mean" and metrics["normalize"] is True
    assert set(results["final_loss"]["matryoshka"]) == {"loss", *(f"loss@{d}" for d in dims)}
    assert set(results["final_loss"]["plain"]) == {"loss"}
    config = (work / "runs" / "matryoshka" / "config.yaml").read_text()
    assert "matryoshka_dims:" in config and f"init_from: {work / 'base' / 'export'}" in config


def _check_recipe(tmp_path: Path) -> None:
    """BGE's recipe on the quality study's work directory: it takes the study's base and retromae run as they are."""
    work = tmp_path / "work"
    shared = [work / "base" / "export" / "model.safetensors",
              work / "general" / "runs" / "retromae-s0" / "export" / "model.safetensors"]
    written = [path.stat().st_mtime_ns for path in shared]
    done = _recipe(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [path.stat().st_mtime_ns for path in shared] == written  # not trained again
    results = json.loads((tmp_path / "recipe.json").read_text())
    assert set(results["pairs"]) == {"wiki-sections", "wiki-crops", "books-crops"}
    assert all(count > 0 for count in results["pairs"].values())
    scores = results["budget"]["cls"]["ndcg@10"]["scifact-sample"]
    assert list(scores) == ["0", "4"] and all(0 <= s <= 1 for s in scores.values()), scores
    assert json.loads((work / "budget" / "eval" / "cls-4" / "scifact-sample" / "metrics.json").read_text())[
        "pooling"] == "cls"  # evaluated as it was trained

    # each model scored zero-shot after the contrastive stage and after the fine-tuning, per pooling
    arms, per_query = results["arms"], json.loads((tmp_path / "recipe-per-query.json").read_text())
    assert set(arms) == set(per_query) == {"contrastive", "finetuned"}
    assert results["arms_settings"]["finetune"]["temperature"] == 0.05
    farm = json.loads((work / "recipe" / "farm-s0.yaml").read_text())
    assert "finetune.temperature=0.05" in farm["finetune"]["overrides"]
    for score, by_pooling in arms.items():
        assert set(by_pooling) == {"cls", "mean"}
        for pooling, per in by_pooling.items():
            assert set(per) == set(per_query[score][pooling]) == {"none", "retromae"}
            entry = per["retromae"]["scifact-sample"]
            assert entry["vs_none"]["queries"] == 100 and 0 <= entry["mean"] <= 1
            assert len(per_query[score][pooling]["retromae"]["scifact-sample"]["0"]) == 100
            # the retromae arm's contrastive run started from the quality study's run of it, and each model was
            # scored (and fine-tuned) with its own pooling, normalised, as the contrastive stage trained it
            config = (work / "recipe" / "runs" / f"retromae-{pooling}-s0" / "config.yaml").read_text()
            assert f"init_from: {work / 'general' / 'runs' / 'retromae-s0' / 'export'}" in config
            evaluation = (work / "recipe" / "zeroshot" / f"retromae-{pooling}-s0" / "scifact-sample"
                          if score == "contrastive" else
                          work / "recipe" / "farm" / f"retromae-{pooling}-s0" / "scifact-sample" / "stage1")
            metrics = json.loads((evaluation / "metrics.json").read_text())
            assert metrics["pooling"] == pooling and metrics["normalize"] is True
    assert {"pairs", "contrastive", "eval", "arms.contrastive", "arms.zeroshot", "arms.finetune+eval"} <= set(
        results["stage_times"])

    # a job of other seeds (here none left to run) keeps the scores of the seeds an earlier job ran
    again = _recipe(tmp_path, "--seeds", "1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "runs to go" not in again.stderr and "pairs wiki" not in again.stderr  # nothing trained or prepared again
    rerun = json.loads((tmp_path / "recipe.json").read_text())
    assert rerun["budget"] == results["budget"] and rerun["arms"] == results["arms"]
    assert [job["seeds"] for job in rerun["arms_jobs"]] == ["all", [1]]


def _check_gpu_plan(out: dict, work: Path, scale: str) -> None:
    """A gpu plan's general study ran (on the CPU here, shrunk) with the structure of the GPU run."""
    assert out["scale"] == scale and out["settings"]["settings"]["scale"] == scale and out["domain"] is None
    assert set(out["general"]["arms"]) == {"none", "retromae"} and _finetuned(work, "retromae")


@pytest.mark.integration
def test_quality_seeds_of_separate_jobs_merge(tmp_path):
    """`--seeds 0` then `--seeds 1` of the gpu-short plan (make gpu-check's), shrunk, each from a fresh work
    directory as separate GPU jobs run it: the second rebuilds the same base, and its per-query scores merge with
    the first job's into one results file."""
    arms = ["--part", "general", "--set", 'general.arms={"none": 2, "retromae": 2}']
    first = _smoke(tmp_path, *arms, "--seeds", "0", scale="gpu-short")
    assert first.returncode == 0, first.stderr[-3000:]
    one = json.loads((tmp_path / "quality.json").read_text())
    _check_gpu_plan(one, tmp_path / "work", "gpu-short")
    assert len(one["general"]["arms"]["retromae"]["scifact-sample"]["ndcg@10"]) == 1
    (tmp_path / "work").rename(tmp_path / "first-job")
    second = _smoke(tmp_path, *arms, "--seeds", "1", scale="gpu-short")
    assert second.returncode == 0, second.stderr[-3000:]
    both = json.loads((tmp_path / "quality.json").read_text())
    assert [run["seeds"] for run in both["runs"]] == [[0], [1]]
    assert both["settings"]["fixed_at"] == one["settings"]["fixed_at"]  # fixed once, by the first job
    for arm in ("none", "retromae"):
        runs = both["general"]["per_query"][arm]["scifact-sample"]
        assert sorted(runs) == ["0", "1"] and runs["0"] == one["general"]["per_query"][arm]["scifact-sample"]["0"]
        assert both["general"]["arms"][arm]["scifact-sample"]["ndcg@10"][0] == \
            one["general"]["arms"][arm]["scifact-sample"]["ndcg@10"][0]
        assert len(both["general"]["arms"][arm]["scifact-sample"]["ndcg@10"]) == 2
    assert both["general"]["curve"] == one["general"]["curve"]  # seed 0's curve, kept
    # the same base, rebuilt from the same seed by the second job
    def base_losses(work: Path) -> list:
        return [r["loss"] for r in map(json.loads, (work / "base" / "metrics.jsonl").read_text().splitlines())
                if "loss" in r]

    assert base_losses(tmp_path / "first-job") == base_losses(tmp_path / "work")
