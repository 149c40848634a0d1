"""`pretrieve study plan`, `study run` and `study report`: method studies, what a pre-training method buys after
the same fine-tuning (studies/<study>/<scale>.yaml). Each action's flags are in `add_study`, its work in its
`run_` function."""

from __future__ import annotations

import json
import sys

from pretrieve.commands.arguments import command


def add_study(commands) -> None:
    p = commands.add_parser("study", help="method studies: what pre-training buys after the same fine-tuning")
    actions = p.add_subparsers(dest="study_command", metavar="ACTION", required=True)
    plan = command(actions, "plan", run_study_plan)
    _settings_flags(plan)
    run = command(actions, "run", run_study_run)
    _settings_flags(run)
    run.add_argument("--part", default=None,
                     help="the part to run: quality general, domain or all (default all); recipe budget, arms or "
                          "all (default budget)")
    run.add_argument("--seeds", default=None, metavar="A-B|A,B",
                     help="only these seeds (quality: of the general part; recipe: of the arms); merged with the "
                          "seeds a results file already holds (default: all)")
    run.add_argument("--out", default=None, metavar="DIR", help="the work directory (default: the file's out)")
    run.add_argument("--results", default=None, metavar="FILE",
                     help="the results file (default: the file's results; --smoke: <study>.json in the work directory)")
    run.add_argument("--data", default=None, metavar="DIR",
                     help="the shared data: pretrain/ (Wikipedia sample, books) and beir/ (default ../shared/data)")
    report = command(actions, "report", run_study_report)
    report.add_argument("study", metavar="STUDY.yaml")
    report.add_argument("--smoke", action="store_true", help="the smoke run's results")
    report.add_argument("--out", default=None, metavar="DIR", help="the smoke run's work directory")
    report.add_argument("--results", default=None, metavar="FILE", help="the results file (default: the file's)")


def _settings_flags(p) -> None:
    p.add_argument("study", metavar="STUDY.yaml")
    p.add_argument("--smoke", action="store_true", help="the bundled samples, a hidden-64 encoder, a few steps, one seed")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="quality: change a setting (pretrieve/study/plan.py), e.g. general.arms='{\"none\": 1}'")
    p.add_argument("--beir", nargs="+", default=[], metavar="DIR",
                   help="quality: more BEIR folders to evaluate the general part on (test split)")


def _flags(args):
    from pretrieve.study.studies import Flags

    return Flags(**{name: getattr(args, name) for name in ("smoke", "part", "seeds", "out", "results", "data",
                                                             "sets", "beir") if hasattr(args, name)})


def run_study_plan(args) -> int:
    """the settings a run of the study would fix, as JSON

    Check STUDY.yaml (pretrieve/study/study_file.py documents the keys) and print the settings `study run` would
    fix: the quality study's plan at its scale, and a recipe's budget and arms or a Matryoshka study's settings.
    """
    from pretrieve.study.studies import Refused, plan_of

    try:
        print(json.dumps(plan_of(args.study, _flags(args)), indent=1))
    except Refused as e:
        return _refused(e)
    return 0


def run_study_run(args) -> int:
    """run a method study: pre-training, the same fine-tuning, evaluation, statistics

    Run STUDY.yaml's study (resumable: the same command continues it) and write its results file; see
    pretrieve/study/studies.py. Prints {study, scale, work, results}.
    """
    from pretrieve.study.studies import Refused, run_study

    try:
        print(json.dumps(run_study(args.study, _flags(args))))
    except Refused as e:
        return _refused(e)
    return 0


def run_study_report(args) -> int:
    """the markdown tables of a study's results

    Print the tables of STUDY.yaml's results file (or --results) as the study's README shows them.
    """
    from pretrieve.study.studies import report_of

    print(report_of(args.study, _flags(args)))
    return 0


def _refused(error: Exception) -> int:
    """Refused before any work: said in one line, exit 2 as for a bad argument."""
    print(f"pretrieve study: error: {error}", file=sys.stderr)
    return 2
