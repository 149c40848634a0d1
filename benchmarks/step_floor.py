"""The step without the engine: the method's head as `pretrieve pretrain` builds it (its collator, its loss, its
FLOPs), trained by a bare loop with no DeepSpeed, no data loader in the loop and no logging, on batches collated
and copied to the device before the clock starts. What the device does there is the floor the engine's overhead
is measured against (docs/benchmarks.md, "The speed ladder"); a floor near the engine's says the head itself (its
kernels and their launches) is what to make faster.

    python -m benchmarks.step_floor --method mlm --size base --seq-len 512 --batch 32 [--variants autocast bf16]

Variants, timed in turns (`--rounds`), each over `--steps` steps after `--warmup`, all in this process:
  autocast       fp32 weights and torch AdamW(fused), the step under bf16 autocast (what HF's Trainer does)
  autocast-lpnorm  as autocast, the LayerNorms in bf16 (train.low_precision_norm)
  bf16           the weights in bf16, AdamW(fused) on them: no master copy (a floor, not a recipe)
  bf16-compile   as bf16, each layer compiled (train.compile's regional torch.compile)
On CPU every variant runs in fp32 (autocast off), for the test. Per variant: median tokens/s, TFLOP/s and MFU by
the engine's FLOPs count, and the share of the step the host took to issue it (near 1: the host is the bound).
`--profile FILE` profiles one more round of the first variant: the device's time by kernel kind and idle, and
the host's launches and waits per step (pretrain_throughput.py's summary). Appends a JSON record to --out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.pretrain_throughput import ROOT, SAMPLES, SIZES, append_record, engine_overrides, profiled

VARIANTS = ("autocast", "autocast-lpnorm", "bf16", "bf16-compile")


def batches(args, work: Path, overrides: list[str] = ()) -> tuple[torch.nn.Module, list[dict], int, float]:
    """The head (with config `overrides`), `--steps` collated batches on the device, their non-padding tokens and
    FLOPs (per step), from the Wikipedia sample prepared in `work` (once)."""
    from pretrieve.config import load_config
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.models.speed_switches import Settings, apply_switches
    from pretrieve.pretrain import pretraining_job
    from pretrieve.pretrain_config import experiment

    if not (work / "shards").is_dir():
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(work / "shards"),
                               workers=0, progress=False))
    gpu = torch.cuda.is_available()
    config = load_config(ROOT / "configs" / "pretrain" / f"{args.method}.yaml",
                         [*engine_overrides(args, work / "shards", None), *overrides, f"run_dir={work / 'floor-run'}"])
    (work / "floor-run").mkdir()  # the job writes the encoder's config there, as a run does
    exp = experiment(config)
    job = pretraining_job(exp, rank=0)
    apply_switches(job.module, Settings(train=exp.train))  # as the engine does before its first step
    loaded, tokens, flops = [], 0, 0.0
    for batch in job.loader:
        tokens += job.count(batch)[1]
        flops += job.flops(batch)
        loaded.append(batch)
        if len(loaded) == args.steps:
            break
    device = torch.device("cuda" if gpu else "cpu")
    on_device = [{k: v.to(device) for k, v in b.items()} for b in loaded]
    return job.module.to(device).train(), on_device, tokens // len(loaded), flops / len(loaded)


def variant(name: str, head: torch.nn.Module, gpu: bool):
    """(module, optimizer, autocast context) of a variant, on its own copy of the head."""
    from pretrieve.models.low_precision_norm import lower_norm_precision
    from pretrieve.models.regional_compile import compile_layers

    module = copy.deepcopy(head)
    if gpu and name.startswith("bf16"):
        module = module.to(torch.bfloat16)
    if name == "autocast-lpnorm":
        lower_norm_precision(module)
    if name == "bf16-compile":
        compile_layers(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu and name.startswith("autocast"))
    return module, optimizer, autocast


def run_steps(module, optimizer, autocast, batches: list[dict]) -> tuple[float, float]:
    """(seconds the host took to issue the steps, seconds until the device finished them)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    started = time.perf_counter()
    for batch in batches:
        with autocast:
            loss = module(batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    issued = time.perf_counter() - started
    sync()
    return issued, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="mlm")
    p.add_argument("--size", choices=[s for s, v in SIZES.items() if "backbone" not in v], default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps a round (batches collated up front)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each variant before its first round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", metavar="FILE", help="also profile a round of the first variant into this JSON")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_floor.json"))
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    # engine_overrides' other settings: the head is built as a bf16 run builds it (fp32; the variants cast it)
    args.lora, args.activation_checkpointing, args.zero_stage, args.precision = 0, False, 0, "bf16" if gpu else "fp32"
    torch.set_num_threads(args.threads)
    from pretrieve.engine.flops import device_peak

    with tempfile.TemporaryDirectory() as work:
        head, on_device, tokens, flops = batches(args, Path(work))
    variants = {name: variant(name, head, gpu) for name in args.variants}
    for module, optimizer, autocast in variants.values():
        run_steps(module, optimizer, autocast, on_device[:args.warmup])
    timings = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, parts in variants.items():
            timings[name].append(run_steps(*parts, on_device))
    if args.profile:
        with profiled(args.profile, gpu, args.steps):
            run_steps(*variants[args.variants[0]], on_device)
    peak = device_peak(torch.device("cuda" if gpu else "cpu"), "bf16" if gpu else "fp32")
    result = {"method": args.method, "size": args.size, "seq_len": args.seq_len, "batch": args.batch,
              "steps": args.steps, "rounds": args.rounds,
              "device": torch.cuda.get_device_name() if gpu else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "variants": {}}
    for name, runs in timings.items():
        seconds = statistics.median(total for _, total in runs)
        result["variants"][name] = {
            "tokens_per_s": round(tokens * args.steps / seconds, 1),
            "tflops_per_device": round(flops * args.steps / seconds / 1e12, 4),
            "mfu": round(flops * args.steps / seconds / peak, 4) if peak else None,
            "host_issue_share": round(statistics.median(issued / total for issued, total in runs), 3)}
    append_record(Path(args.out), result)


if __name__ == "__main__":
    main()
