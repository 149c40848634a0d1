"""BGE's recipe in miniature: the study's base -> an arm's pre-training -> the same contrastive pre-training on weak
pairs of the Wikipedia sample and the books -> the same fine-tuning -> evaluation, each arm with [CLS] and with
mean pooling.

    python benchmarks/recipe.py --scale cpu|gpu-short [--smoke] [--stage budget|arms|all] [--seeds 0-2] [--out DIR]
        [--results FILE]

Two stages. `budget` chooses the contrastive budget before any arm is compared: the `none` arm (the quality
study's base, benchmarks/quality.py, trained here once with its settings) contrastive-trained on the weak pairs
with each pooling, and [CLS] again at a lower learning rate with a longer warm-up; each run's checkpoints at
several step counts exported and evaluated zero-shot (`pretrieve eval`, the pooling it was trained with,
normalised) on SciFact, CACM and Cranfield's test queries. `arms` runs, once the budget is fixed in ARMS below:
each arm's pre-training (the quality study's own runs of it: the same --out shares them), the contrastive
pre-training at that budget with [CLS] and with mean pooling, each model scored twice with that pooling,
normalised: zero-shot, and after the quality study's fine-tuning (its labelled set, steps, lr and seed) scored as
the contrastive stage scores (cosine / its temperature); 3 seeds; per score and pooling, the paired bootstrap
against `none` and `mlm`. `--seeds 1-2` runs only those seeds; their per-query scores merge with an earlier
job's (RESULTS-per-query.json, kept while the arms' settings are the same), so seeds can run in separate jobs.

The weak pairs (`pretrieve prepare --pairs`, from the quality study's training split of the text, nothing of
its held-out part): Wikipedia's sections (title -> first paragraph, "title: heading" -> the section),
Wikipedia's and the books' spans (two independent crops of a block, Contriever), drawn 2 : 1 : 1. The
contrastive settings are the ones an earlier probe found to train a model of this size (in-batch negatives,
cosine / 0.05, lr 1e-3, batch 64).

Resumable: every stage skips what exists (pair manifests, exports, evaluations); an interrupted run continues
from its checkpoint. Results: benchmarks/results/recipe.json and recipe-per-query.json; at --scale gpu-short
(`make gpu-check`'s recipe stage, one GPU allocation a stage or seed) recipe-gpu-short.json and its per-query file;
--smoke: in the work directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrieve.study.data import log, write_atomic
from pretrieve.study.plan import REFERENCES, build_plan
from pretrieve.study.stats import per_query, summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import (ROOT, SHARED, arm_overrides, base_model, checkpoint, collection, config_of,  # noqa: E402
                     general_collections, labelled_sets, parse_seeds, pretrain_runs, pretraining_text, pretrieve,
                     run_farm, scores_of, text_split, timed, use_data)

CONFIG = ROOT / "configs" / "pretrain" / "tiny-contrastive.yaml"
DATASETS = ("scifact", "cacm", "cranfield")
# The sources' shares of the pair stream: half title-like queries (a title, "title: heading"), as evaluation
# queries are short; the crops (193k of Wikipedia's, 13k of the books', against 67k sections) would otherwise
# make up three quarters of it
PAIR_WEIGHTS = {"wiki-sections": 2, "wiki-crops": 1, "books-crops": 1}
# The contrastive budget curve: run -> (pooling, lr, warm-up share); its steps and the points evaluated
BUDGET = {
    "cpu": {"steps": 1600, "points": [200, 400, 800, 1600], "batch": 64, "temperature": 0.05,
            "query_max_len": 32, "runs": {"mean": ("mean", 1e-3, 0.1), "cls": ("cls", 1e-3, 0.1),
                                          "cls-slow": ("cls", 3e-4, 0.25)}},
    # the quality study's gpu-short base (4 layers x 512; make gpu-check's recipe stage, one allocation): batches of
    # 512 pairs, 8x the cpu's, at half its lr for a model 16x wider (still a guess: the curve is what decides), the
    # same points; an estimate until an allocation has run it
    "gpu-short": {"steps": 1600, "points": [200, 400, 800, 1600], "batch": 512, "temperature": 0.05,
                  "query_max_len": 32, "runs": {"mean": ("mean", 5e-4, 0.1), "cls": ("cls", 5e-4, 0.1),
                                                "cls-slow": ("cls", 2e-4, 0.25)}},
    "smoke": {"steps": 4, "points": [4], "batch": 8, "temperature": 0.05, "query_max_len": 32,
              "runs": {"cls": ("cls", 1e-3, 0.1)}},
}


# The arms at the chosen budget: each arm's pre-training (benchmarks/quality.py's general study, the same runs),
# then the same contrastive pre-training with each pooling, then the quality study's fine-tuning and evaluation
# with that pooling. `steps`: the contrastive budget, fixed from the budget stage's curve before any arm ran
# (None: not chosen yet, and the stage refuses to run).
# cpu: 800 steps, fixed on 2026-11-27 from the budget curve (benchmarks/results/recipe.json, docs/benchmarks.md):
# `none` is off the floor with both poolings there (SciFact 0.20 mean, 0.05 [CLS]) and still rising to 1600, where
# arms differing by their pre-training can still differ; 24 contrastive runs of 800 steps fit the 2 cores in
# about 1.5 hours, of 1600 in 3. The [CLS] runs keep lr 1e-3: 3e-4 with a 25 % warm-up scored lower at every point.
ARMS = {
    "cpu": {"arms": {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3}, "steps": 800, "lr": 1e-3,
            "warmup_ratio": 0.1, "poolings": ["cls", "mean"]},
    # gpu-short: the budget is chosen from that scale's own curve (an allocation's `--stage budget`), not yet run;
    # lr and warm-up follow the budget run the curve picks. One seed an allocation (`--seeds`), as the quality study
    "gpu-short": {"arms": {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3, "bow": 3, "condenser": 3,
                           "cocondenser": 3, "simlm": 3},
                  "steps": None, "lr": 5e-4,
                  "warmup_ratio": 0.1, "poolings": ["cls", "mean"]},
    "smoke": {"arms": {"none": 1, "retromae": 1}, "steps": 4, "lr": 1e-3, "warmup_ratio": 0.1,
              "poolings": ["cls", "mean"]},
}
SCALES = ("cpu", "gpu-short")


def weak_pairs(plan: dict, work: Path) -> dict:
    """The pair shards of the study's training text: {name: manifest totals}, each prepared once."""
    from pretrieve.data.prepare import PrepareOptions, prepare

    parts = text_split(plan, work)["parts"]
    sources = {"wiki-sections": ("wikipedia", parts["wiki-train"], "sections"),
               "wiki-crops": ("wikipedia", parts["wiki-train"], "spans"),
               "books-crops": ("books", parts["books-train"], "spans")}
    out = {}
    for name, (source, inputs, method) in sources.items():
        folder = work / "pairs" / name
        if not (folder / "manifest.json").is_file():
            log(f"pairs {name} ({source}, {method})")
            prepare(PrepareOptions(source=source, inputs=inputs, out=str(folder), max_len=plan["max_len"],
                                   workers=plan.get("data_workers", 0), pairs=True, pair_method=method, progress=False,
                                   on_error="skip" if source == "books" else "fail"))
        info = json.loads((folder / "manifest.json").read_text())
        out[name] = {"manifest": str(folder / "manifest.json"), "num_samples": info["num_samples"]}
    return out


