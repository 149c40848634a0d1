"""The method studies' files (studies/<study>/<scale>.yaml) and `pretrieve study plan`: each file gives the
settings its study ran with. tests/data/study_plans.json holds what the studies' former scripts fixed at each
scale (the quality study's `--plan`, the recipe's budget and arms, the Matryoshka study's recorded settings,
with and without --smoke); the committed results record the settings of the runs they hold. A bad file, or a
flag a study does not take, is refused naming the key."""

import json
from pathlib import Path

import pytest
import yaml

from pretrieve.cli import main as cli
from pretrieve.study.study_file import StudyFileError, load_study

ROOT = Path(__file__).resolve().parent.parent
OLD = json.loads((ROOT / "tests" / "data" / "study_plans.json").read_text())
FILES = {"quality/cpu": "quality/cpu.yaml", "quality/gpu": "quality/gpu.yaml",
         "quality/gpu-short": "quality/gpu-short.yaml", "recipe/cpu": "recipe/cpu.yaml",
         "recipe/gpu-short": "recipe/gpu-short.yaml", "matryoshka/cpu": "matryoshka/cpu.yaml"}


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # a study file's paths are the working directory's


def _plan(name: str, capsys, *flags: str) -> dict:
    assert cli(["study", "plan", f"studies/{FILES[name]}", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", list(FILES))
@pytest.mark.parametrize("smoke", [False, True], ids=["", "smoke"])
def test_each_file_plans_what_its_script_fixed(name, smoke, capsys):
    plan = _plan(name, capsys, *(["--smoke"] if smoke else []))
    kind, scale = name.split("/")
    if kind == "quality":
        assert plan == OLD[name + ("/smoke" if smoke else "")]
        return
    assert plan["quality"] == OLD[f"quality/{scale}" + ("/smoke" if smoke else "")]
    if kind == "recipe":
        assert {"budget": plan["budget"], "arms": plan["arms"]} == OLD["recipe/smoke" if smoke else name]
    else:
        assert plan["matryoshka"] == OLD[name + ("/smoke" if smoke else "")]


def test_the_committed_results_were_made_with_the_files_settings(capsys):
    """What each committed result file recorded of its settings is what its study file plans (the quality study's
    pooling names the arms of its time: the arms added since take their papers' pooling too)."""
    results = ROOT / "studies"
    quality = json.loads((results / "quality" / "results" / "quality.json").read_text())["settings"]["settings"]
    plan = _plan("quality/cpu", capsys)
    assert {k: v for k, v in plan.items() if k != "pooling"} == {k: v for k, v in quality.items() if k != "pooling"}
    assert {arm: plan["pooling"][arm] for arm in quality["pooling"]} == quality["pooling"]

    recipe = json.loads((results / "recipe" / "results" / "recipe.json").read_text())
    planned = _plan("recipe/cpu", capsys)
    budget = planned["budget"]
    assert recipe["settings"] == {"model": plan["model"], "max_len": plan["max_len"], "base": plan["base"],
                                  "contrastive": {k: v for k, v in budget.items() if k != "runs"},
                                  "runs": budget["runs"]}
    assert recipe["arms_settings"] == {**planned["arms"], "finetune": {
        **plan["finetune"], "temperature": budget["temperature"], "normalize": True}}

    matryoshka = json.loads((results / "matryoshka" / "results" / "matryoshka.json").read_text())
    assert _plan("matryoshka/cpu", capsys)["matryoshka"] == matryoshka["settings"]
    assert matryoshka["anchor"] == load_study("studies/matryoshka/cpu.yaml").keys["anchor"]


def _write(tmp_path: Path, name: str, change) -> Path:
    keys = yaml.safe_load((ROOT / "studies" / FILES[name]).read_text())
    change(keys)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(keys))
    return path


@pytest.mark.parametrize("name,change,message", [
    ("quality/cpu", lambda k: k.update(stduy="quality"), r"stduy: unknown for a quality study"),
    ("quality/cpu", lambda k: k.update(study="quantity"), r"study: 'quantity' is not one of quality, recipe"),
    ("quality/cpu", lambda k: k["settings"].pop("curve"), r"settings\.curve: missing"),
    ("quality/cpu", lambda k: k["settings"]["base"].update(stesp=3), r"settings\.base\.stesp: unknown"),
    ("quality/cpu", lambda k: k["configs"].pop("finetune"), r"configs\.finetune: missing"),
    ("recipe/cpu", lambda k: k["budget"].update(points=[300, 1600]), r"budget\.points: \[300, 1600\]: steps in"),
    ("recipe/cpu", lambda k: k["budget"]["runs"]["cls"].update(pooling="dupmae"),
     r"budget\.runs\.cls\.pooling: 'dupmae' is not one of cls, mean"),
    ("recipe/cpu", lambda k: k["arms"]["arms"].update(bow=1),
     r"arms\.arms\.bow: 1 seeds, and its quality study studies/quality/cpu.yaml runs 0"),
    ("recipe/cpu", lambda k: k.update(quality="studies/quality/gpu.yaml"),
     r"scale: 'cpu', and its quality study studies/quality/gpu.yaml is at 'gpu'"),
    ("recipe/cpu", lambda k: k.update(quality="studies/recipe/gpu-short.yaml"),
     r"quality: studies/recipe/gpu-short.yaml is a recipe study, not a quality study"),
    ("matryoshka/cpu", lambda k: k.update(recipe="studies/none.yaml"), r"recipe: studies/none.yaml: no such study"),
])
def test_a_bad_file_is_refused_naming_the_key(tmp_path, name, change, message):
    path = _write(tmp_path, name, change)
    with pytest.raises(StudyFileError, match=f"^{path}: .*{message}"):
        load_study(path)


def test_a_flag_the_study_does_not_take_is_refused(capsys):
    for args, message in ((["study", "plan", "studies/recipe/cpu.yaml", "--set", "pretrain.steps=4"],
                           "--set: the recipe study studies/recipe/cpu.yaml takes no --set"),
                          (["study", "run", "studies/matryoshka/cpu.yaml", "--seeds", "1"],
                           "--seeds: the matryoshka study studies/matryoshka/cpu.yaml takes no --seeds"),
                          (["study", "run", "studies/quality/cpu.yaml", "--part", "arms"],
                           "--part arms: the quality study's parts are general, domain, all"),
                          (["study", "run", "studies/quality/cpu.yaml", "--seeds", "a-b"],
                           "--seeds 'a-b': expected seeds like 0, 1-2 or 0,2"),
                          (["study", "run", "studies/quality/cpu.yaml", "--data", "/nonexistent"],
                           "--data /nonexistent: no pretrain or beir folder there (the shared data: pretrain/, beir/)")):
        assert cli(args) == 2
        assert capsys.readouterr().err == f"pretrieve study: error: {message}\n"


def test_the_report_reads_each_committed_results_file(capsys):
    """`pretrieve study report`: the tables of each study's committed results, as its README quotes them."""
    for name, rows in (("quality/cpu", ["| none | 3 | – | 0.0163 [0.0081, 0.0262] |", "### Domain adaptation from minilm"]),
                       ("recipe/cpu", ["| cls-slow: cls, lr 0.0003, warm-up 0.25 | scifact | 0.003 | 0.006 |",
                                       "| mean | none | 0.204 | 0.080 | 0.127 | 0.137 | 0.219 | 0.096 | 0.139 | 0.151 |"]),
                       ("matryoshka/cpu", ["| **plain, mean** | **0.1444** (100%) | **0.0900** (62%) |"])):
        assert cli(["study", "report", f"studies/{FILES[name]}"]) == 0
        printed = capsys.readouterr().out
        assert all(row in printed for row in rows), printed
