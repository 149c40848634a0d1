"""Two-stream masked attention on a GPU: fused Triton kernel vs eager vs SDPA with a dense mask; its times make
the table `method.attention_impl: auto` reads (kernels/choice.py).

    python -m pretrieve.kernels.tune [--lengths 128 256 512 1024] [--out benchmarks/results/two_stream_attention.json]
        [--update-table]
    python -m pretrieve.kernels.tune --update-table --from RESULT.json   # a result measured elsewhere

B = 32, H = 12, D = 64, bf16; masks from the RetroMAE collator's compact form (pool of min(L, 256) rows,
half of the words hidden). Per implementation and L: forward+backward time (CUDA events, median of 20
after 5 warm-ups), peak memory allocated during the call, and the mask bytes copied host -> device (the
compact pool + row index for every path, since the dense mask is expanded on the device; the official
collator ships an L x L int64 tensor), and the winner of fused and SDPA. Needs CUDA; exits with a message
otherwise. --update-table merges the per-length times into the table `method.attention_impl: auto` reads
(pretrieve/assets/decoder_attention.json, kernels/choice.py), replacing this device's entries at these lengths.
--out is relative to the working folder: run from the repository root, the result goes beside the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from pretrieve.data.masking import decoder_mask_pool
from pretrieve.kernels import CompactMask, choice, two_stream_attention

B, H, D = 32, 12, 64


def compact_mask(length: int, device) -> tuple[CompactMask, int]:
    lengths = np.full(B, length)
    pos = np.arange(length)[None]
    words = np.broadcast_to(np.where((pos >= 1) & (pos < length - 1), (pos - 1) * 3 // 4, -1), (B, length))
    pool, rows = decoder_mask_pool(words, np.full(B, (length - 2) * 3 // 4 + 1), lengths, 256, 0.5,
                                   np.random.default_rng(0))
    host_bytes = pool.nbytes + rows.nbytes
    return CompactMask(torch.from_numpy(pool).to(device), torch.from_numpy(rows).to(device),
                       torch.from_numpy(lengths).to(device)), host_bytes


def time_impl(impl: str, q, k, v, mask) -> dict:
    grad = torch.randn_like(q)

    def step():
        for x in (q, k, v):
            x.grad = None
        two_stream_attention(q, k, v, mask, impl=impl).backward(grad)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return {"fwd_bwd_ms": round(float(np.median(times)), 3),
            "peak_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)}


def measure(lengths: list[int]) -> dict:
    device = torch.device("cuda")
    import triton

    report = {"setup": {"batch": B, "heads": H, "head_dim": D, "dtype": "bfloat16",
                        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                        "torch": torch.__version__, "triton": triton.__version__}, "lengths": {}}
    for length in lengths:
        mask, host_bytes = compact_mask(length, device)
        q, k, v = (torch.randn(B, H, length, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        row = {"mask_host_bytes_per_sample": host_bytes // B,
               "official_mask_bytes_per_sample": length * length * 8}
        for impl in ("eager", "sdpa", "fused"):
            row[impl] = time_impl(impl, q, k, v, mask)
            print(length, impl, row[impl], flush=True)
        row["fused_speedup_vs_eager"] = round(row["eager"]["fwd_bwd_ms"] / row["fused"]["fwd_bwd_ms"], 2)
        row["fused_speedup_vs_sdpa"] = round(row["sdpa"]["fwd_bwd_ms"] / row["fused"]["fwd_bwd_ms"], 2)
        row["winner"] = min(choice.CANDIDATES, key=lambda impl: row[impl]["fwd_bwd_ms"])
        report["lengths"][str(length)] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--out", default=str(Path("benchmarks") / "results" / "two_stream_attention.json"))
    parser.add_argument("--update-table", action="store_true",
                        help="merge the times into pretrieve/assets/decoder_attention.json (what auto reads)")
    parser.add_argument("--from", dest="source", help="with --update-table: a result JSON to merge, no timing")
    args = parser.parse_args()
    if args.source:
        if not args.update_table:
            sys.exit("--from only feeds --update-table")
        report, source = json.loads(Path(args.source).read_text()), args.source
    else:
        if not torch.cuda.is_available():
            sys.exit("python -m pretrieve.kernels.tune needs a CUDA GPU (the fused kernel's CPU path is the "
                     "Triton interpreter, which checks correctness only)")
        report, source = measure(args.lengths), args.out
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({L: (r["fused_speedup_vs_eager"], r["fused_speedup_vs_sdpa"], r["winner"])
                          for L, r in report["lengths"].items()}))
    if args.update_table:
        entries = choice.entries_from_benchmark(report, source)
        choice.write_table(choice.merged(choice.load_table(), entries))
        print(f"{choice.TABLE}: {len(entries)} measurements of {report['setup']['device']} merged")


if __name__ == "__main__":
    main()
