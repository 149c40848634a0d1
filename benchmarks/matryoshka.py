"""Matryoshka representation learning in BGE's recipe in miniature: the recipe's contrastive stage (benchmarks/
recipe.py: its base, weak pairs, mean pooling, budget and settings) trained twice from the same base, without and
with `method.matryoshka_dims`, and each model scored zero-shot at every dimension (`pretrieve eval --dim`) on
SciFact, CACM and Cranfield's test queries.

    python benchmarks/matryoshka.py [--smoke] [--out DIR] [--results FILE]

The question is the one nomic-embed's release answers at full scale (modernbert-embed-base: BEIR NDCG@10 52.89 at
768 dimensions, 50.62 at 256): how much of the full width's score a prefix keeps, with the Matryoshka loss and
without it (a plain model's vectors cut as they are). Resumable: the base, pairs, runs and evaluations are kept in
the work directory (default bench-out/matryoshka-cpu; --smoke: the bundled samples, a few steps). Results:
benchmarks/results/matryoshka.json (--smoke: in the work directory).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pretrieve.study.data import log, write_atomic
from pretrieve.study.plan import build_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import ROOT, collection, timed  # noqa: E402
from recipe import (ARMS, BUDGET, DATASETS, base_and_pairs, contrastive_overrides, evaluate,  # noqa: E402
                    train_runs)

POOLING = "mean"  # the recipe's better pooling at cpu scale (benchmarks/results/recipe.json's budget curve)
ANCHOR = {"model": "nomic-ai/modernbert-embed-base", "benchmark": "BEIR NDCG@10", "dims": {"768": 52.89,
                                                                                         "256": 50.62}}


def dims_of(hidden: int, smallest: int = 16) -> list[int]:
    """The full width, then halved down to `smallest` (the MRL paper's nesting, Kusupati et al. 2022 §3)."""
    dims = [hidden]
    while dims[-1] // 2 >= smallest:
        dims.append(dims[-1] // 2)
    return dims


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="bundled samples, a hidden-64 encoder, a few steps")
    p.add_argument("--out", default=None, help="work directory (default bench-out/matryoshka-cpu[-smoke])")
    p.add_argument("--results", default=None, help="default benchmarks/results/matryoshka.json (--smoke: in --out)")
    args = p.parse_args(argv)
    work = Path(args.out or ROOT / "bench-out" / f"matryoshka-cpu{'-smoke' if args.smoke else ''}")
    results_path = Path(args.results or (work / "matryoshka.json" if args.smoke else
                                         ROOT / "benchmarks" / "results" / "matryoshka.json"))
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    plan = build_plan("cpu", args.smoke)
    scale = "smoke" if args.smoke else "cpu"
    spec, arms = BUDGET[scale], ARMS[scale]
    contrastive = {**spec, "steps": arms["steps"], "points": [arms["steps"]]}
    dims = dims_of(plan["model"]["hidden_size"])
    datasets = {name: collection(name, plan) for name in (["scifact-sample"] if args.smoke else DATASETS)}
    _, base, base_record, pairs = base_and_pairs(plan, work)
    common = contrastive_overrides(plan, contrastive, pairs, base, POOLING, arms["lr"], arms["warmup_ratio"], seed=0)
    runs = {"plain": common, "matryoshka": [*common, f"method.matryoshka_dims=[{','.join(map(str, dims))}]"]}
    with timed(work, "contrastive"):
        train_runs(runs, work / "runs", plan)
    with timed(work, "eval"), ThreadPoolExecutor(max_workers=plan["parallel"]) as pool:
        futures = {(run, dataset, dim): pool.submit(evaluate, work / "runs" / run / "export", POOLING, path,
                                                    work / "eval" / run / dataset / f"dim{dim}", plan, dim)
                   for run in runs for dataset, path in datasets.items() for dim in dims}
        scores = {key: round(future.result(), 4) for key, future in futures.items()}
    table = {run: {dataset: {str(dim): scores[run, dataset, dim] for dim in dims} for dataset in datasets}
             for run in runs}
    means = {run: {str(dim): round(sum(scores[run, d, dim] for d in datasets) / len(datasets), 4) for dim in dims}
             for run in runs}
    kept = {run: {dim: round(value / means[run][str(dims[0])], 4) for dim, value in by_dim.items()}
            for run, by_dim in means.items()}
    results = {"study": "matryoshka", "scale": scale, "machine": f"{os.cpu_count()} cores",
               "settings": {"model": plan["model"], "pooling": POOLING, "steps": arms["steps"], "lr": arms["lr"],
                            "warmup_ratio": arms["warmup_ratio"], "batch": spec["batch"],
                            "temperature": spec["temperature"], "matryoshka_dims": dims, "seed": 0},
               "base": base_record, "pairs": {name: info["num_samples"] for name, info in pairs.items()},
               "ndcg@10": table, "mean_ndcg@10": means, "share_of_full_width": kept,
               "final_loss": {run: _last_loss(work / "runs" / run) for run in runs}, "anchor": ANCHOR,
               "stage_times": json.loads((work / "stage_times.json").read_text())}
    results_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(results_path, json.dumps(results, indent=1) + "\n")
    log(f"wrote {results_path}: mean NDCG@10 {means}")


def _last_loss(run_dir: Path) -> dict:
    """The last logged loss of a run, and its per-dimension parts (loss@<m>) when it has them."""
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)][-1]
    return {k: round(v, 4) for k, v in last.items() if k == "loss" or k.startswith("loss@")}


if __name__ == "__main__":
    main()
