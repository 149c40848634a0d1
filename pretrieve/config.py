"""Experiment configs: YAML files (configs/), dotted `key=value` overrides, validation naming the bad key.

A config has `seed`, `run_dir`, `resume`, `model:` (models.encoder.ModelOptions), `method:` (`name` + the
method's options, whose defaults are the paper settings), `data:` (DataOptions), `train:` (TrainOptions) and
`checkpoint:` (CheckpointOptions). `experiment(config)` validates all of it before any process group starts, and
reports every error it finds in one ConfigError (a user fixes a config in one round, not one key per run).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pretrieve.data.remote import ReadOptions, is_remote, local_path
from pretrieve.data.shard_check import CHECKS as SHARD_CHECKS
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.models.backbones import DECODER_LLMS, ENCODER_FAMILIES, UNPADDING, backbone_named, backbone_of
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.vocab_loss import vocab_loss_problem
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


def model_options(config: DictConfig, problems: Problems | None = None) -> ModelOptions:
    return options_of(ModelOptions, OmegaConf.to_container(config.model, resolve=True), "model", problems=problems)


def method_options(config: DictConfig) -> tuple[Any, Any]:
    """(registered Method, its options) from the `method:` section."""
    from pretrieve.models.heads import get_method

    values = OmegaConf.to_container(config.method, resolve=True)
    if "name" not in values:
        raise ConfigError("method.name: missing (one of the registered methods, e.g. retromae)")
    try:
        method = get_method(values["name"])
        return method, method.options_from(values)
    except ConfigError:
        raise
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(str(e).strip('"')) from e


DS_CONFIG_DIR = Path(__file__).resolve().parent.parent / "ds_configs"
# bf16-autocast: fp32 weights in the module, the forward under torch.autocast to bf16 (DeepSpeed's "torch_autocast"):
# no bf16 wrapper around the optimizer, whose per-parameter steps and checks cost a bf16 step half its speed on a GPU
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-autocast")
LR_SCHEDULES = ("linear", "cosine", "constant", "wsd")  # engine/lr_schedule.py
OPTIMIZERS = ("auto", "deepspeed", "torch-fused")  # engine/optimizer.py


@dataclass
class DataOptions:
    manifests: list[str] = field(default_factory=list)  # manifest.json files written by `pretrieve prepare`
    # the tokenizer directory the manifests were prepared with (default: the bundled bert-base-uncased WordPiece,
    # tokenizer_dir); masking takes its special tokens and word boundaries from it, and the export ships it
    tokenizer: str | None = None
    weights: list[float] | None = None  # mixture weights, one per manifest (default: by size)
    shuffle_buffer: int = 1000
    num_workers: int = 0
    # each micro-batch from one manifest (pair sources: in-batch negatives not off-topic by source alone)
    one_source_batches: bool = False
    # the corpus of each manifest, as the model card and MLflow's corpus_mix name them: by default each manifest's
    # `source` (its folder's name for a manifest at a URL); names given here label them instead, one per manifest
    corpora: list[str] | None = None
    validation: list[str] = field(default_factory=list)  # held-out manifests, never trained on (engine/validation.py)
    validation_batches: int = 8  # micro-batches per rank scored at each evaluation
    # manifests and shards at URLs (https://, s3://, gs://, file://, pipe:CMD; pretrieve/data/remote.py)
    retries: int = 5  # failed requests in a row retried, with exponential backoff and jitter, before an error
    timeout: float = 60.0  # seconds one request (one 8 MiB block) may take before it counts as failed
    prefetch_shards: int = 1  # shards each reader loads ahead in the background
    storage_options: dict = field(default_factory=dict)  # per URL scheme, fsspec options: {s3: {anon: true}}
    # before the run starts, each shard against its manifest: size (a stat or a request each), sha256 (reads every
    # shard whole), or none (data/shard_check.py); the stream verifies each shard's sha256 as it reads it anyway
    check_shards: str = "size"

    def tokenizer_dir(self) -> str:
        """The run's tokenizer: data.tokenizer, else the bundled one (the one place that default is applied, for
        the pad id, masking and the export alike)."""
        return self.tokenizer or DEFAULT_TOKENIZER


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
    offload_optimizer: bool = False  # ZeRO-Offload: optimizer states and step on the CPU (zero_stage >= 1)
    offload_params: bool = False  # ZeRO-Infinity: the parameters too, fetched layer by layer (zero_stage 3)
    max_runtime: float | None = None  # seconds of wall clock; then checkpoint and exit 85, as on SIGTERM
    # seconds deepspeed.initialize (joining the job) may take; then exit 86, which the SLURM launcher requeues:
    # a rank that dies while the process group forms leaves the others waiting in gloo / NCCL with no timeout
    startup_timeout: float | None = 1800.0
    deterministic: bool = False  # PyTorch's deterministic switches (engine/determinism.py): bit-exact GPU resumes
    peak_flops: float | None = None  # per device, FLOP/s at `precision`, for MFU; default: engine/flops.py's table


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


@dataclass(kw_only=True)
class Experiment(RunExperiment):
    """A pre-training experiment."""

    model: ModelOptions
    method: Any  # the registered Method
    options: Any  # its options
    data: DataOptions

    def section_classes(self, config: dict) -> dict[str, type]:
        classes = {**super().section_classes(config), "data": DataOptions, "model": ModelOptions}
        name = (config.get("method") or {}).get("name")
        if name:
            from pretrieve.models.heads import get_method

            classes["method"] = get_method(name).options
        return classes


# a pre-training config: these sections (each an options dataclass, but `method`, whose keys are the method's) and
# plain keys; unknown top-level keys are refused, and `pretrieve pretrain --help` lists both from here
RUN_SECTIONS = ("train", "checkpoint", "tracking")  # of every experiment (RunExperiment)
RUN_KEYS = ("seed", "run_dir", "resume", "resume_changes")
SECTIONS = ("model", "method", "data", *RUN_SECTIONS)
PLAIN_KEYS = (*RUN_KEYS, "init_checkpoint")


def section_keys(name: str) -> list[str]:
    """The keys of section `name`: its options' fields; for `method`, name and the registered methods."""
    from pretrieve.models.heads.registry import METHODS, get_method

    if name == "method":
        get_method("mlm")  # registers the built-in methods
        return [f"name ({' | '.join(METHODS)})", "and that method's options"]
    classes = {"model": ModelOptions, "data": DataOptions, "train": TrainOptions, "checkpoint": CheckpointOptions,
               "tracking": TrackingOptions}
    return [f.name for f in fields(classes[name])]


