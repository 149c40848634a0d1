"""Unpadded against padded batches (`model.unpad`): ModernBERT training steps on the same batches, A/B
interleaved in one process.

    python -m benchmarks.unpadding [--source beir --input DIR] [--size small] [--max-len 512] [--batch 32]

The corpus is prepared as `pretrieve prepare` does; by default the bundled SciFact sample, one abstract a sample (a
passage source), so that batches carry the padding of real text lengths (a BEIR folder with `--input`, e.g. all of
SciFact, or CACM's short records at `--max-len 256`; packed sources such as wikipedia fill their blocks and leave
little padding). Two copies of one ModernBERT-shaped model (same seed) train with `--method`'s head, collator and
AdamW, one on padded batches and one unpadded; each step runs both on the same batch, the order alternating.
ModernBERT's own configs have no dropout, and neither do these, so that attention can take the varlen kernel on a
GPU. fp32 on CPU (`--threads`), bf16 autocast on a GPU.

Prints one JSON line and appends it to benchmarks/results/unpadding.json: real tokens/s each way, their ratio
(`unpadded_over_padded`), the padding fraction, the attention path, and the loss difference at the first step.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from contextlib import nullcontext
from itertools import islice
from pathlib import Path

import torch

from pretrieve.data.masking import Vocabulary
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_tokenizer
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import get_method
from pretrieve.models.unpadding import VARLEN_WINDOW, varlen_attn

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
# ModernBERT-shaped: tiny; small ~ the shape of MiniLM; base = ModernBERT-base (22 layers, GeGLU 1152)
SIZES = {"tiny": {"hidden_size": 64, "num_layers": 3, "num_heads": 2, "intermediate_size": 128},
         "small": {"hidden_size": 384, "num_layers": 6, "num_heads": 6, "intermediate_size": 576},
         "base": {"hidden_size": 768, "num_layers": 22, "num_heads": 12, "intermediate_size": 1152}}


def batches_of(source: str, inputs: str, max_len: int, batch: int, count: int, work: Path) -> list[list[dict]]:
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.stream import ShardStream

    prepare(PrepareOptions(source=source, inputs=[inputs], out=str(work), workers=0, max_len=max_len, progress=False))
    samples = list(islice(iter(ShardStream([work / "manifest.json"], seed=0, shuffle_buffer=256)), batch * count))
    if len(samples) < batch * count:
        samples = [s for _ in range(-(-batch * count // len(samples))) for s in samples][:batch * count]
    return [samples[i * batch:(i + 1) * batch] for i in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default="beir", help="a `pretrieve prepare` source")
    p.add_argument("--input", default=str(SAMPLES / "beir" / "scifact-sample"), help="its files or folder")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "unpadding.json"))
    p.add_argument("--method", default="mlm")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    for flag, default in (("--max-len", 512), ("--batch", 32), ("--steps", 12), ("--threads", 2)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the averages")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    torch.set_num_threads(args.threads)
    spec = get_method(args.method)
    options = spec.options_from({"max_len": args.max_len})
    collate = spec.collator.from_options(options, Vocabulary.of_tokenizer(DEFAULT_TOKENIZER), seed=0)
    with tempfile.TemporaryDirectory() as work:
        batches = [collate(b) for b in batches_of(args.source, args.input, args.max_len, args.batch, args.steps,
                                                  Path(work))]
    model = ModelOptions(backbone="modernbert", max_position_embeddings=args.max_len, dropout=0.0,
                         pad_token_id=load_tokenizer(DEFAULT_TOKENIZER).pad_token_id, **SIZES[args.size])
    runs = {}
    for name, unpad in (("padded", False), ("unpadded", True)):
        head = spec.build(options, ModelOptions(**{**model.__dict__, "unpad": unpad}), seed=0).to(device).train()
        runs[name] = {"head": head, "optimizer": torch.optim.AdamW(head.parameters(), lr=1e-4), "seconds": 0.0,
                      "losses": []}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if gpu else nullcontext()
    tokens = 0
    for step, batch in enumerate(batches):
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        order = ("padded", "unpadded") if step % 2 == 0 else ("unpadded", "padded")
        for name in order:
            run = runs[name]
            if gpu:
                torch.cuda.synchronize()
            started = time.perf_counter()
            with autocast:
                loss = run["head"](batch)["loss"]
            loss.backward()
            run["optimizer"].step()
            run["optimizer"].zero_grad(set_to_none=True)
            if gpu:
                torch.cuda.synchronize()
            if step >= args.warmup:
                run["seconds"] += time.perf_counter() - started
            run["losses"].append(loss.item())
        if step >= args.warmup:
            tokens += int(batch["attention_mask"].sum())
    padding = 1 - sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["attention_mask"].numel()
                                                                              for b in batches)
    rate = {name: tokens / run["seconds"] for name, run in runs.items()}
    result = {
        "source": args.source, "input": Path(args.input).name, "method": args.method, "size": args.size,
        "max_len": args.max_len, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
        "device": torch.cuda.get_device_name() if gpu else f"cpu x{args.threads} threads "
                                                             f"({platform.processor() or platform.machine()})",
        "precision": "bf16 autocast" if gpu else "fp32",
        "attention": "padded SDPA" if not gpu or varlen_attn is None else
                     "varlen (cu_seqlens)" if VARLEN_WINDOW else "varlen in global layers, padded SDPA in local ones",
        "padding_fraction": round(padding, 4),
        "padded_tokens_per_s": round(rate["padded"], 1), "unpadded_tokens_per_s": round(rate["unpadded"], 1),
        "unpadded_over_padded": round(rate["unpadded"] / rate["padded"], 3),
        "first_step_loss_difference": abs(runs["padded"]["losses"][0] - runs["unpadded"]["losses"][0]),
    }
    out = Path(args.out)  # a list of results, one per run
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([*(json.loads(out.read_text()) if out.is_file() else []), result], indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
