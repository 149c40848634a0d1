"""The three method studies behind `pretrieve study plan|run|report STUDY.yaml`, each from its file
(study_file.py) and the command's flags: the settings a run would fix, the run (quality.py, recipe.py,
matryoshka.py), the tables of its results (report.py).

A run's work directory is `--out`, else the file's `out` (with `-smoke` added for `--smoke`, whose results go to
`<study>.json` in the work directory unless `--results` says otherwise). The shared data (`--data`: `pretrain/`,
`beir/`) must be there before any work; a smoke run reads the bundled samples instead. What is refused before any
work (a flag the study does not take, a bad `--seeds` or `--set`, settings other than those the work directory
was started with, the recipe's arms before their budget is chosen) raises Refused: the command exits 2, as for a
bad argument. A stop (SIGTERM) unwinds like Ctrl-C: the stages' times are recorded, the running pre-training runs
save a checkpoint; the same command resumes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from pretrieve.study.context import DATA, StudyRun, check_data
from pretrieve.study.plan import build_plan
from pretrieve.study.study_file import MethodStudy, load_study

PARTS = {"quality": ("general", "domain", "all"), "recipe": ("budget", "arms", "all"), "matryoshka": ()}
DEFAULT_PART = {"quality": "all", "recipe": "budget"}


class Refused(ValueError):
    """Refused before any work: a flag or setting the run cannot take."""


@dataclass
class Flags:
    smoke: bool = False
    part: str | None = None
    seeds: str | None = None
    out: str | None = None
    results: str | None = None
    data: str | None = None
    sets: list[str] = field(default_factory=list)
    beir: list[str] = field(default_factory=list)


def parse_seeds(text: str | None) -> set[int] | None:
    """`--seeds`: "1-2", "0,2" or "1"; None for all."""
    if text is None:
        return None
    seeds = set()
    for part in text.split(","):
        low, sep, high = part.partition("-")
        if not (low.isdigit() and (not sep or high.isdigit())):
            raise ValueError(f"--seeds {text!r}: expected seeds like 0, 1-2 or 0,2")
        seeds.update(range(int(low), int(high if sep else low) + 1))
    return seeds


def check_flags(study: MethodStudy, flags: Flags) -> None:
    """The flags this kind of study takes: --set and --beir change the quality study's settings (a recipe or
    Matryoshka study takes its quality study's as they are), --part names one of the study's parts, --seeds the
    seeds of a study that runs several."""
    taken = {"--set": flags.sets, "--beir": flags.beir} if study.kind != "quality" else {}
    if study.kind == "matryoshka":
        taken |= {"--part": flags.part, "--seeds": flags.seeds}
    for flag, value in taken.items():
        if value:
            raise Refused(f"{flag}: the {study.kind} study {study.path} takes no {flag}")
    if flags.part is not None and flags.part not in PARTS[study.kind]:
        raise Refused(f"--part {flags.part}: the {study.kind} study's parts are {', '.join(PARTS[study.kind])}")


def study_run(study: MethodStudy, flags: Flags) -> StudyRun:
    """The run `flags` ask for: its settings (the quality study's at the study's scale, shrunk for --smoke, with
    --beir and --set), its work directory, results file and data."""
    try:
        plan = build_plan(study.settings, study.scale, flags.smoke, flags.beir, flags.sets)
    except ValueError as e:
        raise Refused(str(e)) from None
    work = Path(flags.out or f"{study.out}{'-smoke' if flags.smoke else ''}")
    results = Path(flags.results) if flags.results else work / f"{study.kind}.json" if flags.smoke else study.results
    return StudyRun(study, plan, work, results, Path(flags.data).resolve() if flags.data else DATA.resolve(),
                    flags.smoke)


def plan_of(path: str | Path, flags: Flags) -> dict:
    """The settings a run of the study file would fix: the quality study's plan (study/plan.py), and a recipe's
    budget and arms, a Matryoshka study's contrastive settings."""
    from pretrieve.study.matryoshka import matryoshka_settings
    from pretrieve.study.recipe import recipe_plan

    study = load_study(path)
    check_flags(study, flags)
    run = study_run(study, flags)
    if study.kind == "quality":
        return run.plan
    if study.kind == "recipe":
        return {"quality": run.plan, **recipe_plan(run)}
    return {"quality": run.plan, "matryoshka": matryoshka_settings(run)}


def run_study(path: str | Path, flags: Flags) -> dict:
    """Run the study file's study as `flags` ask; {study, scale, work, results}."""
    from pretrieve.study import matryoshka, quality, recipe

    study = load_study(path)
    check_flags(study, flags)
    run = study_run(study, flags)
    part = flags.part or DEFAULT_PART.get(study.kind)
    try:
        seeds = parse_seeds(flags.seeds)
        if study.kind == "recipe":
            recipe.check_part(run, part)
        if not flags.smoke:
            check_data(run.data)
        fixed = quality.fixed_settings(run) if study.kind == "quality" else None
    except ValueError as e:
        raise Refused(str(e)) from None
    _prepare_process()
    if study.kind == "quality":
        quality.run_quality(run, fixed, part, seeds)
    elif study.kind == "recipe":
        recipe.run_recipe(run, part, seeds)
    else:
        matryoshka.run_matryoshka(run)
    return {"study": study.kind, "scale": study.scale, "work": str(run.work), "results": str(run.results)}


def _prepare_process() -> None:
    """A stop (SIGTERM, as `kill` or a scheduler sends it) unwinds like Ctrl-C; DeepSpeed on the CPU where there is
    no GPU (here, where a smoke run trains, and in every child)."""
    import torch

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def report_of(path: str | Path, flags: Flags) -> str:
    """The markdown tables of the study's results file (`--results`, else the file's, or the smoke run's)."""
    from pretrieve.study.report import report

    study = load_study(path)
    results = study_run(study, flags).results
    if not results.is_file():
        raise ValueError(f"{results}: no results yet (run the study first)")
    return report(study.kind, json.loads(results.read_text()))
