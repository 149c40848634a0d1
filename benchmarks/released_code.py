"""What the comparisons with a method's released code share (condenser_reference.py, simlm_reference.py): their
command line (`main`), and the released side, the same script run by the released code's own venv on the weights
and batch the pretrieve side wrote to a work folder. Standard library only: the released venv has no pretrieve."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"


def arguments(doc: str, released: str, result: str) -> argparse.Namespace:
    """--released (`released`: what it names), --python (required unless this is the released side), --out
    (default results/`result`) and the hidden --released-side WORK."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--released", required=True, help=released)
    parser.add_argument("--python", help="the released code's venv Python")
    parser.add_argument("--out", default=str(RESULTS / result))
    parser.add_argument("--released-side", metavar="WORK", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.released_side and not args.python:
        parser.error("--python: the released code's venv Python is required")
    return args


def released_results(script: str, args: argparse.Namespace, work: str) -> dict:
    """The last JSON line `script --released-side work` prints when run by the released venv's Python; its
    error output, and an exit, when it fails."""
    # run in the work folder: what the released code writes beside itself (its logger's data/log.txt) stays there
    done = subprocess.run([args.python, str(Path(script).resolve()), "--released", str(Path(args.released).resolve()),
                           "--released-side", work], capture_output=True, text=True, cwd=work)
    if done.returncode:
        sys.exit(f"{Path(script).stem}: the released side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_comparison(out: str, setup: dict, key: str, ours: dict, theirs: dict, **extra) -> None:
    """Write {"setup", key: {name: {"pretrieve", "released", "loss_diff"}}, **extra} to `out` as JSON, each name
    one compared setting (a method, a generator setting), and print its loss and largest gradient differences."""
    compared = {name: {"pretrieve": ours[name], "released": theirs[name],
                       "loss_diff": abs(ours[name]["loss"] - theirs[name]["loss"])} for name in ours}
    Path(out).write_text(json.dumps({"setup": setup, key: compared, **extra}, indent=2) + "\n")
    print(json.dumps({name: {"loss_diff": r["loss_diff"], "max_grad_diff": r["released"]["max_grad_diff"]}
                      for name, r in compared.items()}))


def main(script: str, doc: str, released: str, result: str, released_side: Callable[[str, str], None],
         pretrieve_side: Callable[[Path], dict], key: str, setup: dict,
         more: Callable[[Path], dict] | None = None) -> int:
    """A comparison script's command: run by the released venv (--released-side WORK), `released_side(released,
    work)` prints its results; else `pretrieve_side(work)` ({name: results}, the weights and batches written to
    work), the released side's results on them, `more(work)` (further entries of the JSON) and the comparison
    written to --out."""
    args = arguments(doc, released, result)
    if args.released_side:
        released_side(args.released, args.released_side)
        return 0
    with tempfile.TemporaryDirectory() as work:
        ours = pretrieve_side(Path(work))
        theirs = released_results(script, args, work)
        extra = more(Path(work)) if more is not None else {}
    write_comparison(args.out, setup, key, ours, theirs, **extra)
    return 0
