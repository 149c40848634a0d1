"""`pretrieve estimate`: what a pre-training config costs before launch. Its flags are in `add_estimate`, its work
in `run_estimate` (pretrieve/scale/estimate.py)."""

from __future__ import annotations

import json
import sys

from pretrieve.commands.arguments import at_least, command, config_and_overrides


def add_estimate(commands) -> None:
    p = command(commands, "estimate", run_estimate)
    config_and_overrides(p)
    p.add_argument("--devices", required=True, metavar="COUNTxKIND",
                   help="the devices of a node, e.g. 8xH100 (kinds: those of `scale plan --device` but cpu)")
    p.add_argument("--nodes", type=at_least(1), default=1, help="nodes of --devices each (default 1)")
    p.add_argument("--mfu", type=float, default=None,
                   help="the model FLOPs utilisation to assume, instead of the throughput records'")
    p.add_argument("--records", nargs="+", default=None, metavar="FILE",
                   help="throughput records to price from (default: benchmarks/results/*_gpu.json of this checkout)")
    p.add_argument("--json", action="store_true", help="print the estimate as one JSON object")


def run_estimate(args) -> int:
    """wall time, GPU-hours, tokens, FLOPs, memory and checkpoint size of a config's schedule, before launch

    Estimate CONFIG (with KEY=VALUE overrides, as `pretrieve pretrain` takes them) on --devices x --nodes: the
    schedule's FLOPs and tokens from its first micro-batch, priced at the sustained rate of pretrieve's own
    throughput records (the nearest one of the device kind, scaled by FLOPs; a kind without records at the best
    MFU measured on another), its memory per device against the device's, with what would make it fit, and its
    checkpoints' size (pretrieve/scale/estimate.py; docs/estimate.md). A config whose micro-batch does not fit
    the devices exits 1, naming the settings that would make it fit.
    """
    from pretrieve.scale.estimate import estimate_config, parse_devices, report
    from pretrieve.scale.records import default_files, load

    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    devices = parse_devices(args.devices, args.nodes)
    records = load(args.records if args.records is not None else default_files())
    estimate = estimate_config(args.config, args.overrides, devices, records, args.mfu)
    print(json.dumps(estimate.as_dict()) if args.json else report(estimate))
    if not estimate.fits:  # the numbers above, and a refusal a script sees
        print(f"pretrieve estimate: error: {args.config} does not fit {devices}: {estimate.memory_gb:.1f} GB per "
              f"device of {estimate.usable_gb:.1f} usable; {'; or '.join(estimate.fixes)}", file=sys.stderr)
        return 1
    return 0
