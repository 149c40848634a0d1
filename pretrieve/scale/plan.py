"""`pretrieve scale plan STUDY.yaml`: the grid of a scaling study, what each point costs, and its run list.

The study file (pretrieve/scale/study.py has the `name`, `tracking` and `fit` keys) adds:

    methods: [mlm, retromae, dupmae]
    config: configs/pretrain/tiny-{method}.yaml   # each point's base config; {method} is substituted
    sizes:                                        # encoder shapes: hidden, layers, heads, FFN
      h64: {hidden_size: 64, num_layers: 2, num_heads: 2, intermediate_size: 256}
    budgets: {tokens: [2.0e5, 4.0e5]}             # training tokens D, or {tokens_per_parameter: [20, 40]}
    seeds: [0]
    train:
      batch_size: 16                              # sequences per micro-batch and rank (train.micro_batch_size)
      seq_len: 128                                # method.max_len; D counts seq_len tokens per sequence
      world_size: 1                               # data-parallel ranks each point trains on (default 1)
      lr: 1.0e-3                                  # the peak lr at base_width
      lr_rule: inverse_width                      # lr x base_width / hidden (Adam's width rule), or constant
      base_width: 128
      overrides: [train.warmup_ratio=0.1]         # any further `key=value` for every point
    data: {manifests: [...], validation: [...], eval_every: 50}

Per point (method x size x budget x seed): N, the encoder's non-embedding parameters (Kaplan et al. 2020:
attention, FFN and their LayerNorms, biases included; not the embeddings, the frozen pooler, or the training
heads, which the retriever does not keep), N_total (with the embeddings), and what runs: an optimizer step
takes batch_size x grad_accum x world_size sequences (grad_accum: the point's resolved train.grad_accum, from
the config or train.overrides), so D = steps x that x seq_len with steps = round(D_asked / (that x seq_len)),
and C = steps x grad_accum x world_size x the training FLOPs of one micro-batch (engine/flops.py on the first
batch of the study's data, collated by the method). Each point pins train.global_batch_size to its sequences
per step, so a point started on another number of ranks stops at its config check instead of training on
other tokens than planned. Its memory per device is estimated by scale/memory.py. `plan.json` (written
atomically under run.out, default runs/scale/<name>) lists every point with the `pretrieve pretrain`
overrides that make it; `scale run` reads it.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from itertools import islice, product
from pathlib import Path

from pretrieve.models.backbones import backbone_named, backbone_of
from pretrieve.models.encoder import ModelOptions
from pretrieve.scale.memory import GB, needed
from pretrieve.scale.study import load_study

LR_RULES = ("inverse_width", "constant")
SIZE_KEYS = ("hidden_size", "num_layers", "num_heads", "intermediate_size")
# budgets past these are planned, with a warning: they are more likely a typo than a study
BUDGET_BOUNDS = {"tokens": 1e13, "tokens_per_parameter": 1e4}
BUDGET_WHY = {"tokens": "more tokens than the largest pre-training corpora hold",
              "tokens_per_parameter": "500 times Chinchilla's 20 tokens per parameter"}


class StudyError(ValueError):
    """A study that cannot be planned; the message names the file and key."""


@dataclass
class Point:
    id: str
    method: str
    size: str
    seed: int
    N: int
    N_total: int
    D: int
    C: float
    steps: int
    lr: float
    overrides: list[str]
    micro_batch_size: int = 1  # sequences per micro-batch and rank
    grad_accum: int = 1
    world_size: int = 1
    seq_len: int = 0
    precision: str = "fp32"
    memory: dict = field(default_factory=dict)  # scale/memory.py's estimate

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size * self.seq_len


def parameter_counts(config) -> tuple[int, int]:
    """(N, N_total) of the base model `config` describes, counted on the meta device (no memory, no init): N
    without the embeddings and the pooler (BERT: per layer Q, K, V, O 4 h^2 + 4 h, FFN 2 h f + f + h, two
    LayerNorms 4 h; ModernBERT: QKV and O 4 h^2, GeGLU 3 h f, the norms, the final norm), N_total with the
    embeddings."""
    import torch

    backbone = backbone_of(config)
    with torch.device("meta"):
        model = backbone.model_class(config, **({"add_pooling_layer": False} if backbone.has_pooler else {}))
    total = sum(p.numel() for p in model.parameters())
    return total - sum(p.numel() for p in model.embeddings.parameters()), total


def plan(path: str | Path) -> tuple[dict, list[Point]]:
    """(the study, its points), every key checked before anything is computed."""
    study = load_study(path)
    where = str(path)
    methods, sizes, seeds, (kind, values) = _grid(study, where)
    train = study.get("train") or {}
    batch, seq_len, world = train.get("batch_size"), train.get("seq_len"), train.get("world_size", 1)
    if not isinstance(batch, int) or batch < 1 or not isinstance(seq_len, int) or seq_len < 4:
        raise StudyError(f"{where}: train.batch_size (>= 1) and train.seq_len (>= 4) are needed as integers")
    if not isinstance(world, int) or world < 1:
        raise StudyError(f"{where}: train.world_size: a positive integer is needed, got {world!r}")
    if train.get("lr_rule", "inverse_width") not in LR_RULES:
        raise StudyError(f"{where}: train.lr_rule: {train['lr_rule']!r} is not one of {', '.join(LR_RULES)}")
    data = study.get("data") or {}
    manifests = data.get("manifests") or []
    if not manifests:
        raise StudyError(f"{where}: data.manifests: the shards to pre-train on (pretrieve prepare)")

    out = study_out(study)
    common = [f"method.max_len={seq_len}", f"train.micro_batch_size={batch}"]
    data_overrides = [f"data.manifests=[{','.join(map(str, manifests))}]", "data.weights=null",
                      *_validation_overrides(data)]
    settings = {m: _method_settings(study, m, [*common, *train.get("overrides", [])], where) for m in methods}
    accumulation = {m: grad_accum for m, (grad_accum, _) in settings.items()}
    points = []
    for method, (size, shape), (b, budget), seed in product(methods, sizes.items(), enumerate(values), seeds):
        # the padding id moves no parameter: 0 stands for the tokenizer's, read when the point's config is built
        n = parameter_counts(ModelOptions(backbone=settings[method][1], pad_token_id=0, **shape).hf_config())[0]
        tokens = budget * n if kind == "tokens_per_parameter" else budget
        sequences = batch * accumulation[method] * world  # per optimizer step
        steps = round(tokens / (sequences * seq_len))
        if steps < 1:
            raise StudyError(f"{where}: budgets.{kind}[{b}]: {budget:g} gives {tokens:,.0f} tokens, less than one "
                             f"step ({batch} x grad_accum {accumulation[method]} x world {world} x {seq_len} = "
                             f"{sequences * seq_len:,})")
        lr = float(train.get("lr", 1e-4))
        if train.get("lr_rule", "inverse_width") == "inverse_width":
            lr *= train.get("base_width", shape["hidden_size"]) / shape["hidden_size"]
        point_id = f"{method}-{size}-D{steps * sequences * seq_len:.3g}-s{seed}".replace("+", "")
        overrides = [*(f"model.{k}={shape[k]}" for k in SIZE_KEYS), *common, f"train.max_steps={steps}",
                     f"train.lr={lr:.6g}", f"seed={seed}", f"run_dir={out / 'points' / point_id}", *data_overrides,
                     f"train.global_batch_size={sequences}", *train.get("overrides", [])]
        points.append(Point(point_id, method, size, seed, n, 0, steps * sequences * seq_len, 0.0, steps, lr,
                            overrides, micro_batch_size=batch, grad_accum=accumulation[method], world_size=world,
                            seq_len=seq_len))
    duplicated = {p.id for p in points if sum(q.id == p.id for q in points) > 1}
    if duplicated:
        raise StudyError(f"{where}: budgets: two budgets give the same steps ({sorted(duplicated)[0]})")
    _cost(study, points, where)
    return study, points


def _grid(study: dict, where: str) -> tuple[list, dict, list, tuple]:
    """(methods, sizes, seeds, (budget kind, budgets)), checked."""
    from pretrieve.models.heads import METHODS

    methods = _list(study, "methods", where)
    known = sorted(METHODS)
    for i, method in enumerate(methods):
        if method not in known:
            raise StudyError(f"{where}: methods[{i}]: {method!r} is not a registered method "
                             f"(known: {', '.join(known)})")
    sizes = study.get("sizes") or {}
    if not isinstance(sizes, dict) or not sizes:
        raise StudyError(f"{where}: sizes: name at least one encoder shape ({', '.join(SIZE_KEYS)})")
    for name, shape in sizes.items():
        missing = [k for k in SIZE_KEYS if not isinstance((shape or {}).get(k), int) or shape[k] < 1]
        if missing:
            raise StudyError(f"{where}: sizes.{name}.{missing[0]}: a positive integer is needed")
        if shape["hidden_size"] % shape["num_heads"]:
            raise StudyError(f"{where}: sizes.{name}: num_heads {shape['num_heads']} does not divide hidden_size "
                             f"{shape['hidden_size']}")
    seeds = _list(study, "seeds", where, default=[0])
    budgets = study.get("budgets") or {}
    if not isinstance(budgets, dict) or len(budgets) != 1 or next(iter(budgets)) not in BUDGET_BOUNDS:
        raise StudyError(f"{where}: budgets: give one of tokens: [...] or tokens_per_parameter: [...]")
    kind, values = next(iter(budgets.items()))
    if not isinstance(values, list) or not values:
        raise StudyError(f"{where}: budgets.{kind}: a non-empty list of numbers is needed, got {values!r}")
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise StudyError(f"{where}: budgets.{kind}[{i}]: a positive number is needed, got {value!r}")
        if value > BUDGET_BOUNDS[kind]:
            print(f"pretrieve: warning: {where}: budgets.{kind}[{i}]: {value:g} is more than "
                  f"{BUDGET_BOUNDS[kind]:g}, {BUDGET_WHY[kind]}; a typo?", file=sys.stderr)
    return methods, sizes, seeds, (kind, values)


def _method_settings(study: dict, method: str, overrides: list[str], where: str) -> tuple[int, str]:
    """(train.grad_accum, model.backbone) of `method`'s points: its base config with the study's overrides
    (checked in full later)."""
    from omegaconf import OmegaConf

    from pretrieve.config import ConfigError, TrainOptions, load_config

    try:
        config = load_config(base_config(study, method), overrides)
    except (ConfigError, OSError) as e:
        raise StudyError(f"{where}: {method}: {e}") from e
    value = OmegaConf.select(config, "train.grad_accum", default=TrainOptions.grad_accum)
    if not isinstance(value, int) or value < 1:
        raise StudyError(f"{where}: {method}: train.grad_accum: must be an integer >= 1, got {value!r}")
    backbone = OmegaConf.select(config, "model.backbone", default=ModelOptions.backbone)
    try:
        backbone_named(backbone)
    except ValueError as e:
        raise StudyError(f"{where}: {method}: {e}") from e
    return value, backbone


def _list(study: dict, key: str, where: str, default=None) -> list:
    value = study.get(key, default)
    if not isinstance(value, list) or not value:
        raise StudyError(f"{where}: {key}: a non-empty list is needed")
    return value


def _validation_overrides(data: dict) -> list[str]:
    if not data.get("validation"):
        return []
    every = [f"train.eval_every={data['eval_every']}"] if data.get("eval_every") else []
    return [f"data.validation=[{','.join(map(str, data['validation']))}]", *every]


def study_out(study: dict) -> Path:
    """Where the study's runs, plan and evaluations go: `run.out`, default runs/scale/<name>."""
    return Path((study.get("run") or {}).get("out") or f"runs/scale/{study['name']}")