def section(config: DictConfig, name: str, cls, problems: Problems | None = None):
    """Section `name` of `config` as options `cls` (an absent section: all defaults). With `problems`, its errors
    are added there and the values that passed are kept, so that their checks still run (options_of)."""
    return options_of(cls, OmegaConf.to_container(config.get(name) or OmegaConf.create({}), resolve=True), name,
                      problems=problems)


def experiment(config: DictConfig, world_size: int = 1) -> Experiment:
    """The validated experiment; every error names its key, and all of them are reported at once."""
    problems = Problems()
    problems.parse(unknown_top_level, config, {*SECTIONS, *PLAIN_KEYS})
    settings_elsewhere(config, problems)
    model = model_options(config, problems)
    if isinstance(config.get("model"), DictConfig) and not any(m.startswith("model.lora") for m in problems.messages):
        from pretrieve.models.lora import settings_without_lora

        for message in settings_without_lora(OmegaConf.to_container(config.model, resolve=True).get("lora"),
                                             "model.lora"):
            problems.add(message)
    method, options = problems.parse(method_options, config) or (None, None)
    data = section(config, "data", DataOptions, problems)
    sections = problems.parse(run_sections, config, world_size)
    resume = problems.parse(resume_of, config)
    init_checkpoint = problems.parse(init_checkpoint_of, config)
    manifests = None
    if data is not None:
        _check_data(data, sections[0] if sections else None, problems)
        manifests = _read_manifests(data, problems)
        data.corpora = _corpus_names(data, manifests, problems)
    if model is not None:
        _check_model(model, options, data, manifests, problems)
        if method is not None:
            _check_attention(model, method, options, problems)
            _check_method_fit(model, method, options, problems)
    if method is not None and data is not None:
        _check_data_kind(method, data, manifests or {}, problems)
    if options is not None and sections is not None:
        _check_grad_cache(options, sections[0], problems)
    problems.raise_any()
    config = OmegaConf.merge(config, {"data": {"corpora": data.corpora}})  # config.yaml names them: the model card
    if model.pad_token_id is None and not model.init_from:  # the model pads as the shards do
        model.pad_token_id = _pad_token_id(data.tokenizer_dir())
    train, checkpoint, tracking = sections
    return Experiment(seed=int(config.get("seed", 42)), run_dir=Path(config.get("run_dir") or f"runs/{method.name}"),
                      resume=resume, train=train, checkpoint=checkpoint, tracking=tracking, raw=config,
                      init_checkpoint=init_checkpoint, model=model, method=method, options=options, data=data)


