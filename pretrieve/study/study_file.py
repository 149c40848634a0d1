"""A method study's file (studies/<study>/<scale>.yaml): which study, at which scale, with which settings, where it
works and writes its results. `pretrieve study plan|run|report` read it. Relative paths are the working
directory's (the repository's root in every command the studies' READMEs show), as in a scaling study's file.

    study: quality                        # quality, recipe or matryoshka
    scale: cpu                            # the scale's name, recorded in the results
    out: bench-out/quality-cpu            # the work directory (default bench-out/<study>-<scale>)
    results: studies/quality/results/quality.json
    # quality: each arm's pre-training config ({arm} substituted), the fine-tuning's, and study/plan.py's SETTINGS
    configs: {pretrain: configs/pretrain/tiny-{arm}.yaml, finetune: configs/finetune/tiny.yaml}
    settings: {model: {...}, max_len: 128, base: {...}, pretrain: {...}, finetune: {...}, ...}
    # recipe: on a quality study's base, text and fine-tuning; a contrastive stage between pre-training and it
    quality: studies/quality/cpu.yaml
    configs: {contrastive: configs/pretrain/tiny-contrastive.yaml}
    budget: {steps: 1600, points: [200, 400, 800, 1600], batch: 64, temperature: 0.05, query_max_len: 32,
             runs: {mean: {pooling: mean, lr: 1.0e-3, warmup_ratio: 0.1}, ...}}
    arms: {arms: {none: 3, retromae: 3}, steps: 800, lr: 1.0e-3, warmup_ratio: 0.1, poolings: [cls, mean]}
    # matryoshka: the recipe's contrastive stage, plain and with method.matryoshka_dims
    recipe: studies/recipe/cpu.yaml
    pooling: mean
    anchor: {model: ..., benchmark: ..., dims: {...}}   # optional: published scores to read the results against

A recipe study is at its quality study's scale, a matryoshka study at its recipe's. Errors name the file and key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pretrieve.study.plan import ARMS, OPTIONAL, SETTINGS

COMMON = {"study": True, "scale": True, "out": False, "results": True}  # key: required
KINDS = {"quality": {"configs": True, "settings": True},
         "recipe": {"quality": True, "configs": True, "budget": True, "arms": True},
         "matryoshka": {"recipe": True, "pooling": True, "anchor": False}}
CONFIGS = {"quality": ("pretrain", "finetune"), "recipe": ("contrastive",)}
BUDGET = ("steps", "points", "batch", "temperature", "query_max_len", "runs")
BUDGET_RUN = ("pooling", "lr", "warmup_ratio")
ARMS_STAGE = ("arms", "steps", "lr", "warmup_ratio", "poolings")
DENSE = ("cls", "mean")  # the poolings a contrastive stage trains


class StudyFileError(ValueError):
    """A study file that cannot be read; the message names the file and the key."""


@dataclass
class MethodStudy:
    path: Path
    kind: str
    scale: str
    out: Path
    results: Path
    keys: dict  # the file's own keys
    base: MethodStudy | None = None  # the study it builds on: a recipe's quality study, a matryoshka's recipe

    def built_on(self, kind: str) -> MethodStudy:
        """This study or the one it builds on (through its own base) of `kind`."""
        study = self
        while study.kind != kind:
            study = study.base
        return study

    @property
    def settings(self) -> dict:
        """The quality study's settings at this scale (study/plan.py's SETTINGS)."""
        return self.built_on("quality").keys["settings"]

    def config(self, name: str) -> str:
        """A config this study or one it builds on names (`configs.NAME`)."""
        study = self
        while name not in study.keys.get("configs", {}):
            study = study.base
        return study.keys["configs"][name]


def load_study(path: str | Path) -> MethodStudy:
    """The study of the file `path`, every key checked, the studies it builds on read too."""
    return _load(Path(path), ())


def _load(path: Path, seen: tuple[Path, ...]) -> MethodStudy:
    from omegaconf import OmegaConf

    if not path.is_file():
        raise StudyFileError(f"{path}: no such study file")
    keys = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(keys, dict):
        raise StudyFileError(f"{path}: expected a mapping of keys (study: quality, scale: cpu, ...)")
    kind = keys.get("study")
    if kind not in KINDS:
        raise StudyFileError(f"{path}: study: {kind!r} is not one of {', '.join(KINDS)}")
    known = {**COMMON, **KINDS[kind]}
    for key in keys:
        if key not in known:
            raise StudyFileError(f"{path}: {key}: unknown for a {kind} study (known: {', '.join(known)})")
    for key, required in known.items():
        if required and keys.get(key) is None:
            raise StudyFileError(f"{path}: {key}: missing")
    try:
        _check_configs(keys, kind)
        {"quality": _check_quality, "recipe": _check_recipe, "matryoshka": _check_matryoshka}[kind](keys)
    except StudyFileError as e:
        raise StudyFileError(f"{path}: {e}") from None
    study = MethodStudy(path, kind, str(keys["scale"]), Path(keys.get("out") or f"bench-out/{kind}-{keys['scale']}"),
                        Path(keys["results"]), keys)
    under = {"recipe": "quality", "matryoshka": "recipe"}.get(kind)
    if under:
        study.base = _base(study, under, seen + (path.resolve(),))
    if kind == "recipe":
        _check_arms_are_the_quality_studys(study)
    return study


def _base(study: MethodStudy, kind: str, seen: tuple[Path, ...]) -> MethodStudy:
    """The study `study` builds on (its key `kind` names the file), of that kind and at the same scale."""
    path = Path(study.keys[kind])
    if path.resolve() in seen:
        raise StudyFileError(f"{study.path}: {kind}: {path} builds on this file again")
    try:
        base = _load(path, seen)
    except StudyFileError as e:
        raise StudyFileError(f"{study.path}: {kind}: {e}") from None
    if base.kind != kind:
        raise StudyFileError(f"{study.path}: {kind}: {path} is a {base.kind} study, not a {kind} study")
    if base.scale != study.scale:
        raise StudyFileError(f"{study.path}: scale: {study.scale!r}, and its {kind} study {path} is at "
                             f"{base.scale!r}: a study runs at the scale of the one it builds on")
    return base


def _mapping(value, where: str, names: tuple[str, ...] | None = None) -> dict:
    """`value` as a mapping; with `names`, holding exactly those keys."""
    if not isinstance(value, dict):
        shown = f" ({', '.join(names)})" if names else ""
        raise StudyFileError(f"{where}: expected a mapping{shown}, got {value!r}")
    for name in value if names else ():
        if name not in names:
            raise StudyFileError(f"{where}.{name}: unknown (known: {', '.join(names)})")
    for name in names or ():
        if name not in value:
            raise StudyFileError(f"{where}.{name}: missing")
    return value


def _check_configs(keys: dict, kind: str) -> None:
    if kind in CONFIGS:
        _mapping(keys["configs"], "configs", CONFIGS[kind])


def _check_quality(keys: dict) -> None:
    """`settings`: every section of study/plan.py's SETTINGS (but the optional ones), each mapping with its keys."""
    settings = _mapping(keys["settings"], "settings")
    for key, names in SETTINGS.items():
        if key not in settings:
            if key not in OPTIONAL:
                raise StudyFileError(f"settings.{key}: missing")
        elif names == ("...",):
            _mapping(settings[key], f"settings.{key}")
        elif names:
            _mapping(settings[key], f"settings.{key}", names)
    for key in settings:
        if key not in SETTINGS:
            raise StudyFileError(f"settings.{key}: unknown (known: {', '.join(SETTINGS)})")


