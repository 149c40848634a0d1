"""A method study's inputs, made once in its work directory: the pre-training text split into train and held-out
parts and prepared, the collections each part of the study is evaluated on, and the labelled fine-tuning sets,
each checked against every collection it is evaluated on (study/data.py has how each is made)."""

from __future__ import annotations

from pathlib import Path

from pretrieve.study.context import StudyRun
from pretrieve.study.data import build_labelled, check_no_leak, prepare, split_pretrain


def text_split(run: StudyRun) -> dict:
    """The Wikipedia sample and the books split into train and held-out parts (study.data.split_pretrain)."""
    return split_pretrain(run.wikipedia(), run.books(), run.work / "data" / "raw")


def pretraining_text(run: StudyRun) -> dict:
    """The Wikipedia sample and the books, less a held-out split (the base's validation loss), prepared."""
    split = text_split(run)
    data = {name: prepare("wikipedia" if name.startswith("wiki") else "books", inputs, run.work / "data" / name,
                          run.plan["max_len"], skip_bad=name.startswith("books"),
                          workers=run.plan.get("data_workers", 0))
            for name, inputs in split.pop("parts").items()}
    return {"split": split, "prepared": data}


def general_collections(run: StudyRun) -> dict[str, Path]:
    """SciFact, CACM, Cranfield (the smoke run: the bundled SciFact sample) and every --beir folder."""
    general = run.plan["general"]
    out = {name: run.collection(name) for name in general["datasets"]}
    return out | {Path(folder).name: Path(folder) for folder in general["beir"]}  # checked by build_plan


def labelled_for(target: str, plan: dict) -> str:
    """The labelled set a domain target is fine-tuned with: + SciFact's training claims unless SciFact is the
    target (or not there: the smoke run)."""
    return "general" if target.startswith("scifact") or plan["smoke"] else "domain"


def labelled_sets(run: StudyRun) -> dict:
    """Both labelled sets, built once, each checked against every collection it is evaluated on."""
    plan, spec = run.plan, run.plan["labelled"]
    evaluated = {"general": general_collections(run), "domain": {}}
    for base in plan["domain"]["bases"].values():
        for target in base["targets"]:
            evaluated[labelled_for(target, plan)][target] = run.collection(target)
    sets = {}
    for name, train in (("general", []), ("domain", [run.collection("scifact")])):
        if name == "domain" and not evaluated["domain"]:
            continue
        sets[name] = build_labelled(run.work / "labelled" / f"{name}.jsonl", run.wikipedia(), train,
                                    spec["passage_words"], spec["seed"])
        check_no_leak(Path(sets[name]["path"]), evaluated[name])
        sets[name]["evaluated_on"] = sorted(evaluated[name])
    return sets