def _check_grad_cache(options: Any, train: TrainOptions, problems: Problems) -> None:
    """A GradCache chunk must split the micro-batch: its largest group is the pairs' negatives (B x negatives
    texts) when there are more than one a pair, else the B queries and the B passages; a method whose samples
    give several texts each (coCondenser's two spans) says how many in its options' `texts_per_sample`."""
    from pretrieve.models.grad_cache import whole_batch_problem

    if getattr(options, "grad_cache", None) is None:
        return
    negatives = getattr(options, "negatives", 0)
    per, why = (negatives, "method.negatives") if negatives > 1 else (getattr(options, "texts_per_sample", 1),
                                                                      "texts per sample")
    rows = train.micro_batch_size * per
    what = (f"the {rows} texts of the micro-batch's largest group (train.micro_batch_size "
            f"{train.micro_batch_size}{f' x {why} {per}' if per > 1 else ''})")
    try:
        problem = whole_batch_problem(options.grad_cache, "method", rows, what)
    except ValueError:  # a malformed grad_cache: the method's own check says so
        return
    if problem:
        problems.add(problem)


# keys a user may look for in the wrong section -> the key that holds the setting, and what it is
ELSEWHERE = {
    "model.decoder_attention": ("method.attention_impl", "auto | fused | sdpa | eager, the two-stream decoder's "
                                "attention of retromae and dupmae, beside method.decoder_attention_dropout"),
    "method.decoder_attention": ("method.attention_impl", "auto | fused | sdpa | eager"),
}


def settings_elsewhere(config: DictConfig, problems: Problems) -> None:
    """An ELSEWHERE key is an error naming the key that holds its setting (not just an unknown key)."""
    for key, (real, what) in ELSEWHERE.items():
        section, name = key.split(".")
        if isinstance(config.get(section), DictConfig) and name in config[section]:
            problems.add(f"{key}: this setting is {real} ({what})")
            problems.bad_keys.add(key)


def unknown_top_level(config: DictConfig, known: set[str]) -> None:
    problems = Problems()
    for key in sorted(set(config) - known):
        problems.add(f"{key}: unknown top-level key (known: {', '.join(sorted(known))})")
    problems.raise_any()


def _local_manifests(paths: list[str]) -> list[tuple[int, str]]:
    """(index, path) of the local manifests among `paths` (URLs are checked when opened)."""
    return [(i, path) for i, path in enumerate(paths) if not is_remote(path)]


def _read_manifests(data: DataOptions, problems: Problems) -> dict[int, dict]:
    """{index: content} of the local manifests of data.manifests that exist (a missing one is reported by
    _check_data); one that is not JSON is an error naming it."""
    read = {}
    for i, path in _local_manifests(data.manifests):
        file = Path(local_path(path))
        if file.is_file():
            try:
                content = json.loads(file.read_text(encoding="utf-8"))
            except (ValueError, OSError) as e:
                problems.add(f"data.manifests[{i}]: {file}: not a readable manifest ({e}); re-run `pretrieve "
                             "prepare`, or copy it again")
                continue
            read[i] = content if isinstance(content, dict) else {}
    return read


def _corpus_names(data: DataOptions, manifests: dict[int, dict], problems: Problems) -> list[str] | None:
    """data.corpora, one name per manifest; by default each manifest's own `source`, so that the model card and
    MLflow name the corpora the run reads, whatever the config file listed before its manifests were overridden."""
    if data.corpora is not None:
        if len(data.corpora) != len(data.manifests):
            problems.add(f"data.corpora: {len(data.corpora)} names ({', '.join(data.corpora)}) for "
                         f"{len(data.manifests)} manifests; name each manifest's corpus, or leave data.corpora out "
                         "(each manifest records its source)")
            return None
        return data.corpora
    return [str(manifests.get(i, {}).get("source") or PurePosixPath(str(path).rstrip("/")).parent.name
                or str(path)) for i, path in enumerate(data.manifests)]