def base_and_pairs(plan: dict, work: Path) -> tuple[dict, Path, dict, dict]:
    """(the study's prepared text, the base's export, its record, the weak pairs) in `work`, each made once."""
    work.mkdir(parents=True, exist_ok=True)
    with timed(work, "data"):
        text = pretraining_text(plan, work)
    base, base_record = base_model(plan, work, text)
    with timed(work, "pairs"):
        pairs = weak_pairs(plan, work)
    return text, base, base_record, pairs


def contrastive_overrides(plan: dict, spec: dict, pairs: dict, base: Path, pooling: str, lr: float,
                          warmup: float, seed: int) -> list[str]:
    steps = spec["steps"]
    weights = ",".join(str(PAIR_WEIGHTS[name]) for name in pairs)
    return [f"model.init_from={base}", f"data.manifests=[{','.join(p['manifest'] for p in pairs.values())}]",
            f"data.weights=[{weights}]", f"method.pooling={pooling}", "method.normalize=true",
            f"method.temperature={spec['temperature']}", f"method.max_len={plan['max_len']}",
            f"method.query_max_len={spec['query_max_len']}", f"train.micro_batch_size={spec['batch']}",
            f"train.lr={lr}", f"train.warmup_ratio={warmup}", f"train.max_steps={steps}",
            f"train.precision={plan['precision']}", f"train.log_every={max(1, min(50, steps // 20))}",
            f"checkpoint.every={spec['points'][0]}", f"checkpoint.keep={steps // spec['points'][0]}", f"seed={seed}",
            "tracking.enabled=false"]


