"""`pretrieve estimate CONFIG --devices 8xH100 [--nodes N]`: what a pre-training config's schedule costs before it
is launched: wall time, GPU-hours, tokens, FLOPs, memory per device and checkpoint size. `scale plan` prices its
points with the same parts (micro_batch_cost, device_rate).

- **Schedule.** train.max_steps optimizer steps of micro_batch_size x grad_accum x world sequences (world =
  devices x nodes). FLOPs: engine/flops.py's training FLOPs of one micro-batch (the encoder's and the method's
  registered `flops`, as the training loop counts them) x grad_accum x world x steps; tokens: the micro-batch's
  non-padding tokens, as the loop counts them, x the same. The micro-batch is the first of data.manifests (as
  `scale plan` reads its points'), or while the shards are not there, micro_batch_size full blocks of
  method.max_len tokens drawn from the tokenizer's vocabulary (what packing mostly makes); a method trained on
  pairs needs its shards.
- **Rate.** The sustained training FLOP/s of one device, from pretrieve's own throughput records
  (scale/records.py). On a device kind with records: the nearest record of that kind (the method, the size by
  FLOPs a token, the settings), whose MFU x the kind's peak at the config's precision is the record's own FLOP/s
  when the precisions agree: its tokens/s scaled by the FLOPs a token. On a kind without records: its peak at the
  best MFU among the nearest records of the other kinds. `--mfu` states the MFU instead. Activation checkpointing
  recomputes the encoder's forward in backward: those FLOPs take time but are not counted (MFU counts useful
  FLOPs). Data-parallel ranks are taken to add up linearly: the records are one-device runs, and the gradients'
  all-reduce, start-up, held-out loss and checkpoint writes are left out.
- **Memory.** scale/memory.py's model at the config's ZeRO stage on this world, against 90 % of the device; when
  it does not fit, each setting that would make it fit (a higher ZeRO stage, activation checkpointing, a smaller
  micro-batch with more accumulation) with the memory it would need.
- **Checkpoint.** scale/memory.py's checkpoint_bytes, x checkpoint.keep on disk.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pretrieve.scale.memory import (
    CONFIG_WORDING,
    DEVICES,
    GB,
    USABLE_SHARE,
    checkpoint_bytes,
    device,
    device_flops,
    estimate,
    fit_fixes,
    meta_head,
    needed,
)
from pretrieve.scale.records import Record, nearest, setting_keys

GPU_KINDS = tuple(name for name in DEVICES if DEVICES[name].part is not None)


@dataclass(frozen=True)
class Devices:
    count: int  # devices a node
    kind: str  # a scale/memory.py DEVICES name
    nodes: int = 1

    @property
    def world(self) -> int:
        return self.count * self.nodes

    def __str__(self) -> str:
        return f"{self.nodes} nodes x {self.count}x{self.kind}" if self.nodes > 1 else f"{self.count}x{self.kind}"


def parse_devices(text: str, nodes: int = 1) -> Devices:
    """`--devices COUNTxKIND` (8xH100, h200: one), `--nodes` of them; errors name the flag and the known kinds."""
    found = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([A-Za-z][\w-]*)\s*", text)
    known = ", ".join(GPU_KINDS)
    if found is None:
        raise ValueError(f"--devices {text!r}: expected COUNTxKIND, e.g. 8xH100 (kinds: {known})")
    count, kind = int(found.group(1) or 1), found.group(2).lower()
    if kind not in GPU_KINDS:
        raise ValueError(f"--devices {text}: unknown device kind {found.group(2)!r} (known: {known})")
    if count < 1 or nodes < 1:
        raise ValueError(f"--devices {text} --nodes {nodes}: both counts must be >= 1")
    return Devices(count, kind, nodes)


@dataclass(frozen=True)
class MicroBatchCost:
    flops: float  # training FLOPs, as the loop counts them (engine/flops.py)
    tokens: int  # non-padding tokens, as the loop counts them
    recompute: float  # encoder forward FLOPs activation checkpointing computes again (not in `flops`)
    memory: dict  # scale/memory.py's estimate


def micro_batch_cost(exp, batch: dict, samples: int, world: int, count=None, head=None) -> MicroBatchCost:
    """The cost of training `exp` on `batch`, its collated micro-batch of `samples` stream samples, on `world`
    ranks; `count`: the collator's count of a batch (default: its texts'); `head`: exp's head on the meta
    device, when built already."""
    from pretrieve.engine.flops import train_flops
    from pretrieve.models.flops import ENCODER_INPUTS, layer_flops
    from pretrieve.models.lora import adapter_shape
    from pretrieve.pretrain import count_texts

    head = meta_head(exp) if head is None else head
    config = exp.model.hf_config()
    flops = train_flops(exp.method, exp.options, config, batch, adapter_shape(head.encoder.model))
    recompute = 0.0
    if exp.train.activation_checkpointing:
        recompute = sum(config.num_hidden_layers * layer_flops(config, ids.shape[0], ids.shape[1], ids.shape[1])
                        for key, ids in batch.items() if key in ENCODER_INPUTS)
    return MicroBatchCost(float(flops), (count or count_texts)(batch)[1], float(recompute),
                          estimate(exp, world, batch, samples, head=head))


@dataclass(frozen=True)
class Rate:
    flops_per_s: float  # sustained training FLOP/s of one device
    mfu: float
    basis: str  # what the rate rests on, in words
    record: Record | None = None
    extrapolation: float | None = None  # the config's training FLOPs a token over the record's
    spread: tuple[float, float] | None = None  # the FLOP/s of the same measurement repeated: lowest, highest


def device_rate(kind: str, precision: str, method: str, flops_per_token: float, settings: dict,
                records: list[Record], mfu: float | None = None) -> Rate:
    """The training FLOP/s one `kind` device sustains on `method` at `flops_per_token` training FLOPs a token in
    `precision`: the module docstring's rate."""
    from pretrieve.engine.flops import matmul_precision

    peak = device_flops(kind, precision)
    at = f"{kind}'s {peak / 1e12:.4g} TFLOP/s peak at {precision}"
    if mfu is not None:
        return Rate(mfu * peak, mfu, f"{mfu:.1%} MFU (--mfu) of {at}")
    part = device(kind).part
    own = [r for r in records if r.part == part]
    if own:
        tied = nearest(own, method, flops_per_token, settings)
        record, how = tied[0], f"the nearest record of {kind}"
    else:
        best = [nearest([r for r in records if r.part == other], method, flops_per_token, settings)[0]
                for other in sorted({r.part for r in records})]
        if not best:
            raise ValueError(f"no throughput records of any device kind to price {kind} from: give --records "
                             "FILE (benchmarks/results/*_gpu.json of a pretrieve checkout) or --mfu")
        record = max(best, key=_mfu)
        tied, how = [record], f"no record of {kind}: its peak at the best MFU measured on another kind, by the record"
    measured = _mfu(record)
    basis = f"{how}: {record.describe()}; {measured:.2%} MFU x {at}"
    if matmul_precision(record.precision) != matmul_precision(precision):
        basis += f" (its MFU at {record.precision} taken to hold at {precision})"
    spread = None
    if len(tied) > 1:
        rates = sorted(_mfu(r) * peak for r in tied)
        spread = (rates[0], rates[-1])
    return Rate(measured * peak, measured, basis, record, flops_per_token / record.flops_per_token, spread)


