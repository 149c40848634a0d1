"""The throughput records pretrieve's own benchmarks committed, as `pretrieve estimate` and `scale plan` read them.

A record is one `benchmarks/pretrain_throughput.py` run of the real engine on one GPU (docs/benchmarks.md,
"Measured on a GPU"): its method, size, length, micro-batch, precision, ZeRO stage and speed switches (a ladder
rung's `overrides`), and what it sustained over its timed steps: non-padding tokens a second and training FLOP/s
by engine/flops.py's count, whose share of the GPU's peak is its MFU. The GPU jobs' folders
(`benchmarks/results/gpu-check/<job>/`) hold each job's records as the job wrote them; the benchmarks' merged
files, `benchmarks/results/*_gpu.json`, hold all of them once, each naming its job, and are what is read here. A
peer's record (HF's Trainer, the official RetroMAE model re-stated) times another program and is left out, as is
a run whose GPU is not in engine/flops.py's peak table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent.parent / "benchmarks" / "results"
RECORD_GLOB = "*_gpu.json"
# what a record must hold to be priced from
FIELDS = ("method", "size", "seq_len", "batch", "device", "precision", "tokens_per_s", "tflops_per_device", "mfu")


@dataclass(frozen=True)
class Record:
    method: str
    size: str  # the benchmark's --size: base is BERT-base
    seq_len: int
    batch: int  # the micro-batch
    device: str  # torch.cuda.get_device_name
    part: str  # engine/flops.py's GPU_PEAKS part: the device kind's peak
    precision: str
    tokens_per_s: float
    flops_per_s: float  # training FLOPs a second, engine/flops.py's count
    mfu: float
    settings: dict = field(default_factory=dict)  # config key -> value the run trained with
    rung: str | None = None  # the speed ladder's name for its switches
    date: str = ""
    where: str = ""  # the file and entry, and the GPU job that measured it

    @property
    def flops_per_token(self) -> float:
        return self.flops_per_s / self.tokens_per_s

    def describe(self) -> str:
        rung = f", rung {self.rung}" if self.rung else ""
        return (f"{self.method} {self.size}, L {self.seq_len}, micro-batch {self.batch}, {self.precision}{rung} on "
                f"{self.device}: {self.tokens_per_s:,.0f} tokens/s, {self.flops_per_s / 1e12:.1f} TFLOP/s, "
                f"{self.mfu:.1%} MFU ({self.where}{', ' + self.date[:10] if self.date else ''})")


def default_files() -> list[Path]:
    """The repository's merged GPU result files (none where pretrieve runs from an installed package)."""
    return sorted(RESULTS.glob(RECORD_GLOB))


def load(paths: list[Path | str]) -> list[Record]:
    """Every record of the files `paths` (each a JSON list of benchmark entries); a file that cannot be read is
    an error naming it."""
    from pretrieve.engine.flops import gpu_peak

    records = []
    for path in map(Path, paths):
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--records {path}: not a readable JSON file of benchmark records ({e})") from e
        if not isinstance(entries, list):
            continue  # another benchmark's result (a dict of lengths, a table): no throughput records
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or entry.get("peer") or any(entry.get(k) is None for k in FIELDS):
                continue
            known = gpu_peak(entry["device"], entry["precision"])
            if known is None or known[1] is None or not entry["tokens_per_s"] > 0 or not entry["tflops_per_device"] > 0:
                continue
            job = entry.get("job") or entry.get("measured_by", "")
            records.append(Record(
                method=entry["method"], size=entry["size"], seq_len=entry["seq_len"], batch=entry["batch"],
                device=entry["device"], part=known[0], precision=entry["precision"],
                tokens_per_s=float(entry["tokens_per_s"]), flops_per_s=float(entry["tflops_per_device"]) * 1e12,
                mfu=float(entry["mfu"]), settings=settings_of(entry), rung=entry.get("rung"),
                date=entry.get("date", ""), where=f"{display(path)} [{i}]{', ' + job if job else ''}"))
    return records


def display(path: Path) -> str:
    """`path` from the repository's root when it is inside it."""
    root = RESULTS.parent.parent
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return str(path)


def settings_of(entry: dict) -> dict:
    """The config settings a record trained with: its micro-batch, precision and ZeRO stage, LoRA's rank and
    activation checkpointing where it says, and its rung's overrides (the speed switches), as the strings a config
    key would read."""
    settings = {"train.micro_batch_size": str(entry["batch"]), "train.precision": str(entry["precision"]),
                "train.zero_stage": str(entry.get("zero_stage", 0))}
    for key, name in (("model.lora.r", "lora"), ("train.activation_checkpointing", "activation_checkpointing")):
        if name in entry:
            settings[key] = str(entry[name]).lower()
    for override in entry.get("overrides") or []:
        key, _, value = override.partition("=")
        settings[key] = value.lower()
    return settings


def setting_keys(records: list[Record]) -> set[str]:
    """The config keys any of `records` names a setting of."""
    return {key for record in records for key in record.settings}


def matching(record: Record, settings: dict) -> int:
    """How many of `record`'s settings a config's `settings` (key -> value as a string) shares."""
    return sum(settings.get(key) == value for key, value in record.settings.items())


def nearest(records: list[Record], method: str, flops_per_token: float, settings: dict) -> list[Record]:
    """The records a config of `method` at `flops_per_token` training FLOPs a token is priced from, nearest first:
    the same method before another, then the nearest measured size (a method, size and length's records, by their
    mean FLOPs a token), then the most settings in common (micro-batch, precision, ZeRO stage, speed switches),
    then the latest. The first is the one the estimate rests on; those tied with it on all but the date are the
    same measurement repeated (its spread)."""
    sizes: dict[tuple, list[float]] = {}
    for record in records:
        sizes.setdefault(_size(record), []).append(record.flops_per_token)

    def key(record: Record):
        measured = sum(sizes[_size(record)]) / len(sizes[_size(record)])
        return record.method != method, abs(math.log(flops_per_token / measured)), -matching(record, settings)
    ranked = sorted(records, key=lambda r: (key(r), _newest_first(r.date)))
    return [r for r in ranked if key(r) == key(ranked[0])] if ranked else []


def _size(record: Record) -> tuple:
    return record.method, record.size, record.seq_len


def _newest_first(date: str) -> tuple:
    return tuple(-ord(c) for c in date)