def study_workers(study: dict) -> int:
    """Points (and evaluations) at a time on this machine: `run.workers`, default 1."""
    return max(1, int((study.get("run") or {}).get("workers", 1)))


def base_config(study: dict, method: str) -> str:
    return str(study.get("config", "configs/pretrain/{method}.yaml")).format(method=method)


def _cost(study: dict, points: list[Point], where: str) -> None:
    """N_total, C and memory of every point: each point's experiment is built (its config checked as `pretrain`
    checks it at the study's world size) and its first batch of real data collated and priced as `pretrieve
    estimate` prices a micro-batch (scale/estimate.py: engine/flops.py's FLOPs, scale/memory.py's memory)."""
    from pretrieve.config import ConfigError, load_config
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.remote import ReadOptions
    from pretrieve.data.stream import ShardStream
    from pretrieve.pretrain_config import experiment
    from pretrieve.scale.estimate import micro_batch_cost

    vocab = None  # the study's points share their data, hence its tokenizer
    per_micro_batch: dict[tuple, tuple[float, dict]] = {}
    samples = None
    for point in points:
        try:
            exp = experiment(load_config(base_config(study, point.method), point.overrides), point.world_size)
        except ConfigError as e:
            raise StudyError(f"{where}: point {point.id}: {e}") from e
        config = exp.model.hf_config()
        point.N_total = parameter_counts(config)[1]
        point.precision = exp.train.precision
        key = (point.method, point.size)
        if key not in per_micro_batch:
            if samples is None:
                stream = ShardStream(exp.data.manifests, seed=0, shuffle_buffer=1, rank=0, world_size=1,
                                     read=ReadOptions.from_options(exp.data))
                samples = list(islice(iter(stream), exp.train.micro_batch_size))
                vocab = Vocabulary.of_tokenizer(exp.data.tokenizer_dir())
            batch = exp.method.collator.from_options(exp.options, vocab, seed=0)(samples)
            cost = micro_batch_cost(exp, batch, len(samples), point.world_size)
            per_micro_batch[key] = (cost.flops, cost.memory)
        flops, point.memory = per_micro_batch[key]
        point.C = flops * point.grad_accum * point.world_size * point.steps