def _mfu(record: Record) -> float:
    """The record's MFU from its own FLOP/s (the stored one is rounded)."""
    from pretrieve.engine.flops import GPU_PEAKS, matmul_precision

    peaks = next(peaks for _, part, peaks in GPU_PEAKS if part == record.part)
    return record.flops_per_s / peaks[matmul_precision(record.precision)]


def speed_settings(exp, keys: set[str]) -> dict:
    """The config's value of each setting key a record names (train.micro_batch_size, model.vocab_loss, ...), as
    the record's strings, `auto` as it resolves on a GPU."""
    import torch

    from pretrieve.engine.optimizer import resolve as optimizer
    from pretrieve.models.vocab_loss import resolve as vocab_loss

    resolved = {"model.vocab_loss": lambda v: vocab_loss(v, torch.device("cuda")) if v == "auto" else v,
                "train.optimizer": optimizer}
    settings = {}
    for key in keys:
        value = exp
        for name in key.split("."):  # model.lora.r: exp.model.lora.r
            value = getattr(value, name, None)
        if value is not None:
            settings[key] = str(resolved.get(key, lambda v: v)(value)).lower()
    return settings


@dataclass
class Estimate:
    config: str
    devices: str
    world: int
    method: str
    precision: str
    batch_from: str  # where the micro-batch came from
    steps: int
    sequences_per_step: int
    tokens: float
    flops: float  # the schedule's useful training FLOPs
    recomputed: float  # the schedule's FLOPs activation checkpointing recomputes
    flops_per_s: float  # one device's
    mfu: float
    rate_basis: str
    extrapolation: float | None
    hours: float
    hours_range: tuple[float, float] | None
    gpu_hours: float
    memory_gb: float
    usable_gb: float
    fits: bool
    fixes: list[str]
    checkpoint_gb: float
    checkpoints_kept: int
    parameters: int

    def as_dict(self) -> dict:
        return asdict(self)


