"""What held-out loss costs training: the same `pretrieve pretrain` run with and without `data.validation`.

    python -m benchmarks.validation_overhead [--method retromae] [--steps 300] [--eval-every 100] [--batches 8]

Both runs train the bundled Wikipedia sample's train side (`prepare --holdout 0.2`) with the tiny config, in
this process one after the other (DeepSpeed's start-up paid alike), and are timed from start to end. The
evaluation runs `--batches` forward passes (no backward) every `--eval-every` steps, so its expected share is
about batches / eval_every x 1/3 (a forward is a third of a training step). Appends a JSON line to
benchmarks/results/validation_overhead.json: both wall times, the overhead and that expected share.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="retromae")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--batches", type=int, default=8)
    args = parser.parse_args()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("DS_ACCELERATOR", "cpu")):
        os.environ.setdefault(key, value)

    from pretrieve.config import load_config
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment

    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        for split in ("train", "validation"):
            prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(work / split),
                                   workers=0, max_len=128, holdout=0.2, split=split))
        common = [f"data.manifests=[{work / 'train' / 'manifest.json'}]", "data.weights=null", "method.max_len=128",
                  f"train.max_steps={args.steps}", "train.log_every=50", f"checkpoint.every={args.steps}",
                  "tracking.enabled=false"]
        runs = {"without": [], "with": [f"data.validation=[{work / 'validation' / 'manifest.json'}]",
                                        f"train.eval_every={args.eval_every}",
                                        f"data.validation_batches={args.batches}"]}
        seconds = {}
        for name, extra in runs.items():
            config = load_config(ROOT / "configs" / "pretrain" / f"tiny-{args.method}.yaml",
                                 [*common, f"run_dir={work / name}", *extra])
            started = time.perf_counter()
            train(experiment(config))
            seconds[name] = time.perf_counter() - started
    result = {"method": args.method, "steps": args.steps, "eval_every": args.eval_every,
              "validation_batches": args.batches, "seconds_without": round(seconds["without"], 2),
              "seconds_with": round(seconds["with"], 2),
              "overhead": round(seconds["with"] / seconds["without"] - 1, 4),
              "expected_share": round(args.batches / args.eval_every / 3, 4),
              "evaluations": args.steps // args.eval_every, "threads": os.environ.get("OMP_NUM_THREADS", "default")}
    print(json.dumps(result))
    with open(ROOT / "benchmarks" / "results" / "validation_overhead.json", "a") as out:
        out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
