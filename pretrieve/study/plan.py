"""Settings of the quality study, and their fixing before any result. Each scale's settings are a study file's
`settings:` (studies/quality/<scale>.yaml, read by study/study_file.py; checked here, with the smoke run's
sizes and the `--set` overrides applied).

One protocol for every arm (studies/quality/README.md): initial weights -> the arm's pre-training
at an equal token budget -> the same fine-tuning -> `pretrieve eval` on held-out collections. An arm is `none`
(no pre-training beyond the base) or a pre-training method. The token budget is counted in encoder tokens:
every arm's continued pre-training takes the same steps of the same batch of `max_len`-token blocks; what a
method reads besides (CoT-MAE's neighbouring span goes to its decoder, COSTA's spans are positions of the same
block) costs FLOPs, which the results report per arm (engine/flops.py), not tokens.

Pooling (`pooling`), the same in fine-tuning and evaluation, is each method's paper's (the `eval_pooling` its
head file registers): [CLS] for RetroMAE, SEED-Encoder, COSTA and CoT-MAE (the representation their papers
fine-tune and evaluate); for DupMAE its joint
representation of eq. 12 ([CLS] through W^cls plus the top-384 entries of the max-pooled vocabulary vector): its
default, which §4.2 Table 4 shows beating either half (0.4102 MRR@10 against 0.3941 for "CLS:768", [CLS]
alone), and what its fine-tuning, eqs. 13-15, scores with; for LexMAE its SPLADE vector (`sparse`: what its
paper fine-tunes, with the FLOPS regulariser at its released stage-1 weights). `none` and `mlm` keep the base's own pooling
(`base`): [CLS] for the study's BERT (RetroMAE's BERT baseline), mean for MiniLM (what sentence-transformers
trained it with). Fine-tuning scores with the inner product (eq. 12 is one; no normalisation, temperature 1)
for every arm alike.

Settings are fixed before any test result exists: the first invocation writes them to WORK/settings.json (with
the time) and into the results file before any evaluation; a later invocation on the same WORK with other
settings is refused, naming the first differing key.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from pretrieve.models.heads.registry import study_arms

# The arms, their pooling and their overrides are the method registry's (each method's head file registers its
# `study_arm`, `eval_pooling` and `tiny_overrides`): a method joins the study by registering as an arm.
ARMS = ("none", *(method.name for method in study_arms()))
CPU_ARMS = ARMS[:7]  # the cpu study's, run and committed; the arms added since are for the gpu scales
REFERENCES = ("none", "mlm")  # the arms every other is compared with
# "base": the base model's own pooling (none, and a method that trains no representation of its own: mlm)
POOLING = {"none": "base", **{method.name: method.eval_pooling or "base" for method in study_arms()}}
# an arm's own overrides of its tiny config (coCondenser's: no GradCache, whose memory these models do not need)
ARM_OVERRIDES = {method.name: list(method.tiny_overrides) for method in study_arms() if method.tiny_overrides}
GENERAL_DATASETS = ("scifact", "cacm", "cranfield")

def merge(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in, recursively."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# The sections of a scale's settings, in the order a plan lists them: a tuple names a mapping's keys (its last
# "...": and any other), None a value. The study files under studies/quality/ give the reasons of each value.
RUN = ("steps", "batch", "lr", "warmup_ratio")
SETTINGS = {
    "model": ("hidden_size", "num_layers", "num_heads", "intermediate_size"),
    "max_len": None,
    "precision": None,
    "parallel": None,  # processes at once (pre-training runs, farm jobs)
    "threads": None,  # torch threads per process
    "base": RUN,  # the base encoder's MLM from scratch
    "pretrain": RUN,  # each arm's continued pre-training
    "finetune": ("steps", "batch", "lr", "negatives", "temperature", "query_max_len", "passage_max_len",
                 "warmup_ratio"),
    "eval": ("max_length", "batch_size"),
    "pooling": ("...",),  # an arm's pooling in fine-tuning and evaluation; left out: its paper's (POOLING)
    "general": ("arms", "datasets"),
    "curve": ("arm", "seed", "points"),
    "domain": ("arms", "bases"),
    "labelled": ("passage_words", "seed"),
    "bootstrap": ("resamples", "seed"),
    "data_workers": None,  # `prepare` workers (default 0: in the study's process)
}
OPTIONAL = ("pooling", "data_workers")


# --- smoke: the bundled samples, a hidden-64 encoder, 2 steps: the plumbing in a couple of minutes --------------
SMOKE = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "max_len": 64,
    "precision": "fp32",
    "parallel": 2,
    "threads": 1,
    "data_workers": 0,
    "base": {"steps": 4, "batch": 4},
    "pretrain": {"steps": 4, "batch": 4},
    "finetune": {"steps": 2, "batch": 4, "query_max_len": 16, "passage_max_len": 64},
    "eval": {"max_length": 64, "batch_size": 64},
    "curve": {"points": 2},
    "bootstrap": {"resamples": 1000},
}


def smoke_plan(plan: dict) -> dict:
    """The plan shrunk: SMOKE's sizes, one seed per arm, the bundled SciFact sample as every collection, the
    domain adaptation on the study's base only."""
    out = merge(plan, SMOKE)
    out["smoke"] = True
    out["general"]["arms"] = {arm: 1 for arm in out["general"]["arms"]}
    out["general"]["datasets"] = ["scifact-sample"]
    out["domain"]["arms"] = {arm: 1 for arm in out["domain"]["arms"]}
    if "base" in out["domain"]["bases"]:  # gpu-short has no domain part
        base = out["domain"]["bases"]["base"]
        out["domain"]["bases"] = {"base": {**base, "targets": ["scifact-sample"], "batch": 4, "max_steps": 4}}
    return out


