"""Collator throughput on the data-loader path: samples/s on one core and decoder-mask bytes per sample.

    python -m benchmarks.collators [--batches 100] [--out benchmarks/results/collators.json]
    python -m benchmarks.collators --max-len 8192 --batch 8 --batches 4   # long context: collators-8192.json

B = 32, L = 512 (the bundled Wikipedia sample prepared at max_len 512; full 510-token blocks), one process,
one thread; every registered method's collator. The baseline, measured in the same run on a few batches, is
the official RetroMAE collator's algorithm: per text, min(L, 256) whole-word masks drawn token list by token
list in Python, then an L x L int64 mask built row by row (a row = a copy of a random pool mask with its own
position hidden).

With --max-len above 512: the bundled Wikipedia sample and books prepared at that length, blocks of at least
95 % of it (the longest the samples give), and no baseline run: its L x L int64 mask is reported by its size
alone (512 MiB per text at 8,192).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.hf_whole_word import hf_whole_word_mask
from pretrieve.data.masking import Vocabulary
from pretrieve.data.prepare import PrepareOptions, prepare
from pretrieve.data.stream import ShardStream
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
from pretrieve.models.heads import get_method

SAMPLES = Path(__file__).resolve().parent.parent / "pretrieve" / "assets" / "samples"
BATCH, MAX_LEN = 32, 512  # defaults; --batch, --max-len
METHODS = ("mlm", "retromae", "dupmae", "seed", "costa", "cotmae", "cotmote")


def load_samples(work: Path, count: int, max_len: int = MAX_LEN) -> list[dict]:
    sources = ("wikipedia",) if max_len == MAX_LEN else ("wikipedia", "books")
    manifests = []
    for source in sources:
        prepare(PrepareOptions(source=source, inputs=[str(SAMPLES / source)], out=str(work / source), workers=0,
                               max_len=max_len, progress=False))
        manifests.append(work / source / "manifest.json")
    stream = ShardStream(manifests, seed=0, shuffle_buffer=1)
    # full-length blocks (L = 512 exactly); long ones are cut at word ends, so 95 % of L and more
    shortest = max_len - 2 if max_len == MAX_LEN else int(0.95 * (max_len - 2))
    full = [s for s in iter(stream) if len(s["ids"]) >= shortest]
    # repeated as further epochs: new masks, and the real shard positions CoT-MAE's neighbour lookup needs
    return [dict(s, epoch=i // len(full)) for i, s in zip(range(count), (s for _ in range(count) for s in full))]


def measure(collate, batches: list[list[dict]]) -> tuple[float, dict]:
    collate(batches[0])  # warm-up
    started = time.perf_counter()
    for batch in batches:
        out = collate(batch)
    seconds = time.perf_counter() - started
    return sum(map(len, batches)) / seconds, out


class OfficialRetroMAECollator:
    """The official algorithm (RetroMAE's pretrain/data.py with HF's whole-word masking), re-stated here."""

    def __init__(self, backend, encoder_ratio=0.3, decoder_ratio=0.5):
        self.id_to_token = {i: t for t, i in backend.get_vocab().items()}
        self.encoder_ratio, self.decoder_ratio = encoder_ratio, decoder_ratio

    def _whole_word_mask(self, tokens: list[str], ratio: float) -> list[int]:
        return hf_whole_word_mask(tokens, ratio)

    def __call__(self, samples: list[dict]) -> dict:
        masks, encoder_masks = [], []
        for s in samples:
            ids = [101, *s["ids"].tolist(), 102]
            tokens = [self.id_to_token[i] for i in ids]
            encoder_masks.append(self._whole_word_mask(tokens, self.encoder_ratio))
            pool = [self._whole_word_mask(tokens, self.decoder_ratio) for _ in range(min(len(tokens), 256))]
            rows = []
            for i in range(len(tokens)):
                row = list(pool[random.randint(0, len(pool) - 1)])
                row[i] = 1
                rows.append(row)
            masks.append(1 - torch.tensor(rows))
        return {"decoder_attention_mask": torch.stack(masks), "encoder_mask": torch.tensor(encoder_masks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--official-batches", type=int, default=1, help="the baseline takes ~7 s per batch")
    parser.add_argument("--max-len", type=int, default=MAX_LEN)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/collators.json, at another "
                        "--max-len collators-<max-len>.json")
    args = parser.parse_args()
    long = args.max_len != MAX_LEN
    args.out = args.out or str(Path(__file__).parent / "results" / (
        f"collators-{args.max_len}.json" if long else "collators.json"))
    torch.set_num_threads(1)  # one core, as a loader worker
    backend = load_backend(DEFAULT_TOKENIZER)
    vocab = Vocabulary.from_backend(backend)
    work = tempfile.TemporaryDirectory()  # kept until the end: CoT-MAE reads neighbour blocks from the shards
    samples = load_samples(Path(work.name), args.batch * args.batches, args.max_len)
    batches = [samples[i:i + args.batch] for i in range(0, len(samples), args.batch)]
    dense_bytes = args.max_len * args.max_len * 8  # the official L x L int64 mask

    results: dict = {}
    for name in METHODS:
        method = get_method(name)
        options = method.options_from({"max_len": args.max_len})
        rate, out = measure(method.collator.from_options(options, vocab, seed=0), batches)
        # a row a text, or two (CoT-MAE's and CoT-MoTE's: each text and its context, encoded alike)
        assert out["input_ids"].shape[0] in (args.batch, 2 * args.batch) and out["input_ids"].shape[1] <= args.max_len
        mask_bytes = sum(out[k].numel() * out[k].element_size()
                         for k in ("dec_pool", "dec_row") if k in out) / args.batch
        results[name] = {"samples_per_s": round(rate, 2), "ms_per_sample": round(1000 / rate, 2),
                         "width": out["input_ids"].shape[1], "mask_bytes_per_sample": int(mask_bytes),
                         "mask_fraction_of_dense": round(mask_bytes / dense_bytes, 6)}
        if "ctx_from_self" in out:  # how often a document had no neighbouring block (last batch)
            results[name]["ctx_from_self_fraction"] = round(out["ctx_from_self"].float().mean().item(), 3)
        print(name, results[name], flush=True)

    report = {name: results[name] for name in METHODS}
    if long:  # an L x L int64 mask per text: not built
        report["official_retromae_mask_bytes_per_sample"] = dense_bytes
    else:
        random.seed(0)
        rate, out = measure(OfficialRetroMAECollator(backend), batches[:max(1, args.official_batches)])
        official = {"samples_per_s": round(rate, 2), "mask_bytes_per_sample": dense_bytes,
                    "mask_shape": list(out["decoder_attention_mask"].shape), "batches": args.official_batches}
        print("official retromae", official, flush=True)
        report["baseline_official_retromae"] = official
        report["retromae_speedup_vs_official"] = round(results["retromae"]["samples_per_s"]
                                                       / official["samples_per_s"], 1)
    work.cleanup()
    lengths = [len(s["ids"]) + 2 for s in samples]
    report["setup"] = {"batch": args.batch, "seq_len": args.max_len, "batches": args.batches, "threads": 1,
                       "mean_text_tokens": round(sum(lengths) / len(lengths), 1),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores", "numpy": np.__version__,
                       "torch": torch.__version__,
                       "command": "python -m benchmarks.collators" + (
                           f" --max-len {args.max_len} --batch {args.batch} --batches {args.batches}" if long else "")}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k]["samples_per_s"] for k in METHODS}))


if __name__ == "__main__":
    main()
