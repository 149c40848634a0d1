"""`pretrieve scale fit`, `scale plan` and `scale run`: scaling studies. Each action's flags are in `add_scale`, its
work in its `run_` function."""

from __future__ import annotations

import json
import sys

from pretrieve.commands.arguments import command, slurm_jobs_option


def add_scale(commands) -> None:
    from pretrieve.scale.memory import DEVICES

    p = commands.add_parser("scale", help="scaling studies: plan a study's grid, fit scaling laws to its points")
    actions = p.add_subparsers(dest="scale_command", metavar="ACTION", required=True)
    fit = command(actions, "fit", run_scale_fit)
    source = fit.add_mutually_exclusive_group(required=True)
    source.add_argument("study", nargs="?", default=None, metavar="STUDY.yaml")
    source.add_argument("--csv", default=None, metavar="POINTS.csv")
    fit.add_argument("--out", required=True, metavar="DIR")
    fit.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    fit.add_argument("--holdout", choices=("largest",), default=None,
                     help="largest: also fit without the largest compute budget and report the error on it")
    fit.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples")
    plan = command(actions, "plan", run_scale_plan)
    plan.add_argument("study", metavar="STUDY.yaml")
    plan.add_argument("--device", choices=sorted(DEVICES), default=None,
                      help="the device each rank trains on: its peak FLOP/s at the points' precision x --mfu gives "
                           "the device-hours, and a point whose micro-batch will not fit its memory is warned "
                           "about (default: this machine's CPU, measured, no memory check)")
    plan.add_argument("--mfu", type=float, default=None,
                      help="model FLOPs utilisation a run sustains, the share of the peak (default: a --device with "
                           "throughput records is priced from them, as `pretrieve estimate` prices it; else 0.25; "
                           "`pretrain` logs the real one)")
    plan.add_argument("--flops-per-second", type=float, default=None,
                      help="sustained FLOP/s of one device for the estimate, instead of the device's peak x --mfu")
    run = command(actions, "run", run_scale_run)
    run.add_argument("study", metavar="STUDY.yaml")
    slurm_jobs_option(run, "the pending jobs (pre-training, then evaluation)")


def run_scale_fit(args) -> int:
    """fit Chinchilla / joint / single-variable laws, IsoFLOP allocation, metric

    Fit the study's points (its MLflow child runs, or a CSV with N, D, loss [, C, method, metric]) per method and
    write OUT/fit.json, fit.md, points.csv and plots (see pretrieve/scale/report.py).
    """
    from pretrieve.scale.report import run_fit

    print(json.dumps(run_fit(args.out, study=args.study, points_csv=args.csv, bootstrap=args.bootstrap,
                             holdout=args.holdout, seed=args.seed)))
    return 0


def run_scale_plan(args) -> int:
    """the study's grid: N, D, FLOPs and device-hours per point; writes plan.json

    Check STUDY.yaml, print its grid (pretrieve/scale/plan.py documents the keys) and write the run list to
    <run.out>/plan.json.
    """
    from functools import cache

    from pretrieve.scale.memory import device, device_flops, fit_advice
    from pretrieve.scale.plan import plan, record_rates, table, write_plan
    from pretrieve.scale.records import default_files, load

    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    study, points = plan(args.study)
    name = args.device or "cpu"
    records = [r for r in load(default_files()) if r.part == device(name).part] if args.mfu is None else []
    if args.flops_per_second:
        print(table(points, lambda p: args.flops_per_second, f"{args.flops_per_second:.3g} FLOP/s"))
    elif records:  # docs/scaling.md: a device with throughput records
        rates, label = record_rates(study, points, name, records)
        print(table(points, lambda p: rates[p.id].flops_per_s, label))
    else:
        mfu = 0.25 if args.mfu is None else args.mfu
        peak = cache(device_flops)  # the CPU's is measured: once
        peaks = sorted({f"{peak(name, p.precision):.3g} FLOP/s at {p.precision}" for p in points})
        print(table(points, lambda p: mfu * peak(name, p.precision), f"{mfu:.0%} MFU of {name} ({', '.join(peaks)})"))
    if args.device:
        for point in points:
            advice = fit_advice(point, args.device, device(args.device).memory)
            if advice:
                print(f"pretrieve scale plan: warning: {advice}", file=sys.stderr)
    print(f"run list: {write_plan(study, points)}")
    return 0


def run_scale_run(args) -> int:
    """pre-train every point of the study, then evaluate them (MLflow child runs)

    Pre-train the pending points of STUDY.yaml (resume=auto), then evaluate the finished ones through `pretrieve
    farm`; see pretrieve/orchestrate/scale_run.py.
    """
    from pretrieve.orchestrate.scale_run import run_study

    result = run_study(args.study, slurm_jobs=args.slurm)
    print(json.dumps(result))
    return 1 if result.get("failed") else 0