def _check_recipe(keys: dict) -> None:
    """`budget`: its runs' poolings dense, its points the evenly spaced checkpoints of its steps; `arms`."""
    budget = _mapping(keys["budget"], "budget", BUDGET)
    for name, run in _mapping(budget["runs"], "budget.runs").items():
        if _mapping(run, f"budget.runs.{name}", BUDGET_RUN)["pooling"] not in DENSE:
            raise StudyFileError(f"budget.runs.{name}.pooling: {run['pooling']!r} is not one of {', '.join(DENSE)}")
    points = budget["points"]
    if not (isinstance(points, list) and points and all(isinstance(p, int) and p > 0 for p in points)
            and points == sorted(points) and points[-1] == budget["steps"] and all(p % points[0] == 0 for p in points)):
        raise StudyFileError(f"budget.points: {points!r}: steps in ascending order, each a multiple of the first "
                             f"(the runs' checkpoints), the last budget.steps ({budget['steps']})")
    arms = _mapping(keys["arms"], "arms", ARMS_STAGE)
    for arm in _mapping(arms["arms"], "arms.arms"):
        if arm not in ARMS:
            raise StudyFileError(f"arms.arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
    if arms["steps"] is not None and not (isinstance(arms["steps"], int) and arms["steps"] > 0):
        raise StudyFileError(f"arms.steps: {arms['steps']!r}: the contrastive budget in steps, or null (not chosen)")
    if not arms["poolings"] or any(p not in DENSE for p in arms["poolings"]):
        raise StudyFileError(f"arms.poolings: {arms['poolings']!r}: some of {', '.join(DENSE)}")


def _check_arms_are_the_quality_studys(study: MethodStudy) -> None:
    """The arms' pre-training runs are the quality study's own: no arm or seed it lacks."""
    general = study.settings["general"]["arms"]
    for arm, seeds in study.keys["arms"]["arms"].items():
        if general.get(arm, 0) < seeds:
            raise StudyFileError(f"{study.path}: arms.arms.{arm}: {seeds} seeds, and its quality study "
                                 f"{study.base.path} runs {general.get(arm, 0)} (general.arms)")


def _check_matryoshka(keys: dict) -> None:
    if keys["pooling"] not in DENSE:
        raise StudyFileError(f"pooling: {keys['pooling']!r} is not one of {', '.join(DENSE)}")
    if keys.get("anchor") is not None:
        _mapping(keys["anchor"], "anchor")