def estimate_config(path: str | Path, overrides: list[str], devices: Devices, records: list[Record],
                    mfu: float | None = None) -> Estimate:
    """The estimate of the module docstring for config `path` with `overrides` on `devices`."""
    from pretrieve.config import load_config

    exp = experiment_for_estimate(load_config(path, overrides), devices.world)
    head = meta_head(exp)
    batch, samples, count, batch_from = first_micro_batch(exp)
    cost = micro_batch_cost(exp, batch, samples, devices.world, count, head)
    rate = device_rate(devices.kind, exp.train.precision, exp.method.name, cost.flops / cost.tokens,
                       speed_settings(exp, setting_keys(records)), records, mfu)
    t = exp.train
    micro_batches = t.max_steps * t.grad_accum * devices.world
    seconds = (cost.flops + cost.recompute) * micro_batches / (rate.flops_per_s * devices.world)
    capacity = device(devices.kind).memory
    zero_states = {stage: estimate(replace(exp, train=replace(t, zero_stage=stage)), devices.world, batch, samples,
                                   head=head)["states"] for stage in range(t.zero_stage + 1, 4)}
    fixes = fit_fixes(cost.memory, t.micro_batch_size, t.grad_accum, USABLE_SHARE * capacity, CONFIG_WORDING,
                      zero_states)
    checkpoint = sum(checkpoint_bytes(head, t).values())
    hours = seconds / 3600
    return Estimate(
        config=str(path), devices=str(devices), world=devices.world, method=exp.method.name,
        precision=t.precision, batch_from=batch_from, steps=t.max_steps,
        sequences_per_step=t.micro_batch_size * t.grad_accum * devices.world, tokens=float(cost.tokens * micro_batches),
        flops=cost.flops * micro_batches, recomputed=cost.recompute * micro_batches, flops_per_s=rate.flops_per_s,
        mfu=rate.mfu, rate_basis=rate.basis, extrapolation=rate.extrapolation, hours=hours,
        hours_range=None if rate.spread is None else (hours * rate.flops_per_s / rate.spread[1],
                                                      hours * rate.flops_per_s / rate.spread[0]),
        gpu_hours=hours * devices.world,
        memory_gb=needed(cost.memory, t.micro_batch_size, t.activation_checkpointing) / GB,
        usable_gb=USABLE_SHARE * capacity / GB, fits=fixes is None, fixes=fixes or [], checkpoint_gb=checkpoint / GB,
        checkpoints_kept=exp.checkpoint.keep, parameters=sum(p.numel() for p in head.parameters()))


def experiment_for_estimate(config, world: int):
    """The experiment `config` describes on `world` ranks, every section checked as `pretrain` checks it when its
    shards are there; before they are, all but the data (the model, method, train and checkpoint sections)."""
    from pretrieve.config import run_sections, section
    from pretrieve.models.speed_switches import check_train
    from pretrieve.pretrain_config import DataOptions, Experiment, experiment, method_options, model_options

    data = section(config, "data", DataOptions)
    if data_present(data):
        return experiment(config, world)
    train, checkpoint, tracking = run_sections(config, world, check_train)
    method, options = method_options(config)
    return Experiment(seed=int(config.get("seed", 42)), run_dir=Path(str(config.get("run_dir") or ".")), resume=None,
                      train=train, checkpoint=checkpoint, tracking=tracking, raw=config, model=model_options(config),
                      method=method, options=options, data=data)


def data_present(data) -> bool:
    """Every manifest of data.manifests is a local file here (one at a URL is not read to estimate)."""
    from pretrieve.data.remote import is_remote, local_path

    return bool(data.manifests) and all(not is_remote(m) and Path(local_path(m)).is_file() for m in data.manifests)