def _check_data(data: DataOptions, train: TrainOptions | None, problems: Problems) -> None:
    if not data.manifests:
        problems.add("data.manifests: empty; list the manifest.json files written by `pretrieve prepare`")
    if data.tokenizer is not None and not Path(data.tokenizer).is_dir():
        problems.add(f"data.tokenizer: {data.tokenizer} is not a directory (the tokenizer the shards were prepared "
                     "with, e.g. one written by `pretrieve tokenizer train`)")
    for key in ("manifests", "validation"):
        for i, path in _local_manifests(getattr(data, key)):
            if not Path(local_path(path)).is_file():
                problems.add(f"data.{key}[{i}]: {path} not found (run `pretrieve prepare` first)")
    if train is not None and train.eval_every is not None and not data.validation:
        problems.add("train.eval_every: needs data.validation (held-out manifests to score)")
    if data.validation_batches < 1:
        problems.add(f"data.validation_batches: must be >= 1, got {data.validation_batches}")
    if data.weights is not None and len(data.weights) != len(data.manifests):
        problems.add(f"data.weights: {len(data.weights)} weights for {len(data.manifests)} manifests")
    if data.weights is not None and not (all(math.isfinite(w) and w >= 0 for w in data.weights) and sum(data.weights)):
        problems.add(f"data.weights: {data.weights}: each must be finite and >= 0, and one > 0")
    if data.check_shards not in SHARD_CHECKS:
        problems.add(f"data.check_shards: {data.check_shards!r} is not one of {', '.join(SHARD_CHECKS)}")
    if data.num_workers < 0 or data.shuffle_buffer < 1:
        problems.add(f"data.num_workers must be >= 0 and data.shuffle_buffer >= 1 (got {data.num_workers}, "
                     f"{data.shuffle_buffer})")
    try:
        ReadOptions.from_options(data)
    except ValueError as e:
        problems.add(f"data: {e}")


def _check_data_kind(method, data: DataOptions, manifests: dict[int, dict], problems: Problems) -> None:
    """The manifests hold what the method trains on: blocks of text (`kind` text, the default) or pairs.
    `manifests`: data.manifests as _read_manifests read them; the validation ones are read here."""
    wants = getattr(method.collator, "data_kind", "text")
    contents = {"manifests": manifests, "validation": {}}
    for i, path in _local_manifests(data.validation):
        try:
            contents["validation"][i] = json.loads(Path(local_path(path)).read_text())
        except (OSError, ValueError):
            continue  # a missing or damaged one is reported when the stream opens it
    for key, read in contents.items():
        for i, content in read.items():
            kind = content.get("kind", "text") if isinstance(content, dict) else "text"
            path = getattr(data, key)[i]
            if kind != wants:
                problems.add(f"data.{key}[{i}]: {path} holds {kind} shards, but method {method.name} trains on "
                             f"{wants}; give manifests of {wants} (`pretrieve prepare` writes both kinds)")


@functools.lru_cache(maxsize=8)  # `scale plan` builds a config per point, all with one tokenizer
def _pad_token_id(tokenizer: str) -> int:
    from pretrieve.data.tokenizer import load_tokenizer

    pad = load_tokenizer(tokenizer).pad_token_id
    if pad is None:
        raise ConfigError(f"data.tokenizer: {tokenizer} has no pad token; set model.pad_token_id")
    return pad


def _check_model(model: ModelOptions, options: Any, data: DataOptions | None, manifests: dict[int, dict] | None,
                 problems: Problems) -> None:
    if model.init_from and not Path(model.init_from).is_dir():
        problems.add(f"model.init_from: {model.init_from} is not a directory")
    if (problem := vocab_loss_problem(model.vocab_loss)) is not None:
        problems.add(problem)
    if model.init_from:
        _check_checkpoint_positions(model, getattr(options, "max_len", None), problems)
        return
    try:
        backbone = backbone_named(model.backbone)
    except ValueError as e:
        problems.add(str(e))
    else:
        if model.unpad and not backbone.unpads:
            problems.add(f"model.unpad: the {model.backbone} backbone has no unpadded path ({UNPADDING} have)")
    # an id past the embedding table fails steps later, deep in a CUDA or CPU kernel (remote manifests: not read)
    for i, manifest in (manifests or {}).items():
        vocab = (manifest.get("tokenizer") or {}).get("vocab_size", 0)
        if vocab > model.vocab_size:
            problems.add(f"model.vocab_size: {model.vocab_size}, but data.manifests[{i}] ({data.manifests[i]}) was "
                         f"tokenized with a vocabulary of {vocab}")
    max_len = getattr(options, "max_len", None)
    if max_len is not None and max_len > model.max_position_embeddings:
        problems.add(f"method.max_len: {max_len} positions, but model.max_position_embeddings is "
                     f"{model.max_position_embeddings}")


