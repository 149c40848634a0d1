"""What `auto` runs for the two-stream decoder attention: the faster of the fused kernel and SDPA, as measured.

The table (pretrieve/assets/decoder_attention.json) holds kernels/tune.py's forward + backward times per device
and length (B 32, H 12, D 64, bf16). On CUDA, auto takes the measurements of this device's name, else of its
compute capability, and of those the one at the length nearest this call's (on a log scale; a tie goes to the
longer); the faster of fused and sdpa there wins. A device without a measurement, a CPU, attention
dropout (the kernel has none) or no triton: sdpa, which is never slow. Eager is the reference, not a candidate.

Refresh after a GPU run: `python -m pretrieve.kernels.tune --update-table` measures and merges, or
`--update-table --from RESULT.json` merges a result measured elsewhere (`entries_from_benchmark`, `merged`).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch

TABLE = Path(__file__).resolve().parent.parent / "assets" / "decoder_attention.json"
CANDIDATES = ("fused", "sdpa")  # what auto chooses between
DEFAULT = "sdpa"


def load_table(path: Path = TABLE) -> list[dict]:
    return json.loads(Path(path).read_text(encoding="utf-8"))["measurements"]


@functools.lru_cache(maxsize=1)
def _committed() -> tuple[dict, ...]:
    return tuple(load_table())


def winner(device_name: str, capability: tuple[int, int] | None, length: int,
           measurements: list[dict] | tuple[dict, ...] | None = None) -> str:
    """fused or sdpa: the faster at the measurement nearest (device, length); DEFAULT when none matches."""
    measurements = _committed() if measurements is None else measurements
    same = [m for m in measurements if m["device"] == device_name]
    if not same and capability is not None:
        same = [m for m in measurements if tuple(m.get("capability") or ()) == tuple(capability)]
    timed = [m for m in same if all(c in m["ms"] for c in CANDIDATES)]
    if not timed:
        return DEFAULT
    nearest = min(timed, key=lambda m: (abs(math.log2(m["length"] / max(length, 1))), -m["length"]))
    return min(CANDIDATES, key=lambda c: nearest["ms"][c])


@functools.lru_cache(maxsize=None)
def _device(index: int) -> tuple[str, tuple[int, int]]:
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))


def cuda_device(device: torch.device) -> tuple[str, tuple[int, int]]:
    """(name, compute capability) of a CUDA device, read once per device."""
    return _device(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=256)  # called every step; lengths vary with the batch's padding
def _auto_cuda(device_name: str, capability: tuple[int, int], length: int) -> str:
    return winner(device_name, capability, length)


def auto(device: torch.device, length: int, dropout_p: float = 0.0, fused_available: bool = True) -> str:
    """The implementation `auto` runs for a call at this device and sequence length."""
    if device.type != "cuda" or dropout_p > 0 or not fused_available:
        return DEFAULT
    return _auto_cuda(*cuda_device(device), int(length))


def entries_from_benchmark(report: dict, source: str) -> list[dict]:
    """Table entries from a kernels/tune.py JSON (one per length it timed)."""
    setup = report["setup"]
    entries = []
    for length, row in sorted(report["lengths"].items(), key=lambda item: int(item[0])):
        entries.append({"device": setup["device"], "capability": setup.get("capability"), "length": int(length),
                        "ms": {impl: row[impl]["fwd_bwd_ms"] for impl in ("eager", "sdpa", "fused") if impl in row},
                        "torch": setup.get("torch"), "triton": setup.get("triton"), "source": source})
    return entries


def merged(measurements: list[dict], entries: list[dict]) -> list[dict]:
    """`measurements` with `entries` added, each replacing the one of its device and length (whose capability it
    keeps when it has none: results written before the benchmark recorded it)."""
    old = {(m["device"], m["length"]): m for m in measurements}
    entries = [{**e, "capability": e.get("capability") or old.get((e["device"], e["length"]), {}).get("capability")}
               for e in entries]
    fresh = {(e["device"], e["length"]) for e in entries}
    kept = [m for m in measurements if (m["device"], m["length"]) not in fresh]
    return sorted(kept + entries, key=lambda m: (m["device"], m["length"]))


def write_table(measurements: list[dict], path: Path = TABLE) -> None:
    table = json.loads(Path(path).read_text(encoding="utf-8"))
    table["measurements"] = measurements
    Path(path).write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    _committed.cache_clear()
    _auto_cuda.cache_clear()
