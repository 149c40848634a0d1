"""The quality study's general part (RetroMAE's main table in miniature): the study's base encoder trained by MLM
from scratch once, each arm continuing it on the same text, the same fine-tuning of every model, evaluation on the
general collections; and the steps curve: NDCG@10 after the same fine-tuning against the pre-training steps of one
arm's run, from its checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.study.context import StudyRun
from pretrieve.study.finetuning import checkpoint, pooling, run_farm, scores_of
from pretrieve.study.inputs import general_collections
from pretrieve.study.plan import ARM_OVERRIDES
from pretrieve.study.pretraining import budget, pretrain, run_overrides
from pretrieve.study.processes import pretrieve
from pretrieve.study.stage_times import timed


def base_model(run: StudyRun, text: dict) -> tuple[Path, dict]:
    """The study's BERT: MLM from scratch, once; its held-out MLM loss at the end."""
    plan, prepared = run.plan, text["prepared"]
    manifests = [prepared["wiki-train"]["manifest"], prepared["books-train"]["manifest"]]
    run_dir = run.work / "base"
    spec = plan["base"]
    overrides = run_overrides(run, manifests, ["wikipedia", "books"], spec, 0, checkpoints=10) + [
        *(f"model.{k}={v}" for k, v in plan["model"].items()), f"train.eval_every={spec['steps']}",
        f"data.validation=[{prepared['wiki-heldout']['manifest']},{prepared['books-heldout']['manifest']}]"]
    with timed(run.work, "base"):
        pretrain(run, [(run.config_of("mlm"), run_dir, overrides)])
    record = budget(run, "base", run.config_of("mlm"), overrides, spec["steps"], spec["batch"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validation = [m for m in metrics if "val_loss" in m]
    record["val_loss"] = validation[-1]["val_loss"] if validation else None
    record["train_loss_last"] = next((m["loss"] for m in reversed(metrics) if "loss" in m), None)
    return run_dir / "export", record


def arm_overrides(run: StudyRun, text: dict, base: Path, arm: str, seed: int) -> list[str]:
    """The overrides of an arm's run (WORK/general/runs/ARM-sSEED): the base continued on the training text; the
    curve's run keeps its evenly spaced checkpoints."""
    prepared, curve = text["prepared"], run.plan["curve"]
    manifests = [prepared["wiki-train"]["manifest"], prepared["books-train"]["manifest"]]
    on_curve = (arm, seed) == (curve["arm"], curve["seed"])
    return run_overrides(run, manifests, ["wikipedia", "books"], run.plan["pretrain"], seed,
                         checkpoints=curve["points"] if on_curve else 2,
                         keep=curve["points"] if on_curve else 1) + [f"model.init_from={base}",
                                                                      *ARM_OVERRIDES.get(arm, [])]


def pretrain_arms(run: StudyRun, text: dict, base: Path, arms: list[str], seed: int) -> None:
    """The arms' runs of seed `seed` (WORK/general/runs/ARM-sSEED), `none` aside (it is the base)."""
    pretrain(run, [(run.config_of(arm), run.work / "general" / "runs" / f"{arm}-s{seed}",
                    arm_overrides(run, text, base, arm, seed)) for arm in arms if arm != "none"])


def general_study(run: StudyRun, text: dict, base: Path, labelled: dict, seeds: set[int] | None = None,
                  previous: dict | None = None) -> dict:
    """Seed-major (every arm's seed 0 first), so that an interrupted study has whole seeds. `seeds`: the ones this
    job runs (None: all); `previous`: the general part of an earlier job's results, whose per-query scores of the
    seeds not run here are kept."""
    plan, work = run.plan, run.work
    study = work / "general"
    arms, spec = plan["general"]["arms"], plan["pretrain"]
    datasets = general_collections(run)
    budgets = {arm: budget(run, f"general/{arm}", run.config_of(arm), arm_overrides(run, text, base, arm, 0),
                           spec["steps"], spec["batch"]) for arm in arms if arm != "none"}
    run_seeds = [seed for seed in range(max(arms.values())) if seeds is None or seed in seeds]
    for seed in run_seeds:
        active = [arm for arm, n in arms.items() if seed < n]
        with timed(work, "general.pretrain"):
            pretrain_arms(run, text, base, active, seed)
        models = [checkpoint(f"none-s{seed}", base, pooling(plan, "none", "cls"), work / "base")] + [
            checkpoint(f"{arm}-s{seed}", study / "runs" / f"{arm}-s{seed}" / "export", pooling(plan, arm, "cls"),
                       study / "runs" / f"{arm}-s{seed}") for arm in active if arm != "none"]
        with timed(work, "general.finetune+eval"):
            run_farm(run, study / f"farm-s{seed}.yaml", study / "farm", models, datasets,
                     labelled["general"]["path"], plan["finetune"], seed)
    per_query_scores = (previous or {}).get("per_query", {})
    for arm, n in arms.items():
        for name in datasets:
            kept = per_query_scores.setdefault(arm, {}).setdefault(name, {})
            kept.update({str(s): scores_of(study / "farm", f"{arm}-s{s}", name) for s in run_seeds if s < n})
    # every seed a job has run, in order: the statistics take the mean over seeds per query
    scores = {arm: {name: [runs[s] for s in sorted(runs, key=int)] for name, runs in per.items()}
              for arm, per in per_query_scores.items()}
    points = (previous or {}).get("curve")
    if plan["curve"]["seed"] in run_seeds:
        with timed(work, "general.curve"):
            points = steps_curve(run, base, datasets, labelled["general"]["path"])
    return {"budget": budgets, "scores": scores, "per_query": per_query_scores, "curve": points,
            "datasets": {n: str(p) for n, p in datasets.items()}}


def steps_curve(run: StudyRun, base: Path, datasets: dict[str, Path], labelled: str) -> list[dict]:
    """NDCG@10 after the same fine-tuning (seed `curve.seed`) against the pre-training steps of the curve arm's
    run: its kept checkpoints exported (`pretrieve export`), fine-tuned and evaluated through the farm; step 0
    is the base (the `none` arm of that seed), the last step the run's export."""
    plan, study = run.plan, run.work / "general"
    arm, seed = plan["curve"]["arm"], plan["curve"]["seed"]
    run_dir = study / "runs" / f"{arm}-s{seed}"
    tags = sorted(p.name for p in (run_dir / "checkpoints").glob("step*") if p.is_dir())
    final = f"step{plan['pretrain']['steps']:08d}"
    models = []
    for tag in tags:
        if tag == final:
            continue
        export = study / "curve" / tag
        if not (export / "config.json").is_file():
            pretrieve(["export", run_dir / "checkpoints" / tag, export], study / "curve" / f"{tag}.log",
                      plan["threads"])
        models.append(checkpoint(f"{arm}-s{seed}-{tag}", export, pooling(plan, arm, "cls"), run_dir))
    if models:
        run_farm(run, study / "farm-curve.yaml", study / "farm", models, datasets, labelled, plan["finetune"], seed)
    names = [(0, f"none-s{seed}")] + [(int(m["name"].rsplit("step", 1)[1]), m["name"]) for m in models] + [
        (plan["pretrain"]["steps"], f"{arm}-s{seed}")]

    def mean(name: str, dataset: str) -> float:
        scores = scores_of(study / "farm", name, dataset)
        return round(sum(scores.values()) / len(scores), 5)

    return [{"step": step, "checkpoint": name, "ndcg@10": {d: mean(name, d) for d in datasets}} for step, name in names]