def _check_attention(model: ModelOptions, method, options: Any, problems: Problems) -> None:
    """A decoder LLM family (model.backbone, or init_from's) trains only under the heads made for it, causal or
    bidirectional as each needs (PretrainingHead.decoder_llms), and a causal one pools no first token."""
    try:
        backbone = backbone_of(_init_config(model.init_from)) if model.init_from else backbone_named(model.backbone)
    except (ValueError, OSError):
        return  # reported by _check_model
    where = f"model.init_from ({model.init_from}) is" if model.init_from else f"model.backbone: {model.backbone} is"
    allowed = method.head.decoder_llms
    if not backbone.causal:
        if allowed == "causal":
            problems.add(f"{where} an encoder family; method {method.name} adapts a decoder LLM ({DECODER_LLMS})")
        if model.bidirectional:
            problems.add(f"model.bidirectional: the {backbone.display_name} backbone attends both ways already "
                         f"(it applies to decoder LLMs: {DECODER_LLMS})")
        return
    if allowed is None:
        problems.add(f"{where} a decoder LLM; method {method.name} needs an encoder family ({ENCODER_FAMILIES})")
    elif allowed == "bidirectional" and not model.bidirectional:
        problems.add(f"{where} a causal decoder LLM; method {method.name} predicts from both sides: set "
                     "model.bidirectional: true")
    elif allowed == "causal" and model.bidirectional:
        problems.add(f"model.bidirectional: method {method.name} trains the LLM causal, as it was pre-trained "
                     "(its prompts' mask is its own): leave it false")
    if getattr(options, "pooling", None) == "cls" and not model.bidirectional:
        problems.add(f"method.pooling: cls on a causal {backbone.display_name} is its first token's state, which "
                     "sees nothing of the text after it (every text gets the same vector): use last or mean")


def _check_method_fit(model: ModelOptions, method, options: Any, problems: Problems) -> None:
    """Settings the method would ignore, or this machine cannot run: refused by key, not found at the first step."""
    from pretrieve.kernels import fused_problem

    if model.vocab_loss != "auto" and not method.head.predicts_tokens:
        problems.add(f"model.vocab_loss: {model.vocab_loss}, but method {method.name} computes no vocabulary loss "
                     "(it sets how the methods that predict tokens compute theirs): leave it out")
    if getattr(options, "attention_impl", None) == "fused" and (problem := fused_problem()) is not None:
        problems.add(problem)


def _init_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def _check_checkpoint_positions(model: ModelOptions, max_len: int | None, problems: Problems) -> None:
    """method.max_len against the learnt position table of the init_from checkpoint (grown by extend_positions):
    past it, the first step fails deep in an embedding lookup."""
    if max_len is None or not (Path(model.init_from) / "config.json").is_file():
        return
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model.init_from, local_files_only=True)
        backbone = backbone_of(config)
    except ValueError as e:
        problems.add(f"model.init_from: {model.init_from}: {e}")
        return
    offset = backbone.position_offset(config.pad_token_id)
    if offset is None:  # rotary positions: no table to run past
        return
    positions = model.extend_positions or config.max_position_embeddings - offset
    if max_len > positions:
        problems.add(f"method.max_len: {max_len} positions, but model.init_from ({model.init_from}) has {positions}; "
                     "grow it with model.extend_positions")


