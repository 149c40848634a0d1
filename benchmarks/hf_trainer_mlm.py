"""The MLM baseline a user would run without pretrieve: HF's Trainer with `BertForMaskedLM` (SDPA attention),
`DataCollatorForLanguageModeling` (15 % masking), bf16 on a GPU, the Trainer's default optimizer, on the same
text blocks as `benchmarks/pretrain_throughput.py` (the bundled Wikipedia sample prepared at the same length).

    python -m benchmarks.hf_trainer_mlm --size base --seq-len 512 --batch 32 --steps 12 --warmup 4 [--out FILE]

Prints one JSON line and appends it to `--out` (default benchmarks/results/pretrain_throughput.json) with
`"peer": "hf-trainer"`: tokens/s (non-padding tokens) over the steps after `--warmup`, and TFLOP/s and MFU by
pretrieve's own analytic count for `mlm` on the same batches (engine/flops.py: the vocabulary projection at the
masked positions only, which is what the model needs; HF computes it at every position), so that a ratio to
pretrieve's `mlm` is a ratio of useful work.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch

from benchmarks.pretrain_throughput import ROOT, SAMPLES, SIZES, append_record


def text_blocks(seq_len: int, count: int, work: Path) -> list[list[int]]:
    """`count` blocks of the Wikipedia sample as `pretrieve prepare` cuts them, each [CLS] ids [SEP]."""
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.stream import ShardStream
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(work / "shards"),
                           max_len=seq_len, workers=0, progress=False))
    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    stream = ShardStream([work / "shards" / "manifest.json"], seed=0, shuffle_buffer=64)
    return [[vocab.cls_id, *s["ids"][:seq_len - 2].tolist(), vocab.sep_id] for s in islice(iter(stream), count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=[s for s, v in SIZES.items() if "backbone" not in v], default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pretrain_throughput.json"))
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    from transformers import (BertForMaskedLM, DataCollatorForLanguageModeling, PreTrainedTokenizerFast, Trainer,
                              TrainerCallback, TrainingArguments)

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
    from pretrieve.engine.flops import device_peak, train_flops
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    gpu = torch.cuda.is_available()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(DEFAULT_TOKENIZER))
    config = ModelOptions(**SIZES[args.size]).hf_config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = BertForMaskedLM(config)
    mlm = get_method("mlm")
    mlm_options = mlm.options_from({"max_len": args.seq_len})
    masking = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    counted = {"tokens": 0, "flops": 0, "steps": 0}

    def collate(examples):
        batch = masking(examples)
        if counted["steps"] >= args.warmup:  # the timed steps' work: tokens, and the useful FLOPs
            counted["tokens"] += int(batch["attention_mask"].sum())
            counted["flops"] += train_flops(mlm, mlm_options, config, {**batch, "mlm_labels": batch["labels"]})
        counted["steps"] += 1
        return batch

    class Clock(TrainerCallback):
        """Wall time from the end of the warm-up steps to the end of the last, the device drained at both."""

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in (args.warmup, args.steps):
                if gpu:
                    torch.cuda.synchronize()
                counted[f"t{state.global_step}"] = time.perf_counter()

    with tempfile.TemporaryDirectory() as work:
        blocks = text_blocks(args.seq_len, args.steps * args.batch, Path(work))
        train_args = TrainingArguments(output_dir=str(Path(work) / "trainer"), per_device_train_batch_size=args.batch,
                                       max_steps=args.steps, learning_rate=1e-4, weight_decay=0.01, warmup_steps=0.1,
                                       bf16=gpu, logging_steps=args.steps, save_strategy="no", report_to=[],
                                       disable_tqdm=True, seed=0)
        dataset = [{"input_ids": ids} for ids in blocks]
        Trainer(model=model, args=train_args, train_dataset=dataset, data_collator=collate,
                callbacks=[Clock()]).train()
    seconds = counted[f"t{args.steps}"] - counted[f"t{args.warmup}"]
    # batches are counted by their index (the loader may collate one ahead of the step): exactly `steps` of them
    assert counted["steps"] == args.steps, f"collated {counted['steps']} batches for {args.steps} steps"
    timed_steps = args.steps - args.warmup
    tokens_per_s = counted["tokens"] / seconds
    flops_per_s = counted["flops"] / seconds
    import resource

    peak = device_peak(torch.device("cuda" if gpu else "cpu"), "bf16" if gpu else "fp32")
    memory = torch.cuda.max_memory_allocated() if gpu else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {"peer": "hf-trainer", "method": "mlm", "size": args.size, "seq_len": args.seq_len, "batch": args.batch,
              "steps": args.steps, "warmup": args.warmup, "timed_steps": timed_steps,
              "device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor() or platform.machine()})",
              "precision": "bf16" if gpu else "fp32", "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "optimizer": train_args.optim.value,
              "attention": model.config._attn_implementation,
              "tokens_per_s": round(tokens_per_s, 1),
              "tflops_per_device": round(flops_per_s / 1e12, 4),
              "mfu": None if not peak else round(flops_per_s / peak, 4),
              "peak_memory_gib": round(memory / 2**30, 3)}
    append_record(Path(args.out), result)


if __name__ == "__main__":
    main()
