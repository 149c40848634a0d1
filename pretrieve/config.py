"""Experiment configs, the run level: YAML files (configs/), dotted `key=value` overrides, and what every kind of
experiment shares: `seed`, `run_dir`, `resume`, `train:` (TrainOptions), `checkpoint:` (CheckpointOptions) and
`tracking:` (TrackingOptions), as the training loop reads them (RunExperiment), with their checks naming the key.

Each kind adds its own sections and checks beside its application: pre-training's in pretrain_config.py,
fine-tuning's in finetune/config.py. Both validate the whole config before any process group starts and report
every error they find in one ConfigError (a user fixes a config in one round, not one key per run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pretrieve.utils.health_options import check_health
from pretrieve.utils.options import ConfigError, Problems, options_of
from pretrieve.utils.run_dir import latest_checkpoint


def load_config(path: str | Path, overrides: list[str] | None = None,
                required: tuple[str, ...] = ("model", "method")) -> DictConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        config = OmegaConf.load(path)
    except Exception as e:  # omegaconf/yaml raise many types for bad syntax
        raise ConfigError(f"{path}: {e}") from e
    for item in overrides or []:  # each parsed alone: an error names the override, not the file
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        try:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist([item]))
        except Exception as e:
            key = item.split("=", 1)[0]
            raise ConfigError(f"override {item!r}: {str(e).splitlines()[0]}; the value is read as YAML: a text "
                              f"holding ': ', '#' or brackets needs quotes inside the argument, in a shell "
                              f"'{key}=\"...\"' (docs/finetuning.md)") from e
    for section in required:
        if section not in config:
            raise ConfigError(f"{path}: missing section {section!r}")
    return config


# bf16-autocast: fp32 weights in the module, the forward under torch.autocast to bf16 (DeepSpeed's "torch_autocast"):
# no bf16 wrapper around the optimizer, whose per-parameter steps and checks cost a bf16 step half its speed on a GPU
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-autocast")
LR_SCHEDULES = ("linear", "cosine", "constant", "wsd")  # engine/lr_schedule.py
OPTIMIZERS = ("auto", "deepspeed", "torch-fused")  # engine/optimizer.py


@dataclass
class TrainOptions:
    micro_batch_size: int = 8
    grad_accum: int = 1
    global_batch_size: int | None = None  # when given: must equal micro x accumulation x world size
    max_steps: int = 1000  # the schedule's length
    stop_at: int | None = None  # end this invocation after that step, with a checkpoint (resume=auto goes on)
    lr: float = 1e-4  # the peak of the schedule
    warmup_ratio: float = 0.1
    lr_schedule: str = "linear"  # after the warm-up: one of LR_SCHEDULES (engine/lr_schedule.py)
    decay_ratio: float = 0.2  # wsd: the share of max_steps that decays, at the end
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # which AdamW steps: one of OPTIMIZERS (engine/optimizer.py): the ds_config's (deepspeed), torch's fused
    # kernel (torch-fused), auto = deepspeed; the same updates within float rounding
    optimizer: str = "auto"
    precision: str = "fp32"
    zero_stage: int = 0  # selects ds_configs/zero<N>.json unless ds_config is given
    ds_config: str | None = None
    log_every: int = 10
    eval_every: int | None = None  # held-out loss every N steps (and at the end) when data.validation is given
    activation_checkpointing: bool = False  # recompute encoder layers in backward: less memory, ~1/3 more compute
    # torch.compile each encoder and decoder layer on its own (models/regional_compile.py): how a step runs, not
    # what the model is (the checkpoints and the export are the eager model's), hence train., beside the above
    compile: bool = False
    # under bf16-autocast, the LayerNorms normalise in bf16 (models/low_precision_norm.py): how a step runs, as above
    low_precision_norm: bool = False
    # every batch padded to max_len, each token loss's labelled positions to a count fixed for the run: one set of
    # tensor shapes for every step (data/collators.py); refused with model.unpad, whose packed rows vary
    static_shapes: bool = False
    # the step's forward and backward captured once as a CUDA graph and replayed for each batch of the same shapes
    # (engine/cuda_graphs.py): the host launches one graph a step instead of each kernel; how a step runs, as above
    cuda_graphs: bool = False
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step on the CPU (zero_stage >= 1)
    offload_params: bool = False  # ZeRO-Infinity: the parameters too, fetched layer by layer (zero_stage 3)
    max_runtime: float | None = None  # seconds of wall clock; then checkpoint and exit 85, as on SIGTERM
    # seconds deepspeed.initialize (joining the job) may take; then exit 86, which the SLURM launcher requeues:
    # a rank that dies while the process group forms leaves the others waiting in gloo / NCCL with no timeout
    startup_timeout: float | None = 1800.0
    deterministic: bool = False  # PyTorch's deterministic switches (engine/determinism.py): bit-exact GPU resumes
    peak_flops: float | None = None  # per device, FLOP/s at `precision`, for MFU; default: engine/flops.py's table
    health: dict | None = None  # the alarms: warn | stop | off each, and thresholds (utils/health_options.py)


@dataclass
class CheckpointOptions:
    every: int = 1000
    keep: int = 3


@dataclass
class TrackingOptions:
    enabled: bool = True
    uri: str | None = None  # default: sqlite:///<run_dir parent>/mlflow.db
    experiment: str = "pretrieve"
    system_metrics_every: float | None = 10.0  # seconds between CPU/GPU/memory samples (None: off)
    parent_run_id: str | None = None  # nest the run under this one (a scaling study's parent run)
    tags: dict | None = None  # extra run tags (a study point's N, D, C, size, seed)


@dataclass(kw_only=True)
class RunExperiment:
    """What the training loop (engine/train.py) reads of any experiment: the run settings that pre-training and
    fine-tuning share. Each kind adds its own sections and names their options classes (`section_classes`)."""

    seed: int
    run_dir: Path
    resume: str | None
    train: TrainOptions
    checkpoint: CheckpointOptions
    tracking: TrackingOptions
    raw: DictConfig
    init_checkpoint: tuple[Path, str] | None = None  # (checkpoints dir, tag) a new run branches from

    def section_classes(self, config: dict) -> dict[str, type]:
        """The options class of each section of `config` (a resolved config of this kind, this run's or the one a
        checkpoint was written with): engine/resume_check.py fills in their defaults before comparing."""
        return {"train": TrainOptions, "checkpoint": CheckpointOptions}



# the keys of every experiment (RunExperiment): sections (each an options dataclass) and plain keys
RUN_SECTIONS = ("train", "checkpoint", "tracking")
RUN_KEYS = ("seed", "run_dir", "resume", "resume_changes")


def section(config: DictConfig, name: str, cls, problems: Problems | None = None):
    """Section `name` of `config` as options `cls` (an absent section: all defaults). With `problems`, its errors
    are added there and the values that passed are kept, so that their checks still run (options_of)."""
    return options_of(cls, OmegaConf.to_container(config.get(name) or OmegaConf.create({}), resolve=True), name,
                      problems=problems)



def unknown_top_level(config: DictConfig, known: set[str]) -> None:
    problems = Problems()
    for key in sorted(set(config) - known):
        problems.add(f"{key}: unknown top-level key (known: {', '.join(sorted(known))})")
    problems.raise_any()



def run_sections(config: DictConfig, world_size: int, check_switches: Callable[[TrainOptions, Problems], None]
                 ) -> tuple[TrainOptions, CheckpointOptions, Any]:
    """The validated `train:`, `checkpoint:` and `tracking:` sections, shared by pre-training and fine-tuning;
    `check_switches`: the checks of the speed switches among train's keys, their table's (models/speed_switches.py
    check_train, a floor above this one)."""
    problems = Problems()
    train = section(config, "train", TrainOptions, problems)
    checkpoint = section(config, "checkpoint", CheckpointOptions, problems)
    tracking = section(config, "tracking", TrackingOptions, problems)
    if train is not None:
        _check_train(train, world_size, problems)
        check_switches(train, problems)
    if checkpoint is not None and (checkpoint.every < 1 or checkpoint.keep < 1):
        problems.add("checkpoint.every and checkpoint.keep must be >= 1")
    problems.raise_any()
    return train, checkpoint, tracking


def _check_train(train: TrainOptions, world_size: int, problems: Problems) -> None:
    for key in ("micro_batch_size", "grad_accum", "max_steps", "log_every", "stop_at", "eval_every"):
        if getattr(train, key) is not None and getattr(train, key) < 1:
            problems.add(f"train.{key}: must be >= 1, got {getattr(train, key)}")
    if train.lr <= 0 or not 0 <= train.warmup_ratio <= 1 or train.weight_decay < 0 or train.grad_clip < 0:
        problems.add(f"train: need lr > 0, 0 <= warmup_ratio <= 1, weight_decay >= 0 and grad_clip >= 0 (got "
                     f"{train.lr}, {train.warmup_ratio}, {train.weight_decay}, {train.grad_clip})")
    implied = train.micro_batch_size * train.grad_accum * world_size
    if train.global_batch_size is not None and train.global_batch_size != implied:
        problems.add(f"train.global_batch_size: {train.global_batch_size} != micro_batch_size "
                     f"{train.micro_batch_size} x grad_accum {train.grad_accum} x world size {world_size} = {implied}")
    if train.lr_schedule not in LR_SCHEDULES:
        problems.add(f"train.lr_schedule: {train.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if train.lr_schedule == "wsd" and not (0 < train.decay_ratio <= 1 - train.warmup_ratio):
        problems.add(f"train.decay_ratio: {train.decay_ratio} must be > 0 and leave room for the warm-up "
                     f"(<= 1 - warmup_ratio = {1 - train.warmup_ratio:g})")
    for key in ("max_runtime", "startup_timeout"):
        if getattr(train, key) is not None and not getattr(train, key) > 0:
            problems.add(f"train.{key}: must be > 0 seconds (or null), got {getattr(train, key)}")
    if train.peak_flops is not None and not train.peak_flops > 0:
        problems.add(f"train.peak_flops: must be > 0 FLOP/s per device, got {train.peak_flops}")
    if train.zero_stage not in (0, 1, 2, 3):
        problems.add(f"train.zero_stage: {train.zero_stage} is not 0, 1, 2 or 3")
    if train.offload_optimizer and train.zero_stage == 0:
        problems.add("train.offload_optimizer: needs train.zero_stage 1, 2 or 3 (ZeRO-Offload)")
    if train.offload_params and train.zero_stage != 3:
        problems.add("train.offload_params: needs train.zero_stage 3 (only ZeRO 3 partitions the parameters)")
    if train.ds_config is not None and not Path(train.ds_config).is_file():
        problems.add(f"train.ds_config: {train.ds_config} not found")
    problems.parse(check_health, train.health, train.ds_config)


def resume_of(config: DictConfig) -> str | None:
    resume = config.get("resume")
    if resume not in (None, "auto"):
        raise ConfigError(f"resume: {resume!r}: the only value is auto (continue from the latest checkpoint)")
    if config.get("resume_changes") not in (None, "allow"):  # engine/resume_check.py
        raise ConfigError(f"resume_changes: {config.get('resume_changes')!r}: the only value is allow (resume with "
                          "a config that differs from the checkpoint's beyond cadence keys; recorded in the run)")
    return resume


def init_checkpoint_of(config: DictConfig) -> tuple[Path, str] | None:
    """`init_checkpoint: RUN_DIR[:TAG]` (TAG: the run's `latest` when omitted) as (checkpoints dir, tag)."""
    value = config.get("init_checkpoint")
    if value is None:
        return None
    run, _, tag = str(value).partition(":")
    tag = tag or latest_checkpoint(Path(run))
    if not tag or not (Path(run) / "checkpoints" / tag).is_dir():
        raise ConfigError(f"init_checkpoint: {value}: no checkpoint {tag or '(latest)'} under "
                          f"{Path(run) / 'checkpoints'}")
    return Path(run) / "checkpoints", tag