# what a study writes in its `run.out`: the plan, the study's record, each point's run, the farm's file and folder,
# and the default MLflow store
STUDY_WRITES = ("plan.json", "study.json", "points", "eval", "farm.yaml", "mlflow.db", "mlartifacts")


def write_plan(study: dict, points: list[Point]) -> Path:
    from pretrieve.utils.run_dir import write_atomic

    from pretrieve.utils.output_folder import OutputInUse, check_own_entries

    out = study_out(study)
    path = out / "plan.json"
    earlier = json.loads(path.read_text()).get("study") if path.is_file() else None
    if earlier not in (None, study["name"]):
        raise OutputInUse(f"{path}: {out} holds the plan of study {earlier!r}, not {study['name']!r}; give this "
                          "study its own run.out")
    check_own_entries(out, "scaling study", lambda name: name in STUDY_WRITES or name.startswith("mlflow.db-")
                      or name.startswith("."), earlier=lambda folder: earlier is not None)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"study": study["name"], "points": [asdict(p) for p in points]}, indent=1))
    return path


def record_rates(study: dict, points: list[Point], kind: str, records: list) -> tuple[dict, str]:
    """({point id: its scale/estimate.py Rate}, the table's rate label): each point priced from `records` of
    device `kind` as `pretrieve estimate` prices a config (its method, FLOPs a token C / D and settings)."""
    from types import SimpleNamespace

    from pretrieve.config import TrainOptions, load_config, section
    from pretrieve.pretrain_config import model_options
    from pretrieve.scale.estimate import device_rate, speed_settings
    from pretrieve.scale.records import setting_keys

    keys = setting_keys(records)
    rates = {}
    for point in points:
        config = load_config(base_config(study, point.method), point.overrides)
        options = SimpleNamespace(train=section(config, "train", TrainOptions), model=model_options(config))
        rates[point.id] = device_rate(kind, point.precision, point.method, point.C / point.D,
                                      speed_settings(options, keys), records)
    by_record: dict[str, list[Point]] = {}
    for point in points:
        by_record.setdefault(rates[point.id].record.where, []).append(point)
    label = "; ".join(
        (f"{rates[on[0].id].mfu:.2%} MFU for {', '.join(sorted({p.method for p in on}))} from "
         f"{rates[on[0].id].record.describe()}, the points at {min(rates[p.id].extrapolation for p in on):.3g}-"
         f"{max(rates[p.id].extrapolation for p in on):.3g}x its FLOPs a token") for on in by_record.values())
    return rates, f"the throughput records of {kind} ({label})"


def table(points: list[Point], flops_per_second, rate_label: str) -> str:
    """The grid as a markdown table, with the total compute and device-hours at `flops_per_second(point)` FLOP/s
    (described by `rate_label`), and the estimated memory per device."""
    lines = ["| point | method | size | N | N_total | D | steps | C (FLOPs) | device-hours | sequences/step | "
             "GB/device |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    hours = [p.C / flops_per_second(p) / 3600 for p in points]
    for p, h in zip(points, hours):
        memory = needed(p.memory, p.micro_batch_size, p.memory["activation_checkpointing"]) / GB
        lines.append(f"| {p.id} | {p.method} | {p.size} | {p.N:,} | {p.N_total:,} | {p.D:,} | {p.steps:,} | "
                     f"{p.C:.3g} | {h:.3g} | {p.micro_batch_size} x {p.grad_accum} x {p.world_size} | {memory:.3g} |")
    total = sum(p.C for p in points)
    lines.append(f"\n{len(points)} points, {total:.3g} FLOPs in all: {sum(hours):.3g} device-hours at {rate_label}")
    return "\n".join(lines)