def apply_sets(plan: dict, sets: list[str]) -> dict:
    """`key.sub=value` overrides (values parsed as JSON, else kept as strings); an unknown key is an error."""
    out = copy.deepcopy(plan)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        *parents, leaf = key.split(".")
        node = out
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise ValueError(f"--set {item!r}: {'.'.join(parents[:i + 1])} is not a settings section")
            node = node[part]
        if leaf not in node and not key.startswith(("general.arms.", "domain.arms.")):
            raise ValueError(f"--set {item!r}: unknown key {key} (known here: {', '.join(sorted(node))})")
        try:
            node[leaf] = json.loads(raw)
        except json.JSONDecodeError:
            node[leaf] = raw
    return out


def build_plan(settings: dict, scale: str, smoke: bool = False, beir: list[str] = (), sets: list[str] = ()) -> dict:
    """The full settings of one study run: a scale's `settings` (SETTINGS' sections, as study/study_file.py checks
    them) named `scale`, every arm's pooling its paper's unless they say otherwise, shrunk for --smoke, with the
    extra BEIR folders and the --set overrides; checked."""
    plan = {"scale": scale, **{key: copy.deepcopy(settings[key]) for key in SETTINGS if key in settings}}
    plan["pooling"] = {**POOLING, **(plan.get("pooling") or {})}  # every arm's, so that a run may add an arm
    plan = {key: plan[key] for key in ("scale", *SETTINGS) if key in plan}
    plan = smoke_plan(plan) if smoke else {**plan, "smoke": False}
    plan["general"]["beir"] = [str(Path(p).resolve()) for p in beir]
    names = list(plan["general"]["datasets"])
    for folder in map(Path, plan["general"]["beir"]):
        if not (folder / "qrels" / "test.tsv").is_file():
            raise ValueError(f"--beir {folder}: no qrels/test.tsv (a BEIR folder with a test split)")
        if folder.name in names:
            raise ValueError(f"--beir {folder}: a collection named {folder.name!r} is evaluated already")
        names.append(folder.name)
    plan = apply_sets(plan, list(sets))
    for key, arms in (("general.arms", plan["general"]["arms"]), ("domain.arms", plan["domain"]["arms"]),
                      ("pooling", plan["pooling"])):
        unknown = [arm for arm in arms if arm not in ARMS]
        if unknown:
            raise ValueError(f"{key}: unknown arm {unknown[0]!r} (known: {', '.join(ARMS)})")
    for arm, pooling in plan["pooling"].items():
        if pooling not in ("base", "cls", "mean", "dupmae", "sparse"):
            raise ValueError(f"pooling.{arm}: {pooling!r} is not base, cls, mean, dupmae or sparse")
    if plan["curve"]["arm"] not in plan["general"]["arms"]:
        raise ValueError(f"curve.arm: {plan['curve']['arm']!r} is not an arm of the general study")
    if plan["pretrain"]["steps"] % plan["curve"]["points"]:
        raise ValueError(f"curve.points: {plan['curve']['points']} must divide pretrain.steps "
                         f"({plan['pretrain']['steps']}): the curve's checkpoints are evenly spaced")
    return plan


def flat(settings: dict, prefix: str = "") -> dict:
    """{dotted key: value} of nested settings."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fix_settings(work: Path, plan: dict) -> dict:
    """Record `plan` as WORK/settings.json with the time it was fixed, or check it against the recorded one:
    another value (or a key added or dropped) is an error naming the key. Returns the record."""
    from pretrieve.utils.run_dir import write_atomic

    path = work / "settings.json"
    if path.is_file():
        record = json.loads(path.read_text())
        before, now = flat(record["settings"]), flat(plan)
        for key in sorted(set(before) | set(now)):
            if before.get(key, "<absent>") != now.get(key, "<absent>"):
                raise ValueError(f"{path}: settings were fixed at {record['fixed_at']} with {key} = "
                                 f"{before.get(key, '<absent>')!r}; this run has {now.get(key, '<absent>')!r}. "
                                 "Resume with the same settings, or start another --out")
        return record
    record = {"settings": plan, "fixed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "fixed_before_test_results": True}
    work.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return record
