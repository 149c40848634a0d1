"""Pre-training throughput of the real engine: `pretrieve pretrain` (DeepSpeed, the method's head and collator,
the shard stream) on the bundled Wikipedia sample.

    python benchmarks/pretrain_throughput.py --method retromae --size tiny --seq-len 128 --batch 8 [--steps 20]

Prints one JSON line and appends it to benchmarks/results/pretrain_throughput.json: tokens/s (non-padding
tokens), s/step, TFLOP/s and MFU (engine.flops: analytic FLOPs; CPU peak = a measured fp32 matmul), averaged
over the steps after `--warmup`. Sizes: tiny = hidden 64, 2 layers, 2 heads, FFN 256; minilm = 384, 6, 12,
1536; base = BERT-base; vocab 30,522. fp32 with `--threads` torch threads on CPU (default 2, as the anchors),
bf16 on a GPU. `ratio_to_anchor` compares with the official RetroMAE code measured on this kind of machine
(transformers 4.34, fp32, AdamW, 2 threads; the figures the engine issue gives).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

SIZES = {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
         "minilm": {"hidden_size": 384, "num_layers": 6, "num_heads": 12, "intermediate_size": 1536},
         "base": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}}
# Official RetroMAE code on CPU, tokens/s, keyed by (size, seq_len, batch).
ANCHORS = {("tiny", 128, 8): 1509.0, ("minilm", 256, 8): 568.0}
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="retromae")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the averages")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pretrain_throughput.json"))
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch loads

    import torch

    from pretrieve.config import experiment, load_config
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.engine.train import train

    torch.set_num_threads(args.threads)
    gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as work:
        shards = Path(work) / "shards"
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(shards), workers=0,
                               progress=False))
        size = SIZES[args.size]
        overrides = [f"model.{k}={v}" for k, v in size.items()] + [
            f"run_dir={Path(work) / 'run'}", f"data.manifests=[{shards / 'manifest.json'}]", "data.weights=null",
            f"method.max_len={args.seq_len}", f"train.micro_batch_size={args.batch}", f"train.max_steps={args.steps}",
            "train.global_batch_size=null", "train.grad_accum=1", "train.log_every=1", "checkpoint.every=1000000",
            f"train.zero_stage={args.zero_stage}", f"train.precision={'bf16' if gpu else 'fp32'}",
            "tracking.enabled=false", "model.init_from=null"]
        if args.method in ("retromae", "dupmae"):
            overrides.append(f"method.decoder_pool_size={min(args.seq_len, 256)}")
        train(experiment(load_config(ROOT / "configs" / "pretrain" / f"{args.method}.yaml", overrides)))
        records = [json.loads(line) for line in (Path(work) / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = records[args.warmup:]
    tokens_per_s = sum(r["tokens_per_s"] for r in timed) / len(timed)
    samples_per_s = sum(r["samples_per_s"] for r in timed) / len(timed)
    result = {
        "method": args.method, "size": args.size, "seq_len": args.seq_len, "batch": args.batch,
        "steps": args.steps, "warmup": args.warmup, "zero_stage": args.zero_stage,
        "device": torch.cuda.get_device_name() if gpu else f"cpu x{args.threads} threads ({platform.processor() or platform.machine()})",
        "precision": "bf16" if gpu else "fp32",
        "tokens_per_s": round(tokens_per_s, 1), "s_per_step": round(args.batch / samples_per_s, 4),
        "tflops_per_device": round(sum(r["tflops_per_device"] for r in timed) / len(timed), 4),
        "mfu": round(sum(r.get("mfu", 0.0) for r in timed) / len(timed), 4),
    }
    anchor = None if gpu else ANCHORS.get((args.size, args.seq_len, args.batch))
    if anchor:
        result.update(anchor_tokens_per_s=anchor, ratio_to_anchor=round(tokens_per_s / anchor, 3))
    print(json.dumps(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(history + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
