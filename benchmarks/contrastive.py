"""Contrastive pre-training's memory and time against the batch size, with GradCache and without.

    python -m benchmarks.contrastive [--size tiny|small|base] [--batches 8,16,32,64,128] [--chunk 8]
                                     [--max-len 64] [--steps 2] [--time-steps 6] [--threads 1]

Memory: each (batch size, GradCache on/off) point runs in a process of its own: the contrastive head of `--size`
on random pairs of `--max-len`-token texts (queries and passages), `--steps` training steps (forward, backward,
SGD) after one warm-up step; the steps' peak above what the process held before them: on CPU the peak RSS
(ru_maxrss) less the RSS after building the model and batch; on a GPU torch.cuda.max_memory_allocated less the
allocation then. With GradCache the peak should stay flat as the batch grows (one chunk's activations
plus the representations); without it, it grows with the batch.

Time: per batch size, one process times the same head and batch with GradCache and without, step by step in
turn (`--time-steps` each, after a warm-up step of each; the order swaps every round), so that both see the same
load; the ratio is of the two medians. GradCache's extra is one forward without a graph: with backward about
twice a forward, (F + F + 2F) / (F + 2F) = 4/3, once each chunk fills the device (a chunk too small to keep
it busy pays its fixed costs per chunk instead).

Prints one JSON line and appends it to benchmarks/results/contrastive.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
         "small": {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "intermediate_size": 1536},
         "base": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072}}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _head_and_batch(args, grad_cache: bool):
    """The contrastive head of `--size` (GradCache with `--chunk` when `grad_cache`), its batch of `--batch`
    random full-length pairs, an SGD optimiser, and the device."""
    import numpy as np
    import torch

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(args.threads)
    method = get_method("contrastive")
    options = method.options_from({"max_len": args.max_len, "query_max_len": args.max_len,
                                   "grad_cache": {"chunk": args.chunk} if grad_cache else None})
    head = method.build(options, ModelOptions(**SIZES[args.size], dropout=0.1, pad_token_id=0), seed=0).to(device)
    head.train()
    rng = np.random.default_rng(0)
    text = lambda: rng.integers(2000, 9000, size=args.max_len - 2)  # noqa: E731  full-length texts
    samples = [{"query": text(), "pos": text(), "negs": [], "source": "b", "doc": str(i)} for i in range(args.batch)]
    batch = {k: v.to(device) for k, v in method.collator.from_options(
        options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))(samples).items()}
    optimizer = torch.optim.SGD([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    return head, batch, optimizer, device


def _stepper(head, batch, optimizer):
    def step():
        optimizer.zero_grad(set_to_none=True)
        head(batch)["loss"].backward()
        optimizer.step()
    return step


def point(args) -> dict:
    """One (batch, grad_cache) point's memory, in this process."""
    import torch

    head, batch, optimizer, device = _head_and_batch(args, args.grad_cache)
    cuda = device.type == "cuda"
    step = _stepper(head, batch, optimizer)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else rss_bytes()  # the model and the batch
    step()  # warm-up (its peak counts: a freed allocation may stay in the process and hide the next one's)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    peak = (torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"batch": args.batch, "grad_cache": args.grad_cache, "peak_bytes": peak - before,
            "seconds_per_step": seconds, "seconds_per_pair": seconds / args.batch,
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"}


def interleaved_times(args) -> dict:
    """Seconds per step with GradCache and without, on one head and batch, step by step in turn."""
    import statistics

    import torch

    head, batch, optimizer, device = _head_and_batch(args, grad_cache=True)
    times = {False: [], True: []}

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def timed(grad_cache: bool) -> tuple[float, float]:
        """The step's forward (GradCache: the encodings without a graph, and the loss) and backward (GradCache:
        each chunk encoded again and back-propagated) seconds, the optimiser's step in the latter."""
        head.chunk = args.chunk if grad_cache else None  # the same weights and batch, chunked or whole
        optimizer.zero_grad(set_to_none=True)
        start = now()
        loss = head(batch)["loss"]
        middle = now()
        loss.backward()
        optimizer.step()
        return middle - start, now() - middle

    timed(False), timed(True)  # warm-up
    for round_ in range(args.time_steps):
        for grad_cache in ((False, True) if round_ % 2 == 0 else (True, False)):
            times[grad_cache].append(timed(grad_cache))
    (f, b), (gf, gb) = ([statistics.median(t[i] for t in times[mode]) for i in (0, 1)] for mode in (False, True))
    plain, cached = statistics.median(sum(t) for t in times[False]), statistics.median(sum(t) for t in times[True])
    return {"batch": args.batch, "chunk": args.chunk, "steps_each": args.time_steps,
            "seconds_per_step": {"plain": plain, "grad_cache": cached},
            "seconds": {"plain_forward": f, "plain_backward": b, "grad_cache_forward": gf, "grad_cache_backward": gb},
            "grad_cache_time_ratio": cached / plain,
            # one more forward of every text, at the plain step's own forward and backward times
            "one_more_forward_ratio": (2 * f + b) / (f + b),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else
            f"cpu ({torch.get_num_threads()} threads)"}


def _child(args, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.contrastive", "--child", "--size", args.size, "--chunk", str(args.chunk),
           "--max-len", str(args.max_len), "--steps", str(args.steps), "--time-steps", str(args.time_steps), "--threads",
           str(args.threads), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(record), file=sys.stderr)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batches", default="8,16,32,64,128")
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--time-steps", type=int, default=6)
    # CPU threads per process; 1, as a CPU training rank runs: on a shared machine, threads waiting on each other
    # at every op's barrier cost a chunked step (more, smaller ops) more than the plain one
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--times", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--grad-cache", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "contrastive.json"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(interleaved_times(args) if args.times else point(args)))
        return
    points, times = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        for grad_cache in (False, True):
            points.append(_child(args, "--batch", str(batch), *(["--grad-cache"] if grad_cache else [])))
        times.append(_child(args, "--batch", str(batch), "--times"))
    by = {(p["batch"], p["grad_cache"]): p for p in points}
    batches = sorted({p["batch"] for p in points})
    smallest, largest = batches[0], batches[-1]
    record = {
        "benchmark": "contrastive", "size": args.size, "max_len": args.max_len, "chunk": args.chunk,
        "steps": args.steps, "device": points[0]["device"], "host": platform.node(),
        "memory": "peak RSS above the pre-step RSS" if "cpu" in points[0]["device"] else "max_memory_allocated above the pre-step allocation",
        "points": points, "times": times,
        "grad_cache_time_ratio": {t["batch"]: t["grad_cache_time_ratio"] for t in times},
        "one_more_forward_ratio": {t["batch"]: t["one_more_forward_ratio"] for t in times},
        "peak_growth_without": by[(largest, False)]["peak_bytes"] / by[(smallest, False)]["peak_bytes"],
        "peak_growth_with": by[(largest, True)]["peak_bytes"] / by[(smallest, True)]["peak_bytes"],
        "batch_growth": largest / smallest,
    }
    print(json.dumps(record))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