def first_micro_batch(exp) -> tuple[dict, int, object, str]:
    """(the collated micro-batch, its samples, the collator's count, where it came from): the first of the
    config's data, or full blocks of method.max_len tokens while the shards are not there."""
    import numpy as np

    from pretrieve.data.masking import Vocabulary

    b = exp.train.micro_batch_size
    vocab = Vocabulary.of_tokenizer(exp.data.tokenizer_dir())
    collate = exp.method.collator.from_options(exp.options, vocab, seed=0)
    if data_present(exp.data):
        from itertools import islice

        from pretrieve.data.remote import ReadOptions
        from pretrieve.data.stream import ShardStream

        stream = ShardStream(exp.data.manifests, seed=0, shuffle_buffer=1, rank=0, world_size=1,
                             read=ReadOptions.from_options(exp.data))
        samples = list(islice(iter(stream), b))
        where = f"the first micro-batch of data.manifests ({len(samples)} samples)"
    elif getattr(collate, "data_kind", "text") != "text":
        raise ValueError(f"data.manifests: method {exp.method.name} trains on {collate.data_kind}: the estimate "
                         f"reads its first micro-batch; prepare them first (`pretrieve prepare --pairs`)")
    else:
        length = exp.options.max_len - 2  # [CLS] and [SEP] are the collator's
        words = np.flatnonzero(~vocab.special)
        rng = np.random.default_rng(exp.seed)
        dtype = np.uint16 if vocab.size < 1 << 16 else np.int32
        samples = [{"ids": rng.choice(words, length).astype(dtype), "doc": str(i), "block": 0, "source": "estimate"}
                   for i in range(b)]
        where = (f"{b} blocks of {exp.options.max_len} tokens drawn from the tokenizer's vocabulary (data.manifests "
                 "not prepared here; packing fills every block of a document but its last)")
    return collate(samples), len(samples), getattr(collate, "count", None), where


def report(e: Estimate) -> str:
    """The estimate as lines a person reads."""
    def duration(hours: float) -> str:
        return f"{hours:,.1f} h" + (f" ({hours / 24:.1f} days)" if hours >= 48 else "")

    spread = ""
    if e.hours_range:
        spread = f"; {duration(e.hours_range[0])} to {duration(e.hours_range[1])} over the repeated measurements"
    extrapolated = ("" if e.extrapolation is None else
                    f"\n  extrapolated  {e.extrapolation:.3g}x the record's training FLOPs a token")
    recomputed = (f" (+{e.recomputed:.3g} recomputed by activation checkpointing)" if e.recomputed else "")
    memory = (f"{e.memory_gb:.1f} GB per device of {e.usable_gb:.1f} usable: "
              + ("fits" if e.fits else "does not fit; " + "; or ".join(e.fixes)))
    lines = [
        (f"{e.config} on {e.devices} ({e.world} ranks): {e.method}, {e.parameters / 1e6:,.1f} M parameters "
         f"(the head's, embeddings and decoders included), {e.precision}"),
        f"  schedule      {e.steps:,} steps x {e.sequences_per_step:,} sequences",
        f"  micro-batch   {e.batch_from}",
        f"  tokens        {e.tokens:.4g}",
        f"  FLOPs         {e.flops:.4g}{recomputed}",
        (f"  rate          {e.flops_per_s / 1e12:.4g} TFLOP/s per device ({e.mfu:.2%} MFU), "
         f"{tokens_per_second(e):,.0f} tokens/s per device"),
        f"  priced from   {e.rate_basis}{extrapolated}",
        f"  wall time     {duration(e.hours)}{spread} (data-parallel ranks taken to add up linearly)",
        f"  GPU-hours     {e.gpu_hours:,.1f}",
        f"  memory        {memory}",
        (f"  checkpoint    {e.checkpoint_gb:.2f} GB, {e.checkpoints_kept} kept: "
         f"{e.checkpoint_gb * e.checkpoints_kept:.2f} GB on disk"),
    ]
    return "\n".join(lines)


def tokens_per_second(e: Estimate) -> float:
    """One device's tokens a second under the estimate (activation checkpointing's recomputation included)."""
    return e.tokens / (e.hours * 3600 * e.world)
