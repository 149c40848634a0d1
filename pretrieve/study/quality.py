"""The quality study (`pretrieve study run studies/quality/<scale>.yaml`): what retrieval-oriented pre-training
buys, measured as the papers measure it: initial weights -> the arm's pre-training for the same number of encoder
tokens -> the same fine-tuning -> `pretrieve eval` on held-out test collections, in a general part (general.py)
and a domain part (domain.py); per query the mean over seeds, then a paired bootstrap over queries against `none`
and `mlm` (stats.py). studies/quality/README.md has the protocol and the results.

Resumable: every stage skips work whose output exists; an interrupted pre-training or fine-tuning run continues
from its checkpoint. The settings are fixed at the first invocation (WORK/settings.json, and the results file
before any evaluation); another invocation on the same work directory with other settings is refused.

Seeds across jobs: `--seeds 1-2` runs only those seeds of the general part. Each job rebuilds the same base from
the same seed; the per-query scores of the seeds a results file already holds, from a run with the same settings,
are merged with the new ones, and `runs` records which job ran which seeds, where and when.
"""

from __future__ import annotations

import json
import os
import time

from pretrieve.study import results as results_file
from pretrieve.study.context import StudyRun
from pretrieve.study.domain import domain_study
from pretrieve.study.general import base_model, general_study
from pretrieve.study.inputs import labelled_sets, pretraining_text
from pretrieve.study.plan import fix_settings
from pretrieve.study.stage_times import stage_times, timed

PROTOCOL = "pretrain-finetune-eval"
PARTS = ("general", "domain", "all")


def fixed_settings(run: StudyRun) -> tuple[dict, dict]:
    """(the settings record of this run, the results file's earlier content): the settings fixed in
    WORK/settings.json (refused where they differ), or the ones the results file holds, fixed by an earlier job
    with the same settings (a job on another machine fixes them anew)."""
    fixed = fix_settings(run.work, run.plan)
    previous = json.loads(run.results.read_text()) if run.results.is_file() else {}
    if previous.get("protocol") == PROTOCOL and \
            (previous.get("settings") or {}).get("settings") == results_file.relative_paths(fixed["settings"]):
        return previous["settings"], previous
    return fixed, previous


def run_quality(run: StudyRun, fixed: tuple[dict, dict], part: str = "all", seeds: set[int] | None = None) -> dict:
    """Run the study's `part` (general, domain or all) for `seeds` of the general part (None: all), with the
    settings `fixed_settings` gave; its results."""
    import torch

    fixed, previous = fixed
    same = fixed is previous.get("settings")
    cuda = torch.cuda.is_available()
    job = {"seeds": "all" if seeds is None else sorted(seeds), "part": part,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": results_file.git_commit(),
           "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    results = {"protocol": PROTOCOL, "scale": run.study.scale, "smoke": run.smoke, "settings": fixed,
               "runs": (previous.get("runs", []) if same else []) + [job],
               "machine": f"{os.cpu_count()} cores" + (f", {torch.cuda.get_device_name(0)}" if cuda else ""),
               "general": previous.get("general") if same else None,
               "domain": previous.get("domain") if same else None}
    results_file.write_results(run.results, results)  # the settings, before any evaluation
    with timed(run.work, "data"):
        text = pretraining_text(run)
        labelled = labelled_sets(run)
    results["data"] = {"pretraining_text": text, "labelled": labelled}
    base, results["base"] = base_model(run, text)
    if part in ("general", "all"):
        part_run = general_study(run, text, base, labelled, seeds, results["general"])
        results["general"] = results_file.general_results(run.plan, part_run, run.results)
        results_file.write_results(run.results, results)
    if part in ("domain", "all") and run.plan["domain"]["bases"]:
        results["domain"] = results_file.domain_results(run.plan, domain_study(run, base, labelled), run.results)
    results["stage_times"] = stage_times(run.work)
    results_file.write_results(run.results, results)
    return results
