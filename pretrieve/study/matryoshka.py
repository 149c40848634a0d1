"""Matryoshka representation learning in BGE's recipe in miniature (`pretrieve study run
studies/matryoshka/cpu.yaml`): the recipe's contrastive stage (its base, weak pairs, budget and settings;
contrastive.py) trained twice from the same base, without and with `method.matryoshka_dims`, and each model scored
zero-shot at every dimension (`pretrieve eval --dim`) on SciFact, CACM and Cranfield's test queries.

The question is the one nomic-embed's release answers at full scale (the study file's `anchor`): how much of the
full width's score a prefix keeps, with the Matryoshka loss and without it (a plain model's vectors cut as they
are). Resumable: the base, pairs, runs and evaluations are kept in the work directory. studies/matryoshka/
README.md has the results.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from pretrieve.study import contrastive
from pretrieve.study.context import StudyRun
from pretrieve.study.data import log, write_atomic
from pretrieve.study.plan import GENERAL_DATASETS
from pretrieve.study.recipe import recipe_plan
from pretrieve.study.stage_times import stage_times, timed


def dims_of(hidden: int, smallest: int = 16) -> list[int]:
    """The full width, then halved down to `smallest` (the MRL paper's nesting, Kusupati et al. 2022 §3)."""
    dims = [hidden]
    while dims[-1] // 2 >= smallest:
        dims.append(dims[-1] // 2)
    return dims


def matryoshka_settings(run: StudyRun) -> dict:
    """The settings the results record: the recipe's contrastive stage at its arms' budget, the pooling, the
    dimensions."""
    recipe, pooling = recipe_plan(run), run.study.keys["pooling"]
    spec, arms = recipe["budget"], recipe["arms"]
    return {"model": run.plan["model"], "pooling": pooling, "steps": arms["steps"], "lr": arms["lr"],
            "warmup_ratio": arms["warmup_ratio"], "batch": spec["batch"], "temperature": spec["temperature"],
            "matryoshka_dims": dims_of(run.plan["model"]["hidden_size"]), "seed": 0}


def run_matryoshka(run: StudyRun) -> dict:
    """Both contrastive runs and every evaluation (each skipped when done); the results, also written."""
    import json

    recipe, settings = recipe_plan(run), matryoshka_settings(run)
    spec, arms, dims, pooling = recipe["budget"], recipe["arms"], settings["matryoshka_dims"], settings["pooling"]
    contrastive_spec = {**spec, "steps": arms["steps"], "points": [arms["steps"]]}
    datasets = {name: run.collection(name) for name in (["scifact-sample"] if run.smoke else GENERAL_DATASETS)}
    _, base, base_record, pairs = contrastive.base_and_pairs(run)
    common = contrastive.contrastive_overrides(run, contrastive_spec, pairs, base, pooling, arms["lr"],
                                               arms["warmup_ratio"], seed=0)
    runs = {"plain": common, "matryoshka": [*common, f"method.matryoshka_dims=[{','.join(map(str, dims))}]"]}
    work = run.work
    with timed(work, "contrastive"):
        contrastive.train_runs(run, runs, work / "runs")
    with timed(work, "eval"), ThreadPoolExecutor(max_workers=run.plan["parallel"]) as pool:
        futures = {(name, dataset, dim): pool.submit(contrastive.evaluate, run, work / "runs" / name / "export",
                                                     pooling, path, work / "eval" / name / dataset / f"dim{dim}", dim)
                   for name in runs for dataset, path in datasets.items() for dim in dims}
        scores = {key: round(future.result(), 4) for key, future in futures.items()}
    table = {name: {dataset: {str(dim): scores[name, dataset, dim] for dim in dims} for dataset in datasets}
             for name in runs}
    means = {name: {str(dim): round(sum(scores[name, d, dim] for d in datasets) / len(datasets), 4) for dim in dims}
             for name in runs}
    kept = {name: {dim: round(value / by_dim[str(dims[0])], 4) for dim, value in by_dim.items()}
            for name, by_dim in means.items()}
    results = {"study": "matryoshka", "scale": "smoke" if run.smoke else run.study.scale,
               "machine": f"{os.cpu_count()} cores", "settings": settings, "base": base_record,
               "pairs": {name: info["num_samples"] for name, info in pairs.items()},
               "ndcg@10": table, "mean_ndcg@10": means, "share_of_full_width": kept,
               "final_loss": {name: contrastive.last_loss(work / "runs" / name) for name in runs},
               "anchor": run.study.keys.get("anchor"), "stage_times": stage_times(work)}
    run.results.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(run.results, json.dumps(results, indent=1) + "\n")
    log(f"wrote {run.results}: mean NDCG@10 {means}")
    return results
