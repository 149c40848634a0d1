"""The speed ladder: every speed switch of the pre-training step turned on one after another, each rung in its own
process, beside the peers a user would compare with (`pretrain_throughput.py --ladder`, docs/benchmarks.md).

A rung is `pretrain_throughput.py` with the config overrides of every rung up to it (LADDER), so its tokens/s,
TFLOP/s, MFU and peak memory say what the switches so far buy together, and the step from the rung before it what
the last one buys. ALTERNATIVES are measured once on top of the whole ladder: a choice that replaces a rung's
(Liger-Kernel's fused loss for the plain one) or changes what is computed (the fused decoder attention, which has
no attention dropout). The first method climbs every rung; the others take the baseline and the top, so that
their ratio to the first is measured at both ends, or the top alone (`--top-only`: a short job's cut). The peers: HF's Trainer with `BertForMaskedLM` (hf_trainer_mlm.py)
and the official RetroMAE model re-stated (`--baseline`), at the same size, length and batch.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from pretrieve.models.speed_switches import switches


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...] = ()
    batch: int | None = None  # the micro-batch from this rung on (None: the one before)
    methods: tuple[str, ...] = ()  # an alternative's methods (empty: every method)


BATCHES = (Rung("batch-64", batch=64), Rung("batch-128", batch=128))  # the batch that fills the device, last


def ladder() -> tuple[Rung, ...]:
    """The rungs, cumulative: the baseline (each switch's `baseline` value), then each switch's rung in the
    switches' one order (pretrieve/models/speed_switches.py says why that order), then BATCHES."""
    table = switches()
    baseline = Rung("baseline", tuple(f"{s.key}={s.baseline}" for s in table if s.baseline is not None))
    return (baseline, *(Rung(s.rung.name, s.rung.overrides) for s in table if s.rung is not None), *BATCHES)


def alternatives() -> tuple[Rung, ...]:
    """The switches' alternatives, each measured once on top of the whole ladder."""
    return tuple(Rung(alt.name, alt.overrides, methods=alt.methods) for s in switches() for alt in s.alternatives)


# the ladder of the switches registered at import, the built-in ones; plan() reads the table when it is called
LADDER, ALTERNATIVES = ladder(), alternatives()


@dataclass
class Plan:
    """What one ladder job runs: (method, rung name, overrides, batch) per pretrain_throughput.py process."""
    runs: list[tuple[str, str, list[str], int]] = field(default_factory=list)


def plan(methods: list[str], batch: int, full: bool = True, skip: tuple[str, ...] = (),
         top_only: tuple[str, ...] = ()) -> Plan:
    """The runs for `methods`: the first climbs every rung (`full`), the others take the baseline and the top;
    then the alternatives of each method, on top of the whole ladder. Rungs and alternatives named in `skip` are
    left out, and the methods named in `top_only` (not the first) take the top rung alone (a short job's cuts)."""
    rungs, alts = ladder(), alternatives()
    unknown = set(skip) - {r.name for r in (*rungs, *alts)} - {"baseline"}
    if unknown or "baseline" in skip:
        raise ValueError(f"--skip: {', '.join(sorted(unknown) or ['baseline'])}: not a rung one can skip (rungs: "
                         f"{', '.join(r.name for r in (*rungs[1:], *alts))})")
    out = Plan()
    settings: dict[str, str] = {}  # key -> value: a later rung's value of a key replaces an earlier one's
    steps = []
    for rung in (r for r in rungs if r.name not in skip):
        settings = {**settings, **_pairs(rung.overrides)}
        batch = rung.batch or batch
        steps.append((rung.name, [f"{k}={v}" for k, v in settings.items()], batch))
    if methods and methods[0] in top_only or set(top_only) - set(methods):
        raise ValueError(f"--top-only: {', '.join(top_only)}: each must be one of --methods after the first "
                         f"({', '.join(methods[1:]) or 'none'})")
    for i, method in enumerate(methods):
        if method in top_only:
            out.runs.append((method, *steps[-1]))
            continue
        climbed = steps if (i == 0 and full) else [steps[0], steps[-1]]
        out.runs += [(method, name, o, b) for name, o, b in climbed]
        out.runs += [(method, alt.name, [f"{k}={v}" for k, v in {**settings, **_pairs(alt.overrides)}.items()],
                      steps[-1][2])
                     for alt in alts if (not alt.methods or method in alt.methods) and alt.name not in skip]
    return out


def _pairs(overrides) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def run_ladder(args, base_argv: list[str]) -> int:
    """Each run of the plan in its own process (pretrain_throughput.py with `base_argv`, its size, length, steps
    and output), then the peers. A failing rung (an alternative the device cannot run, an out-of-memory batch) is
    recorded and the ladder goes on; returns 1 if any run failed."""
    failed = []
    for name, argv in ladder_commands(args, base_argv):
        print(f"ladder: {name}: {' '.join(argv[3:])}", flush=True)  # after python -m benchmarks.NAME
        if subprocess.run(argv).returncode != 0:
            failed.append(name)
    if failed:
        print(f"ladder: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def ladder_commands(args, base_argv: list[str]) -> list[tuple[str, list[str]]]:
    """(name, argv) of each process the ladder runs, in order. `args.set` (--set) goes to every run of the
    engine, before the rung's own settings."""
    runs = plan(args.methods, args.batch, not args.ends_only, args.skip, args.top_only).runs
    own = [a for o in args.set for a in ("--set", o)]
    peers = [("hf-trainer", [sys.executable, "-m", "benchmarks.hf_trainer_mlm", *_shared(base_argv), "--batch",
                             str(args.batch)])]
    if "retromae" in args.methods:  # the official RetroMAE model re-stated, timed beside the engine's baseline rung
        peers.append(("official-retromae", [sys.executable, "-m", "benchmarks.pretrain_throughput", *base_argv,
                                            "--method", "retromae", "--batch", str(args.batch), "--rung",
                                            "official-retromae", "--baseline-only"]))
    first = [r for r in runs if r[0] == args.methods[0]]
    commands = []
    # the first method's ladder, then the peers, then the other methods: a job cut short keeps the ratios to peers
    for item in [*first, *(peers if args.peers else []), *runs[len(first):]]:
        if isinstance(item[1], list):  # a peer: (name, argv)
            commands.append(item)
            continue
        method, rung, overrides, batch = item
        commands.append((f"{method}/{rung}", [sys.executable, "-m", "benchmarks.pretrain_throughput", *base_argv,
                                              "--method", method, "--batch", str(batch), "--rung", rung, *own,
                                              *[a for o in overrides for a in ("--set", o)]]))
    return commands


def _shared(argv: list[str]) -> list[str]:
    """The flags of `argv` that hf_trainer_mlm.py shares: size, length, steps, warm-up, output."""
    keep, out = {"--size", "--seq-len", "--steps", "--warmup", "--out"}, []
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in keep:
            out += [flag, value]
    return out