def run_sections(config: DictConfig, world_size: int) -> tuple[TrainOptions, CheckpointOptions, Any]:
    """The validated `train:`, `checkpoint:` and `tracking:` sections, shared by pre-training and fine-tuning."""
    problems = Problems()
    train = section(config, "train", TrainOptions, problems)
    checkpoint = section(config, "checkpoint", CheckpointOptions, problems)
    tracking = section(config, "tracking", TrackingOptions, problems)
    if train is not None:
        _check_train(train, world_size, problems)
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
    if train.optimizer not in OPTIMIZERS:
        problems.add(f"train.optimizer: {train.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if train.lr_schedule == "wsd" and not (0 < train.decay_ratio <= 1 - train.warmup_ratio):
        problems.add(f"train.decay_ratio: {train.decay_ratio} must be > 0 and leave room for the warm-up "
                     f"(<= 1 - warmup_ratio = {1 - train.warmup_ratio:g})")
    for key in ("max_runtime", "startup_timeout"):
        if getattr(train, key) is not None and not getattr(train, key) > 0:
            problems.add(f"train.{key}: must be > 0 seconds (or null), got {getattr(train, key)}")
    if train.peak_flops is not None and not train.peak_flops > 0:
        problems.add(f"train.peak_flops: must be > 0 FLOP/s per device, got {train.peak_flops}")
    if train.precision not in PRECISIONS:
        problems.add(f"train.precision: {train.precision!r} is not one of {', '.join(PRECISIONS)}")
    if train.zero_stage not in (0, 1, 2, 3):
        problems.add(f"train.zero_stage: {train.zero_stage} is not 0, 1, 2 or 3")
    if train.offload_optimizer and train.zero_stage == 0:
        problems.add("train.offload_optimizer: needs train.zero_stage 1, 2 or 3 (ZeRO-Offload)")
    if train.offload_params and train.zero_stage != 3:
        problems.add("train.offload_params: needs train.zero_stage 3 (only ZeRO 3 partitions the parameters)")
    if train.compile and train.zero_stage == 3:  # measured on CPU: the recompile limit hit at the first step
        problems.add("train.compile: ZeRO 3 gathers each layer's parameters by hooks inside it, on which "
                     "torch.compile recompiles layer after layer until its limit, then runs them eager; use "
                     "train.zero_stage 0, 1 or 2")
    if train.low_precision_norm and train.precision != "bf16-autocast":
        problems.add(f"train.low_precision_norm: changes only a train.precision bf16-autocast run (its norms run in "
                     f"fp32 there), not {train.precision}: set train.precision=bf16-autocast or remove it")
    if train.ds_config is not None and not Path(train.ds_config).is_file():
        problems.add(f"train.ds_config: {train.ds_config} not found")


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


def ds_config_path(train: TrainOptions) -> Path:
    """train.ds_config, or ds_configs/zero<train.zero_stage>.json."""
    return Path(train.ds_config) if train.ds_config else DS_CONFIG_DIR / f"zero{train.zero_stage}.json"


def deepspeed_config(exp: Experiment) -> dict:
    """The DeepSpeed JSON of the experiment with its "auto" fields filled from `train:`."""
    import json

    path = ds_config_path(exp.train)
    ds = json.loads(path.read_text())
    t = exp.train
    fill = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": t.grad_clip, "lr": t.lr, "weight_decay": t.weight_decay}

    def resolve_auto(node, parent=None):
        if isinstance(node, dict):
            for key, value in node.items():
                if value == "auto":
                    if key == "enabled":
                        node[key] = {"bf16": t.precision == "bf16", "fp16": t.precision == "fp16"}[parent]
                    elif key in fill:
                        node[key] = fill[key]
                    else:
                        raise ConfigError(f"{path}: no value for \"auto\" field {key!r}")
                else:
                    resolve_auto(value, key)
        return node

    ds = resolve_auto(ds)
    if "scheduler" in ds:  # DeepSpeed would silently prefer the engine's schedule over this one
        raise ConfigError(f"{path}: has a \"scheduler\" section; the lr schedule comes from train.lr_schedule, "
                          "train.lr and train.warmup_ratio (remove the section)")
    # a precision variant (ds_configs/zero2_bf16.json) must say what train.precision says; under autocast the
    # module's weights stay fp32
    enabled = [name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled", False)]
    if (enabled or ["fp32"]) != ["fp32" if t.precision == "bf16-autocast" else t.precision]:
        raise ConfigError(f"train.precision: {t.precision}, but {path} enables "
                          f"{' and '.join(enabled) or 'neither bf16 nor fp16'}; make them agree, or write "
                          '"auto" in its "enabled" fields')
    # torch autocast is train.precision's to say: a ds_config's own section would be overwritten or contradict it
    own = ds.get("torch_autocast", {})
    if own.get("enabled", False) and (t.precision != "bf16-autocast" or own.get("dtype", "bfloat16") != "bfloat16"):
        raise ConfigError(f"{path}: its \"torch_autocast\" section ({own}) is for train.precision bf16-autocast "
                          f"(bfloat16), not {t.precision}: remove it and set train.precision")
    if t.precision == "bf16-autocast":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if t.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # the configured torch AdamW steps on the CPU copy; DeepSpeedCPUAdam ("torch_adam": false) is faster on
        # GPU nodes but is a C++ op DeepSpeed compiles on first use
        ds["zero_force_ds_cpu_optimizer"] = False
    if t.offload_params:
        # page-locked host copies: asynchronous transfers to the GPU
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return ds
