"""`pretrieve pretrain` and `pretrieve export`: the pre-training recipe, beside fine-tuning's (finetune/run.py).

A recipe hands the training loop (engine/train.py) a TrainingJob: the method's head on a new encoder (the
registry), the shard stream and its loader with the method's collator, the counts and FLOPs of a batch, the
held-out validation batches, and the export of the final checkpoint. The loop owns everything else: DeepSpeed,
checkpoints, resume, logging, stop signals (docs/design.md, "Layers" and "Data flow").
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import torch

from pretrieve.engine.checkpoint import load_checkpoint_weights
from pretrieve.engine.flops import train_flops
from pretrieve.engine.tracking import run_tags
from pretrieve.engine.train import TrainingJob, run_training
from pretrieve.engine.validation import VALIDATION_SEED, Validation
from pretrieve.models.lora import adapter_shape, trained_summary
from pretrieve.pretrain_config import Experiment
from pretrieve.pretrain_tokenizer import RUN_TOKENIZER
from pretrieve.utils.run_dir import locate

ENCODER_CONFIG = "encoder_config.json"  # in the run directory: the encoder's architecture, for the export


def train(exp: Experiment) -> dict:
    """Pre-train exp.method on exp.data."""
    return run_training(exp, pretraining_job)


def pretraining_job(exp: Experiment, rank: int) -> TrainingJob:
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.remote import ReadOptions
    from pretrieve.data.shard_check import check_shards
    from pretrieve.data.stream import ShardStream, StreamLoader
    from pretrieve.data.tokenizer import describe, load_tokenizer

    head = exp.method.build(exp.options, exp.model, seed=exp.seed)
    if rank == 0:  # the architecture, also when it came from model.init_from: `pretrieve export` rebuilds from it
        head.encoder.config.to_json_file(exp.run_dir / ENCODER_CONFIG)
    adapters = adapter_shape(head.encoder.model)  # LoRA: FLOPs without the frozen weights' gradients
    if exp.model.lora.r and rank == 0:
        print(trained_summary(head, exp.model.lora.r), file=sys.stderr, flush=True)
    # masking's special tokens and word boundaries are the tokenizer's; the shards must have been prepared with it
    tokenizer = exp.data.tokenizer_dir()
    loaded = load_tokenizer(tokenizer)  # once, for the vocabulary's roles and the shards' fingerprint
    if rank == 0 and tokenizer == exp.model.init_from:  # the export's, even if init_from moves
        loaded.save_pretrained(str(exp.run_dir / RUN_TOKENIZER))
    collate = static(exp, exp.method.collator.from_options(exp.options, Vocabulary.of_loaded(loaded, tokenizer),
                                                           seed=exp.seed))
    training_tokenizer = describe(tokenizer, loaded.backend_tokenizer)  # what the shards' manifests must record
    read = ReadOptions.from_options(exp.data)  # URLs: retries, timeout, prefetch, storage options
    # a truncated or replaced shard named now, not minutes into the run
    check_shards([*exp.data.manifests, *exp.data.validation], read, exp.data.check_shards)
    stream = ShardStream(exp.data.manifests, weights=exp.data.weights, seed=exp.seed,
                         shuffle_buffer=exp.data.shuffle_buffer, read=read, tokenizer=training_tokenizer,
                         one_source_batches=exp.data.one_source_batches, batch_size=exp.train.micro_batch_size)
    # The loader's own generator: starting an iteration must not draw from the global RNG (dropout), or a
    # resumed run, which starts its iteration at another step, would drift from an uninterrupted one.
    loader = StreamLoader(stream, batch_size=exp.train.micro_batch_size, num_workers=exp.data.num_workers,
                          collate_fn=collate, generator=torch.Generator().manual_seed(exp.seed),
                          pin_memory=torch.cuda.is_available())  # page-locked batches: asynchronous copies
    validation = None
    if exp.data.validation:
        validation = Validation.build(exp.data.validation, static(exp, exp.method.collator.from_options(
            exp.options, collate.vocab, seed=VALIDATION_SEED)), exp.train.micro_batch_size, exp.data.validation_batches,
            read, tokenizer=training_tokenizer)
    return TrainingJob(
        name=f"pretrain {exp.method.name}", module=head, loader=loader, position=stream,
        count=getattr(collate, "count", count_texts),
        flops=lambda batch: train_flops(exp.method, exp.options, head.encoder.config, batch, adapters),
        # from the final checkpoint: ZeRO partitions consolidated, fp32 master weights under bf16/fp16
        export=lambda run_dir: export_checkpoint(run_dir, run_dir / "export", overwrite=True),
        tags=run_tags(exp.method.name, exp.data.corpora, head.encoder.config), validation=validation,
        at_step=lambda step: head.set_step(step, exp.train.max_steps),
        resolved={"method": {"name": exp.method.name, **asdict(head.resolved_options())}})


def static(exp: Experiment, collate):
    """The collator with train.static_shapes (its check refused a method whose collator does not take it)."""
    if exp.train.static_shapes:
        collate.static_shapes = True
    return collate


def count_texts(batch: dict) -> tuple[int, int, int]:
    """(texts, non-padding tokens, positions) of a batch of the encoder's texts; a collator of other batches
    (pairs) has its own `count`."""
    mask = batch["attention_mask"]
    # counted on the host batch by numpy: no torch op a step (on a GPU, not even one to launch)
    tokens = int(mask.numpy().sum()) if mask.device.type == "cpu" else int(mask.sum())
    return len(batch["input_ids"]), tokens, mask.numel()


def export_checkpoint(path: str | Path, out: str | Path, keep_adapter: bool | None = None,
                      overwrite: bool = False) -> Path:
    """`pretrieve export CHECKPOINT OUT`: a pre-training checkpoint as an HF directory plus the head's weights and
    a model card. CHECKPOINT is a run directory (its latest checkpoint), its checkpoints/ directory, or one tag
    directory. The head is rebuilt from the run's config.yaml and encoder_config.json. A LoRA run's adapters are
    merged, or written apart with `keep_adapter` (None: as the run's model.lora.keep_adapter says). OUT may be
    new, empty, or an earlier export that `overwrite` replaces (models.export.check_export_folder)."""
    from pretrieve.config import load_config, section
    from pretrieve.eval.model_card import write_model_card
    from pretrieve.models.encoder import Encoder
    from pretrieve.models.export import check_export_folder, export
    from pretrieve.models.lora import add_lora, no_adapter
    from pretrieve.models.st_config import declared_pooling
    from pretrieve.pretrain_config import DataOptions, method_options, model_options

    run_dir, ckpt_dir, tag = locate(Path(path))
    check_export_folder(out, overwrite)
    config = load_config(run_dir / "config.yaml")
    lora = model_options(config).lora
    if keep_adapter and not lora.r:
        raise ValueError(no_adapter(run_dir, "model.lora"))
    method, options = method_options(config)
    head = method.head(Encoder.from_config_file(run_dir / ENCODER_CONFIG), options)
    if lora.r:  # the checkpoint holds the adapted layout: the export merges the adapters (or keeps them apart)
        add_lora(head.encoder.model, lora)
    load_checkpoint_weights(head, ckpt_dir, tag)
    # a run from a checkpoint keeps a copy of the checkpoint's tokenizer; the others name theirs in config.yaml
    copy = run_dir / RUN_TOKENIZER
    tokenizer = str(copy) if copy.is_dir() else section(config, "data", DataOptions).tokenizer_dir()
    init_from = model_options(config).init_from
    return export(head, out, tokenizer=tokenizer,
                  before_rename=lambda tmp: write_model_card(out, run_dir, tag, card_dir=tmp),
                  keep_adapter=lora.keep_adapter if keep_adapter is None else keep_adapter,
                  continued=declared_pooling(init_from) if init_from else None)
