"""The training loop against an earlier version of itself: the same `pretrieve pretrain` run with this tree's
engine and with the engine of a git revision, alternating, on CPU.

    python -m benchmarks.loop_overhead [--baseline-ref 235d43b] [--method retromae] [--steps 200] [--repeats 3]

The default baseline is the loop before losses were summed on the device and batches counted before their copy
(one `.item()` per loss part per micro-step there). Both run the bundled Wikipedia sample with the tiny config
from `git worktree` checkouts, each in its own process with 2 threads, `repeats` times in alternating order
(A B B A ...: drift on a shared machine falls on both); each run is timed over its steps after the first
`log_every` (start-up left out) from metrics.jsonl. Appends a JSON record to benchmarks/results/loop_overhead.json:
per version the median seconds per step, and the ratio this tree / baseline (< 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrieve.data.prepare import PrepareOptions, prepare

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
LOG_EVERY = 20
BATCH = 8


def env() -> dict:
    out = {**os.environ, "OMP_NUM_THREADS": "2", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        out.pop(key, None)
    return out


def seconds_per_step(tree: Path, run_dir: Path, manifest: Path, method: str, steps: int) -> float:
    """One run from `tree` (`python -m pretrieve` there imports that tree's package); its s/step after the first
    log window."""
    args = [sys.executable, "-m", "pretrieve", "pretrain", str(ROOT / "configs" / "pretrain" / f"tiny-{method}.yaml"),
            f"run_dir={run_dir}", f"data.manifests=[{manifest}]", "data.weights=null", "method.max_len=128",
            f"train.micro_batch_size={BATCH}", f"train.max_steps={steps}", f"train.log_every={LOG_EVERY}",
            f"checkpoint.every={steps}", "tracking.enabled=false"]
    done = subprocess.run(args, cwd=tree, env=env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: pretrain failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    return statistics.mean(BATCH / r["samples_per_s"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-ref", default="235d43b")
    parser.add_argument("--method", default="retromae")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loop_overhead.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        baseline = work / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(baseline), args.baseline_ref],
                       check=True, capture_output=True)
        try:
            prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(work / "shards"),
                                   workers=0, max_len=128, progress=False))
            manifest = work / "shards" / "manifest.json"
            trees = {"current": ROOT, "baseline": baseline}
            timings = {name: [] for name in trees}
            for repeat in range(args.repeats):
                order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
                for name in order:
                    run_dir = work / f"{name}-{repeat}"
                    timings[name].append(seconds_per_step(trees[name], run_dir, manifest, args.method, args.steps))
                    print(f"{name} #{repeat}: {timings[name][-1]:.4f} s/step", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(baseline)], check=False)
    median = {name: statistics.median(values) for name, values in timings.items()}
    result = {"method": args.method, "steps": args.steps, "repeats": args.repeats, "baseline_ref": args.baseline_ref,
              "threads": 2, "s_per_step": {name: [round(v, 4) for v in values] for name, values in timings.items()},
              "median_s_per_step": {name: round(v, 4) for name, v in median.items()},
              "ratio_current_to_baseline": round(median["current"] / median["baseline"], 4)}
    print(json.dumps(result))
    out = Path(args.out)
    history = json.loads(out.read_text()) if out.is_file() else []
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(history + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
