"""What the parity tests share. A parity test runs one of pretrieve's heads and its paper's released code on the
same weights and batch, and asserts that their losses and gradients agree (`make test-parity`, `pytest -m
parity`; `make test` leaves them out).

The released code and a venv of its own (it wants an older transformers than pretrieve's) come from two
environment variables a method: PRETRIEVE_RELEASED_<METHOD>, the checkout, and PRETRIEVE_RELEASED_<METHOD>_PYTHON,
the Python of that venv; while either is unset the test skips, naming it. The released side is a script of this
folder, <method>_released.py (the standard library, torch and transformers only: the released venv has no
pretrieve), run by that Python on the weights and batch the test wrote to a work folder, with the released code
importable. With PRETRIEVE_PARITY_RECORDS=DIR a test also writes what it measured to DIR/<record>.json; the
committed records, which docs/methods.md cites, are in tests/parity/records (PRETRIEVE_PARITY_RECORDS=
tests/parity/records refreshes them).
"""

from __future__ import annotations

import json
import os
import subprocess
from itertools import islice
from pathlib import Path

import pytest
import torch

from pretrieve.utils.run_dir import write_atomic

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# how far the two codes' fp32 results may differ: a few roundings, as each sums in its own order (measured: the
# losses 0-2 roundings apart, the largest gradient difference 1.8e-7)
LOSS_RTOL, GRADIENT_ATOL = 5e-7, 3e-7


def checkout(method: str, what: str) -> tuple[Path, str]:
    """(the checkout, its venv's Python) of `method`'s released code, `what` the checkout is; the test skips when
    either variable is unset, and fails when the checkout is no folder."""
    checkout_variable = f"PRETRIEVE_RELEASED_{method.upper()}"
    python_variable = f"{checkout_variable}_PYTHON"
    unset = [v for v in (checkout_variable, python_variable) if not os.environ.get(v)]
    if unset:
        pytest.skip(f"{' and '.join(unset)} unset: {checkout_variable} is {what}, {python_variable} the Python of a "
                    "venv of its own (the test's docstring says how to make both)")
    checkout = Path(os.environ[checkout_variable])
    if not checkout.is_dir():
        pytest.fail(f"{checkout_variable}={checkout}: no such folder; it must be {what}")
    return checkout, os.environ[python_variable]


def run_side(method: str, python: str, importable: Path, work: Path) -> dict:
    """The JSON line <method>_released.py prints, run by `python` on `work` with `importable` (the released code's
    folder) on its PYTHONPATH; the test fails with the released side's errors when it fails."""
    # in the work folder: what the released code writes beside itself (its logger's data/log.txt) stays there
    done = subprocess.run([python, str(HERE / f"{method}_released.py"), str(work)], capture_output=True, text=True,
                          cwd=work, env={**os.environ, "PYTHONPATH": str(importable)}, check=False)
    if done.returncode:
        pytest.fail(f"{method}_released.py: the released side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def wikipedia_blocks(work: Path, count: int) -> list[dict]:
    """The first `count` stream samples of the bundled Wikipedia sample prepared at 512 tokens (into work/shards,
    once), in order."""
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.stream import ShardStream

    shards = work / "shards"
    if not (shards / "manifest.json").is_file():
        prepare(PrepareOptions(source="wikipedia", inputs=[str(ROOT / "pretrieve/assets/samples/wikipedia")],
                               out=str(shards), workers=0, max_len=512, progress=False))
    return list(islice(iter(ShardStream([shards / "manifest.json"], seed=0, shuffle_buffer=1)), count))


def loss_and_gradients(head, batch: dict) -> dict[str, float]:
    """The head's outputs on `batch` (loss and parts), its gradients left on its parameters."""
    out = head(batch)
    out["loss"].backward()
    return {k: v.item() for k, v in out.items()}


def save_inputs(path: Path, head, names: dict[str, str], **more) -> None:
    """For the released side: the head's weights and gradients under the released code's `names` (pretrieve's
    name -> the released one), its encoder's config, and `more`."""
    torch.save({"state": {names[k]: v for k, v in head.state_dict().items() if k in names},
                "grads": {names[k]: p.grad for k, p in head.named_parameters() if k in names and p.grad is not None},
                "config": head.encoder.config.to_dict(), **more}, path)


def same_loss(result: dict, parts: tuple[str, ...] = ("loss",)) -> bool:
    """Whether a compared setting's `parts` (the loss, its terms) agree within LOSS_RTOL."""
    return all(abs(result["pretrieve"][p] - result["released"][p]) <= LOSS_RTOL * abs(result["released"][p])
               for p in parts)


def compared(ours: dict, theirs: dict) -> dict:
    """{setting: {"pretrieve", "released", "loss_diff"}} for each compared setting (a method, a generator setting)."""
    return {name: {"pretrieve": ours[name], "released": theirs[name],
                   "loss_diff": abs(ours[name]["loss"] - theirs[name]["loss"])} for name in ours}


def write_record(name: str, record: dict, indent: int = 2) -> None:
    """`record` to $PRETRIEVE_PARITY_RECORDS/<name>.json when that variable is set, written whole."""
    folder = os.environ.get("PRETRIEVE_PARITY_RECORDS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(folder) / f"{name}.json", json.dumps(record, indent=indent) + "\n")