def train_runs(jobs: dict[str, list[str]], runs: Path, plan: dict) -> None:
    """The contrastive runs `jobs` (in `runs`/NAME) through quality.py's pretrain_runs: a finished run is skipped."""
    pretrain_runs([(str(CONFIG), runs / name, overrides) for name, overrides in jobs.items()], plan)


def evaluate(model: Path, pooling: str, beir: Path, out: Path, plan: dict, dim: int | None = None) -> float:
    """NDCG@10 of `model` on the test queries of the collection in `beir`, zero-shot, normalised (its vectors cut
    to their first `dim` coordinates when given); cached in `out` (its per-query scores too)."""
    metrics = out / "metrics.json"
    if not metrics.is_file():
        pretrieve(["eval", "--model", str(model), "--beir", str(beir), "--pooling", pooling,
                   "--normalize", "--max-length", str(plan["eval"]["max_length"]),
                   "--batch-size", str(plan["eval"]["batch_size"]), "--out", str(out), "--overwrite",
                   *(["--dim", str(dim)] if dim else [])],
                  out.parent / f"{out.name}.log", plan["threads"])
    return json.loads(metrics.read_text())["ndcg@10"]


def budget_curve(plan: dict, spec: dict, work: Path, base: Path, pairs: dict) -> dict:
    """NDCG@10 against contrastive steps of the base under each budget run (and at step 0, the base itself)."""
    datasets = list(DATASETS) if not plan["smoke"] else ["scifact-sample"]
    jobs = {name: contrastive_overrides(plan, spec, pairs, base, pooling, lr, warmup, seed=0)
            for name, (pooling, lr, warmup) in spec["runs"].items()}
    with timed(work, "contrastive"):
        train_runs(jobs, work / "budget", plan)
    curve = {}
    with timed(work, "eval"):
        for name, (pooling, lr, warmup) in spec["runs"].items():
            run_dir = work / "budget" / name
            points = {0: base}
            for step in spec["points"]:
                export = work / "budget" / "exports" / f"{name}-{step}"
                if not (export / "config.json").is_file():
                    pretrieve(["export", str(run_dir / "checkpoints" / f"step{step:08d}"), str(export)],
                              work / "budget" / "exports" / f"{name}-{step}.log", plan["threads"])
                points[step] = export
            with ThreadPoolExecutor(max_workers=plan["parallel"]) as pool:
                futures = {(step, dataset): pool.submit(evaluate, model, pooling, collection(dataset, plan),
                                                        work / "budget" / "eval" / f"{name}-{step}" / dataset, plan)
                           for step, model in points.items() for dataset in datasets}
                scores = {key: future.result() for key, future in futures.items()}
            losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            curve[name] = {"pooling": pooling, "lr": lr, "warmup_ratio": warmup,
                           "ndcg@10": {dataset: {str(step): round(scores[step, dataset], 4) for step in points}
                                       for dataset in datasets},
                           "loss": {str(r["step"]): round(r["loss"], 4) for r in losses if "loss" in r
                                    and (r["step"] in spec["points"] or r["step"] == losses[0]["step"])}}
            log(f"{name}: " + ", ".join(f"{d} {curve[name]['ndcg@10'][d]}" for d in datasets))
    return curve


