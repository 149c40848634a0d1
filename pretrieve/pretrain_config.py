"""Pre-training configs: the sections of a pre-training experiment beside the run level's (config.py), and the
checks across them.

A config has `seed`, `run_dir`, `resume`, `model:` (models.encoder.ModelOptions), `method:` (`name` + the
method's options, whose defaults are the paper settings), `data:` (DataOptions), `train:` (TrainOptions) and
`checkpoint:` (CheckpointOptions). `experiment(config)` validates all of it before any process group starts, and
reports every error it finds in one ConfigError (a user fixes a config in one round, not one key per run): each
section's own checks, and those across sections and files (the manifests against the method and the model, the
backbone against the method's attention, GradCache's chunk against the micro-batch).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pretrieve.config import (RUN_KEYS, RUN_SECTIONS, CheckpointOptions, RunExperiment, TrackingOptions, TrainOptions,
                              init_checkpoint_of, resume_of, run_sections, section, unknown_top_level)
from pretrieve.data.remote import ReadOptions, is_remote, local_path
from pretrieve.data.shard_check import CHECKS as SHARD_CHECKS
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.models.backbones import DECODER_LLMS, ENCODER_FAMILIES, backbone_named, backbone_of
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.speed_switches import CROSS_SECTION, check_switches, check_train
from pretrieve.pretrain_tokenizer import tokenizer_problems, training_tokenizer
from pretrieve.utils.options import ConfigError, Problems, options_of


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
    sections = problems.parse(run_sections, config, world_size, check_train)
    resume = problems.parse(resume_of, config)
    init_checkpoint = problems.parse(init_checkpoint_of, config)
    manifests = None
    if data is not None:
        _check_data(data, sections[0] if sections else None, problems)
        manifests = _read_manifests(data, problems)
        data.corpora = _corpus_names(data, manifests, problems)
    if model is not None and sections:  # the train keys that depend on the model and method
        check_switches(problems, CROSS_SECTION, train=sections[0], model=model, method=method, options=options)
    if model is not None:
        _check_model(model, options, data, manifests, problems)
        # the tokenizers are read once their folders are sound
        folders = ("model.init_from", "data.tokenizer")
        if data is not None and not any(message.startswith(folders) for message in problems.messages):
            for message in tokenizer_problems(data, model, manifests or {}):
                problems.add(message)
        if method is not None:
            _check_attention(model, method, options, problems)
        check_switches(problems, model=model, method=method, options=options)  # models/speed_switches.py
    if method is not None and data is not None:
        _check_data_kind(method, data, manifests or {}, problems)
    if options is not None and sections is not None:
        _check_grad_cache(options, sections[0], problems)
    problems.raise_any()
    config = OmegaConf.merge(config, {"data": {"corpora": data.corpora}})  # config.yaml names them: the model card
    # continued pre-training keeps the checkpoint's tokenizer (pretrain_tokenizer.py); set in the options, not in
    # config.yaml, so that a run from before the default resumes without a change of data.tokenizer
    if (tokenizer := training_tokenizer(data, model)).from_checkpoint:
        data.tokenizer = tokenizer.path
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
    elif model.init_from and not (Path(model.init_from) / "config.json").is_file():
        problems.add(f"model.init_from: {model.init_from} holds no config.json, so it is no HF model directory"
                     f"{_transformer_folder_hint(Path(model.init_from))}")
    if model.init_from:
        _check_checkpoint_positions(model, getattr(options, "max_len", None), problems)
        return
    try:
        backbone_named(model.backbone)
    except ValueError as e:
        problems.add(str(e))
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


def _transformer_folder_hint(path: Path) -> str:
    """Where a sentence-transformers folder that keeps its Transformer module in a subfolder (an older layout)
    holds the HF model, as a hint; "" when it is not one."""
    from pretrieve.models.st_config import MODULES_JSON

    try:
        modules = json.loads((path / MODULES_JSON).read_text(encoding="utf-8"))
        folder = next(m.get("path") for m in modules if str(m.get("type", "")).endswith(".Transformer"))
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return ""
    return f"; it is a sentence-transformers model whose transformer is in {path / folder}: give that folder" \
        if folder and (path / folder / "config.json").is_file() else ""


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
