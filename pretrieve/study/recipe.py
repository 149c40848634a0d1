"""BGE's recipe in miniature (`pretrieve study run studies/recipe/<scale>.yaml`): the quality study's base -> an
arm's pre-training -> the same contrastive pre-training on weak pairs (contrastive.py) -> the same fine-tuning ->
evaluation, each arm with [CLS] and with mean pooling. studies/recipe/README.md has the protocol and the results.

Two parts. `budget` chooses the contrastive budget before any arm is compared: the `none` arm (the quality
study's base, trained here once with its settings) contrastive-trained with each of the study file's budget runs,
each run's checkpoints at several step counts evaluated zero-shot (the pooling it was trained with, normalised)
on SciFact, CACM and Cranfield's test queries. `arms` runs, once the budget is fixed (the file's `arms.steps`):
each arm's pre-training (the quality study's own runs of it: the same work directory shares them), the
contrastive pre-training at that budget with each pooling, each model scored twice with that pooling, normalised:
zero-shot, and after the quality study's fine-tuning scored as the contrastive stage scores (cosine / its
temperature); per score and pooling, the paired bootstrap against `none` and `mlm`. `--seeds 1-2` runs only those
seeds; their per-query scores merge with an earlier job's (RESULTS-per-query.json, kept while the arms' settings
are the same), so seeds can run in separate jobs.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrieve.study import contrastive
from pretrieve.study.context import StudyRun
from pretrieve.study.data import log, write_atomic
from pretrieve.study.finetuning import checkpoint, run_farm, scores_of
from pretrieve.study.general import pretrain_arms
from pretrieve.study.inputs import general_collections, labelled_sets
from pretrieve.study.plan import GENERAL_DATASETS, REFERENCES
from pretrieve.study.processes import pretrieve
from pretrieve.study.stage_times import stage_times, timed
from pretrieve.study.stats import per_query, summarize

PARTS = ("budget", "arms", "all")
# --smoke, at any scale: a few steps of one budget run, two arms
SMOKE = {"budget": {"steps": 4, "points": [4], "batch": 8, "temperature": 0.05, "query_max_len": 32,
                    "runs": {"cls": {"pooling": "cls", "lr": 1e-3, "warmup_ratio": 0.1}}},
         "arms": {"arms": {"none": 1, "retromae": 1}, "steps": 4, "lr": 1e-3, "warmup_ratio": 0.1,
                  "poolings": ["cls", "mean"]}}


def recipe_plan(run: StudyRun) -> dict:
    """{budget, arms}: the study file's, or SMOKE's for a smoke run."""
    return SMOKE if run.smoke else {key: run.study.built_on("recipe").keys[key] for key in ("budget", "arms")}


def check_part(run: StudyRun, part: str) -> None:
    """The arms need their budget fixed: refused before any data work."""
    if part in ("arms", "all") and recipe_plan(run)["arms"]["steps"] is None:
        raise ValueError(f"--part {part}: the contrastive budget of {run.study.path} (arms.steps) is not chosen yet: "
                         "run --part budget and fix it from its curve first")


def budget_curve(run: StudyRun, spec: dict, base: Path, pairs: dict) -> dict:
    """NDCG@10 against contrastive steps of the base under each budget run (and at step 0, the base itself)."""
    work = run.work
    datasets = ["scifact-sample"] if run.smoke else list(GENERAL_DATASETS)
    jobs = {name: contrastive.contrastive_overrides(run, spec, pairs, base, r["pooling"], r["lr"],
                                                    r["warmup_ratio"], seed=0) for name, r in spec["runs"].items()}
    with timed(work, "contrastive"):
        contrastive.train_runs(run, jobs, work / "budget")
    curve = {}
    with timed(work, "eval"):
        for name, settings in spec["runs"].items():
            run_dir = work / "budget" / name
            points = {0: base}
            for step in spec["points"]:
                export = work / "budget" / "exports" / f"{name}-{step}"
                if not (export / "config.json").is_file():
                    pretrieve(["export", str(run_dir / "checkpoints" / f"step{step:08d}"), str(export)],
                              work / "budget" / "exports" / f"{name}-{step}.log", run.plan["threads"])
                points[step] = export
            with ThreadPoolExecutor(max_workers=run.plan["parallel"]) as pool:
                futures = {(step, d): pool.submit(contrastive.evaluate, run, model, settings["pooling"],
                                                  run.collection(d), work / "budget" / "eval" / f"{name}-{step}" / d)
                           for step, model in points.items() for d in datasets}
                scores = {key: future.result() for key, future in futures.items()}
            losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            curve[name] = {**settings, "ndcg@10": {d: {str(step): round(scores[step, d], 4) for step in points}
                                                   for d in datasets},
                           "loss": {str(r["step"]): round(r["loss"], 4) for r in losses if "loss" in r
                                    and (r["step"] in spec["points"] or r["step"] == losses[0]["step"])}}
            log(f"{name}: " + ", ".join(f"{d} {curve[name]['ndcg@10'][d]}" for d in datasets))
    return curve


def arms_finetune(plan: dict, spec: dict) -> dict:
    """The arms' fine-tuning: the quality study's, scoring as the contrastive stage did (cosine / its temperature;
    the farm's checkpoints are normalised): its inner product at temperature 1 would first undo what that stage
    taught the model (measured: studies/recipe/README.md)."""
    return {**plan["finetune"], "temperature": spec["temperature"]}


def arms_seed(run: StudyRun, spec: dict, arms: dict, text: dict, base: Path, pairs: dict, labelled: str,
              seed: int) -> list[str]:
    """One seed of the arms: each arm's pre-training (the quality study's run of it), the contrastive pre-training
    with each pooling at the fixed budget, then each model scored zero-shot and after the fine-tuning on the
    `labelled` set (one farm); the names of its models."""
    work, study = run.work, run.work / "recipe"
    contrastive_spec = {**spec, "steps": arms["steps"], "points": [arms["steps"]]}
    names = [arm for arm, n in arms["arms"].items() if seed < n]
    with timed(work, "arms.pretrain"):
        pretrain_arms(run, text, base, names, seed)
    jobs, models = {}, []
    for arm in names:
        start = base if arm == "none" else work / "general" / "runs" / f"{arm}-s{seed}" / "export"
        for pool in arms["poolings"]:
            name = f"{arm}-{pool}-s{seed}"
            jobs[name] = contrastive.contrastive_overrides(run, contrastive_spec, pairs, start, pool, arms["lr"],
                                                           arms["warmup_ratio"], seed)
            models.append({**checkpoint(name, study / "runs" / name / "export", pool, study / "runs" / name),
                           "normalize": True})
    with timed(work, "arms.contrastive"):
        contrastive.train_runs(run, jobs, study / "runs")
    datasets = general_collections(run)
    with timed(work, "arms.zeroshot"), ThreadPoolExecutor(max_workers=run.plan["parallel"]) as executor:
        for future in [executor.submit(contrastive.evaluate, run, Path(model["model"]), model["pooling"], path,
                                       study / "zeroshot" / model["name"] / dataset)
                       for model in models for dataset, path in datasets.items()]:
            future.result()
    with timed(work, "arms.finetune+eval"):
        run_farm(run, study / f"farm-s{seed}.yaml", study / "farm", models, datasets, labelled,
                 arms_finetune(run.plan, spec), seed)
    return [model["name"] for model in models]


def arms_stage(run: StudyRun, spec: dict, arms: dict, text: dict, base: Path, pairs: dict,
               seeds: set[int] | None, collected: dict) -> tuple[dict, dict]:
    """Every arm and seed (`seeds`: only these; None: all). Returns the statistics per score (`contrastive`:
    zero-shot, `finetuned`) and pooling (per query the mean over seeds, the paired bootstrap against none and
    mlm) and the per-query scores: `collected`, earlier jobs' scores, with this job's seeds added."""
    study = run.work / "recipe"
    datasets = general_collections(run)
    labelled = labelled_sets(run)["general"]["path"]
    for seed in [s for s in range(max(arms["arms"].values())) if seeds is None or s in seeds]:
        for name in arms_seed(run, spec, arms, text, base, pairs, labelled, seed):
            arm, pool = name.rsplit("-", 2)[:2]
            for dataset in datasets:
                for score, scores in (("contrastive", per_query(study / "zeroshot" / name / dataset)),
                                      ("finetuned", scores_of(study / "farm", name, dataset))):
                    collected.setdefault(score, {}).setdefault(pool, {}).setdefault(arm, {}).setdefault(
                        dataset, {})[str(seed)] = scores
    boot = run.plan["bootstrap"]
    # every seed any job has run, in order: the statistics take the mean over seeds per query
    stats = {score: {pool: summarize({arm: {dataset: [runs[s] for s in sorted(runs, key=int)]
                                            for dataset, runs in per.items()} for arm, per in by_arm.items()},
                                     REFERENCES, boot["resamples"], boot["seed"])
                     for pool, by_arm in by_pool.items()} for score, by_pool in collected.items()}
    return stats, collected


def run_recipe(run: StudyRun, part: str = "budget", seeds: set[int] | None = None) -> dict:
    """Run the study's `part` (budget, arms or all); its results, also written to the results file."""
    import os

    plan, recipe = run.plan, recipe_plan(run)
    spec, arms = recipe["budget"], recipe["arms"]
    text, base, base_record, pairs = contrastive.base_and_pairs(run)
    results = json.loads(run.results.read_text()) if run.results.is_file() else {}
    results |= {"study": "recipe", "scale": run.study.scale, "smoke": run.smoke,
                "settings": {"model": plan["model"], "max_len": plan["max_len"], "base": plan["base"],
                             "contrastive": {k: v for k, v in spec.items() if k != "runs"}, "runs": spec["runs"]},
                "base": base_record, "pairs": {name: info["num_samples"] for name, info in pairs.items()},
                "machine": f"{os.cpu_count()} cores"}
    run.results.parent.mkdir(parents=True, exist_ok=True)
    if part in ("budget", "all"):
        results["budget"] = budget_curve(run, spec, base, pairs)
        write_results(run, results)
    if part in ("arms", "all"):
        settings = {**{key: arms[key] for key in ("arms", "steps", "lr", "warmup_ratio", "poolings")},
                    "finetune": {**arms_finetune(plan, spec), "normalize": True}}
        scores_path = run.results.with_name(f"{run.results.stem}-per-query.json")
        same = results.get("arms_settings") == settings and scores_path.is_file()
        if results.get("arms_settings") and not same:
            log(f"recipe: the arms' settings differ from {run.results}'s: its arms' scores are not kept")
        previous = json.loads(scores_path.read_text()) if same else {}
        results["arms_settings"] = settings
        results["arms_jobs"] = (results.get("arms_jobs", []) if same else []) + [
            {"seeds": "all" if seeds is None else sorted(seeds), "machine": results["machine"],
             "date": time.strftime("%Y-%m-%d")}]
        results["arms"], scores = arms_stage(run, spec, arms, text, base, pairs, seeds, previous)
        write_atomic(scores_path, json.dumps(scores) + "\n")
        write_results(run, results)
    return results


def write_results(run: StudyRun, results: dict) -> None:
    results["stage_times"] = stage_times(run.work)
    write_atomic(run.results, json.dumps(results, indent=1) + "\n")
    log(f"wrote {run.results}")