def arms_finetune(plan: dict, spec: dict) -> dict:
    """The arms' fine-tuning: the quality study's, scoring as the contrastive stage did (cosine / its temperature;
    the farm's checkpoints are normalised): its inner product at temperature 1 would first undo what that stage
    taught the model (measured: docs/benchmarks.md)."""
    return {**plan["finetune"], "temperature": spec["temperature"]}


def arms_stage(plan: dict, spec: dict, arms: dict, work: Path, text: dict, base: Path, pairs: dict,
               seeds: set[int] | None, collected: dict) -> tuple[dict, dict]:
    """Every arm and seed (`seeds`: only these; None: all): its pre-training (quality.py's run of it), the
    contrastive pre-training with each pooling at the fixed budget, then two scores of each model: zero-shot
    (`contrastive`) and after the fine-tuning (`finetuned`; one farm a seed), both with that pooling, normalised.
    Returns the statistics per score and pooling (per query the mean over seeds, the paired bootstrap against none
    and mlm) and the per-query scores: `collected`, earlier jobs' scores, with this job's seeds added."""
    contrastive = {**spec, "steps": arms["steps"], "points": [arms["steps"]]}
    datasets = general_collections(plan)
    labelled = labelled_sets(plan, work)["general"]["path"]
    study = work / "recipe"
    run_seeds = [seed for seed in range(max(arms["arms"].values())) if seeds is None or seed in seeds]
    for seed in run_seeds:
        names = [arm for arm, n in arms["arms"].items() if seed < n]
        with timed(work, "arms.pretrain"):
            pretrain_runs([(config_of(arm), work / "general" / "runs" / f"{arm}-s{seed}",
                            arm_overrides(plan, work, text, base, arm, seed)) for arm in names if arm != "none"],
                          plan)
        jobs, models = {}, []
        for arm in names:
            start = base if arm == "none" else work / "general" / "runs" / f"{arm}-s{seed}" / "export"
            for pool in arms["poolings"]:
                name = f"{arm}-{pool}-s{seed}"
                jobs[name] = contrastive_overrides(plan, contrastive, pairs, start, pool, arms["lr"],
                                                   arms["warmup_ratio"], seed)
                models.append({**checkpoint(name, study / "runs" / name / "export", pool, study / "runs" / name),
                               "normalize": True})
        with timed(work, "arms.contrastive"):
            train_runs(jobs, study / "runs", plan)
        with timed(work, "arms.zeroshot"):
            with ThreadPoolExecutor(max_workers=plan["parallel"]) as executor:
                for future in [executor.submit(evaluate, Path(model["model"]), model["pooling"], path,
                                           study / "zeroshot" / model["name"] / dataset, plan)
                               for model in models for dataset, path in datasets.items()]:
                    future.result()
        with timed(work, "arms.finetune+eval"):
            run_farm(study / f"farm-s{seed}.yaml", plan, work, study / "farm", models, datasets, labelled,
                     arms_finetune(plan, spec), seed)
        for arm in names:
            for pool in arms["poolings"]:
                name = f"{arm}-{pool}-s{seed}"
                for dataset in datasets:
                    for score, scores in (("contrastive", per_query(study / "zeroshot" / name / dataset)),
                                          ("finetuned", scores_of(study / "farm", name, dataset))):
                        collected.setdefault(score, {}).setdefault(pool, {}).setdefault(arm, {}).setdefault(
                            dataset, {})[str(seed)] = scores
    boot = plan["bootstrap"]
    # every seed any job has run, in order: the statistics take the mean over seeds per query
    stats = {score: {pool: summarize({arm: {dataset: [runs[s] for s in sorted(runs, key=int)]
                                            for dataset, runs in per.items()} for arm, per in by_arm.items()},
                                     REFERENCES, boot["resamples"], boot["seed"])
                     for pool, by_arm in by_pool.items()} for score, by_pool in collected.items()}
    return stats, collected


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=SCALES, default="cpu",
                   help="cpu: 2 cores; gpu-short: one GPU allocation's stage (make gpu-check STAGES=install,recipe)")
    p.add_argument("--smoke", action="store_true", help="bundled samples, a hidden-64 encoder, a few steps")
    p.add_argument("--out", default=None, help="work directory (default bench-out/recipe-<scale>[-smoke])")
    p.add_argument("--results", default=None, help="default benchmarks/results/recipe.json (--smoke: in --out)")
    p.add_argument("--data", default=str(SHARED), metavar="DIR", help="the shared data (default %(default)s)")
    p.add_argument("--stage", choices=("budget", "arms", "all"), default="budget",
                   help="budget: the contrastive budget curve of `none`; arms: every arm at the fixed budget")
    p.add_argument("--seeds", default=None, metavar="A-B|A,B",
                   help="only these seeds of the arms (default: all); merged with the per-query scores of the "
                        "seeds that earlier jobs ran")
    args = p.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        p.error(str(e))
    arms = ARMS["smoke" if args.smoke else args.scale]
    if args.stage in ("arms", "all") and arms["steps"] is None:  # before any data work
        p.error(f"--stage {args.stage}: the contrastive budget at --scale {args.scale} (ARMS[{args.scale!r}]['steps'] "
                "in benchmarks/recipe.py) is not chosen yet: run --stage budget and fix it from its curve first")
    if not args.smoke:
        use_data(Path(args.data), p)
    work = Path(args.out or ROOT / "bench-out" / f"recipe-{args.scale}{'-smoke' if args.smoke else ''}")
    results_path = Path(args.results or (work / "recipe.json" if args.smoke else results_file(args.scale)))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plan = build_plan(args.scale, args.smoke)
    spec = BUDGET["smoke" if args.smoke else args.scale]
    text, base, base_record, pairs = base_and_pairs(plan, work)
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results |= {"study": "recipe", "scale": args.scale, "smoke": args.smoke,
               "settings": {"model": plan["model"], "max_len": plan["max_len"], "base": plan["base"],
                            "contrastive": {k: v for k, v in spec.items() if k != "runs"},
                            "runs": {name: dict(zip(("pooling", "lr", "warmup_ratio"), run))
                                     for name, run in spec["runs"].items()}},
               "base": base_record, "pairs": {name: info["num_samples"] for name, info in pairs.items()},
               "machine": f"{os.cpu_count()} cores"}
    results_path.parent.mkdir(parents=True, exist_ok=True)
    if args.stage in ("budget", "all"):
        results["budget"] = budget_curve(plan, spec, work, base, pairs)
        write_results(results_path, results, work)
    if args.stage in ("arms", "all"):
        settings = {**{key: arms[key] for key in ("arms", "steps", "lr", "warmup_ratio", "poolings")},
                    "finetune": {**arms_finetune(plan, spec), "normalize": True}}
        scores_path = results_path.with_name(f"{results_path.stem}-per-query.json")
        same = results.get("arms_settings") == settings and scores_path.is_file()
        if results.get("arms_settings") and not same:
            log(f"recipe: the arms' settings differ from {results_path}'s: its arms' scores are not kept")
        previous = json.loads(scores_path.read_text()) if same else {}
        results["arms_settings"] = settings
        results["arms_jobs"] = (results.get("arms_jobs", []) if same else []) + [
            {"seeds": "all" if seeds is None else sorted(seeds), "machine": results["machine"],
             "date": time.strftime("%Y-%m-%d")}]
        results["arms"], scores = arms_stage(plan, spec, arms, work, text, base, pairs, seeds, previous)
        write_atomic(scores_path, json.dumps(scores) + "\n")
        write_results(results_path, results, work)


def results_file(scale: str) -> Path:
    """Where a scale's results go: benchmarks/results/recipe.json (cpu) or recipe-<scale>.json; its per-query
    scores beside it, as <name>-per-query.json."""
    return ROOT / "benchmarks" / "results" / ("recipe.json" if scale == "cpu" else f"recipe-{scale}.json")


def write_results(path: Path, results: dict, work: Path) -> None:
    results["stage_times"] = json.loads((work / "stage_times.json").read_text())
    write_atomic(path, json.dumps(results, indent=1) + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
