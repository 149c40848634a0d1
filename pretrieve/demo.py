"""`make demo`: the main job on embedded defaults, on CPU.

1. prepare every bundled sample corpus into shards; 2. stream one epoch of their weighted mixture through two
DataLoader workers, printing counts and throughput; 3. pre-train a tiny DupMAE on CPU with DeepSpeed for a
few dozen steps (configs/pretrain/tiny-dupmae.yaml) and export it; 4. evaluate the export zero-shot on the
bundled BEIR sample beside BM25 through `pretrieve farm`; 5. print the `pretrieve report` tables and write its
plots and HTML page; last, where everything is and what to run next.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.stream import ShardStream, StreamLoader

SAMPLES = Path(__file__).resolve().parent / "assets" / "samples"
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-dupmae.yaml"
# (output name, source, input under assets/samples, extra prepare options, mixture weight)
CORPORA = [
    ("wikipedia", "wikipedia", "wikipedia", {}, 0.4),
    ("wikipedia-parquet", "wikipedia", "wikipedia-parquet", {}, 0.1),
    ("books", "books", "books", {}, 0.2),
    ("msmarco-passage", "msmarco-passage", "msmarco-passage", {}, 0.1),
    ("msmarco-doc", "msmarco-doc", "msmarco-doc", {}, 0.1),
    ("beir", "beir", "beir/scifact-sample", {}, 0.05),
    ("jsonl", "jsonl", "jsonl", {"text_field": "contents"}, 0.05),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="demo-out")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="pre-training steps of the tiny DupMAE")
    args = parser.parse_args(argv)
    out = Path(args.out)

    manifests, weights = [], []
    print(f"{'corpus':<18} {'docs':>6} {'samples':>8} {'tokens':>10} {'shards':>6} {'tokens/s':>9}")
    for name, source, folder, extra, weight in CORPORA:
        opts = PrepareOptions(source=source, inputs=[str(SAMPLES / folder)], out=str(out / "shards" / name),
                              max_len=512, shard_size=256, workers=args.workers, **extra)
        started = time.perf_counter()
        m = prepare(opts)
        seconds = time.perf_counter() - started
        print(f"{name:<18} {m['num_documents']:>6,} {m['num_samples']:>8,} {m['num_tokens']:>10,} "
              f"{len(m['shards']):>6} {m['num_tokens'] / seconds:>9,.0f}")
        manifests.append(out / "shards" / name / "manifest.json")
        weights.append(weight)

    stream = ShardStream(manifests, weights=weights, seed=0, shuffle_buffer=1000)
    loader = StreamLoader(stream, batch_size=32, num_workers=args.workers)
    started = time.perf_counter()
    samples, tokens, sources = 0, 0, {}
    for batch in loader:
        samples += len(batch)
        for sample in batch:
            tokens += len(sample["ids"])
            sources[sample["source"]] = sources.get(sample["source"], 0) + 1
    seconds = time.perf_counter() - started
    print(json.dumps({"epoch": 0, "samples": samples, "tokens": tokens, "by_source": sources,
                      "samples_per_s": round(samples / seconds, 1), "next_epoch": stream.epoch}))
    print(f"shards and manifests: {out / 'shards'}; stream them again with `pretrieve stream {out}/shards/*/manifest.json`")
    run_dir = pretrain_tiny_dupmae(out, args.steps)
    uri = json.loads((run_dir / "run.json").read_text())["tracking_uri"]
    report = evaluate_and_report(out, run_dir, uri, args.workers)
    print(f"\nexport:         {run_dir / 'export'}\n"
          f"farm results:   {out / 'farm'} (farm file {out / 'farm.yaml'})\n"
          f"report:         {report / 'report.html'} (tables and plots; PNGs and CSVs beside it)\n"
          f"MLflow store:   {uri}\n"
          f"next: mlflow ui --backend-store-uri {uri}\n"
          f"      open {report.resolve() / 'report.html'}")
    return 0


def evaluate_and_report(out: Path, run_dir: Path, uri: str, workers: int) -> Path:
    """The export and BM25, zero-shot on the bundled BEIR sample, through `pretrieve farm`; then
    `pretrieve report`. Returns the report folder."""
    from pretrieve.cli import main as pretrieve

    farm_out, report = out / "farm", out / "report"
    for stale in (farm_out, report):  # the farm skips done jobs: this export is new, so are its evaluations
        shutil.rmtree(stale, ignore_errors=True)
    farm = {"out": str(farm_out), "workers": workers, "tracking": {"uri": uri},
            "eval": {"max_length": 128, "depth": 100},
            "checkpoints": [{"name": "tiny-dupmae", "model": str(run_dir / "export"), "run_dir": str(run_dir)},
                            {"name": "bm25", "bm25": True}],
            "datasets": [{"name": "scifact-sample", "beir": str(SAMPLES / "beir" / "scifact-sample"),
                          "split": "test"}],
            "stages": ["zero-shot"]}
    (out / "farm.yaml").write_text(json.dumps(farm, indent=1) + "\n")  # JSON is YAML
    if pretrieve(["farm", str(out / "farm.yaml")]) != 0:
        raise SystemExit(f"demo: an evaluation failed; its log is named above (under {farm_out})")
    pretrieve(["report", "--uri", uri, "--out", str(report)])
    return report


def pretrain_tiny_dupmae(out: Path, steps: int) -> Path:
    from pretrieve.config import load_config
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment

    run_dir = out / "runs" / "tiny-dupmae"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh demo run each time
    manifests = ",".join(str(out / "shards" / name / "manifest.json") for name in ("wikipedia", "books"))
    config = load_config(DEMO_CONFIG, [f"run_dir={run_dir}", f"data.manifests=[{manifests}]", "data.weights=null",
                                       f"train.max_steps={steps}", f"checkpoint.every={steps}", "train.log_every=5"])
    started = time.perf_counter()
    result = train(experiment(config))
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = logged[0], logged[-1]
    print(json.dumps({"pretrain": "tiny-dupmae", "steps": result["step"],
                      "seconds": round(time.perf_counter() - started, 1), "loss_first_logged": round(first["loss"], 3),
                      "loss_last": round(last["loss"], 3), "export": result["export"],
                      "mlflow_run_id": result["mlflow_run_id"]}))
    return run_dir


if __name__ == "__main__":
    raise SystemExit(main())
