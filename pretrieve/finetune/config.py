"""The fine-tuning config: `pretrieve finetune CONFIG [key=value ...]` reads it, finetune/run.py trains by it.

The config has the run keys of a pre-training config (`seed`, `run_dir`, `resume`, `train:`, `checkpoint:`,
`tracking:`: DeepSpeed ZeRO stages, precision, checkpoints, `resume=auto`, preemption and MLflow behave the
same) and a `finetune:` section (FinetuneOptions) in place of `model:` / `method:` / `data:`:

    finetune:
      init_from: runs/retromae/export     # a pretrieve export or any HF BERT directory
      model: dual                         # dual: the retriever (stages 1-3); cross: the stage-3 teacher
      loss: contrastive                   # contrastive (eqs. 13-14) | triplet (SEED) | distill (eq. 15)
      data: [train.jsonl]                 # JSON lines / text triples; or msmarco: / beir: + split + hard_negatives
      negatives: 7
      lora: {r: 16}                       # optional: LoRA adapters on the dual encoder's frozen base model

`pooling`, `normalize` and `passage_max_len` left out are what init_from says about itself (its
sentence-transformers config, else its pretrieve_finetune.json: eval.model_config), else cls, not normalised,
144 tokens; config.yaml in the run directory records the values used.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from omegaconf import DictConfig

from pretrieve.config import (RUN_KEYS, RUN_SECTIONS, CheckpointOptions, RunExperiment, TrainOptions, resume_of,
                              run_sections, section, unknown_top_level)
from pretrieve.models.speed_switches import check_train
from pretrieve.utils.options import Problems

FLOPS_WEIGHTS = (0.0015, 0.002)  # pooling sparse: (query, passage), LexMAE's stage 1 (lambda_d 0.002, ratio 0.75)


@dataclass
class FinetuneOptions:
    init_from: str = ""
    model: str = "dual"  # dual | cross
    loss: str = "contrastive"  # dual: contrastive | triplet | distill (cross: always group softmax)
    data: list[str] = field(default_factory=list)  # JSON-lines or text-triples files
    msmarco: str | None = None  # or: an MS MARCO folder (collection, queries.<split>.tsv, qrels.<split>.tsv)
    beir: str | None = None  # or: a BEIR folder with qrels/<split>.tsv
    split: str = "train"
    hard_negatives: str | None = None  # with msmarco / beir: query id<TAB>doc id,doc id,... lines
    negatives: int = 7  # negatives per query in each group (0: in-batch negatives only)
    in_batch: bool = True  # contrastive: the batch's other passages are negatives too (eq. 13's IB)
    cross_device: bool = True  # ... gathered from every rank
    temperature: float = 1.0
    normalize: bool | None = None  # cosine similarity instead of inner product (None: as init_from says, else off)
    # cls | mean | last | dupmae (eq. 12; init_from: a DupMAE model) | sparse (SPLADE vectors through the MLM head,
    # with the FLOPS regulariser: LexMAE's fine-tuning); None: init_from's
    pooling: str | None = None
    # sparse: the FLOPS regulariser's weights on the queries' and the passages' vectors (None: LexMAE's released
    # stage-1 values, FLOPS_WEIGHTS)
    flops_query: float | None = None
    flops_passage: float | None = None
    # sparse: the SPLADE vector's max runs over [CLS] and [SEP] too (SPLADE's released code); off: over the text's
    # own tokens, as LexMAE's released fine-tuning (`keep_special_tokens` off). Eval and mine read it from the
    # export's pretrieve_finetune.json
    sparse_special_tokens: bool = False
    # put before each query / passage (an instruction: E5-Mistral, Qwen3-Embedding); None: init_from's
    # sentence-transformers prompts, else none. The export carries them (sentence-transformers' prompts).
    # query_max_len counts the query's tokens after its prompt; passage_max_len counts the prompt too
    # (finetune/batches.py)
    query_prompt: str | None = None
    passage_prompt: str | None = None
    cls_dim: int | None = None  # dupmae: d' of eq. 10 (default 384, or the hidden size if smaller)
    ot_topk: int | None = None  # dupmae: k of eq. 11, entries a document keeps (default 384, or init_from's)
    margin: float = 1.0  # triplet loss margin
    text_experts: bool = True  # CoT-MoTE encoders: queries through the query experts
    query_max_len: int = 32
    passage_max_len: int | None = None  # None: init_from's maximum length, else PASSAGE_MAX_LENGTH
    on_missing: str = "fail"  # msmarco / beir qrels naming absent ids: fail | skip
    grad_cache: dict | None = None  # {chunk: N}: the dual encoder's texts N at a time, by GradCache
    # e.g. [768, 256, 64]: the dual encoder's loss summed over these prefixes of its vectors (models/matryoshka.py)
    matryoshka_dims: list[int] | None = None
    matryoshka_weights: list[float] | None = None  # one per dimension (default 1 each)
    # {r, alpha, dropout, targets, keep_adapter} (models/lora.py): LoRA adapters on the dual encoder's base model,
    # whose own weights stay frozen (a decoder LLM's usual fine-tuning: LLARA, E5-Mistral); null or r 0 alone:
    # every weight trains (r 0 beside other lora keys is refused: they would do nothing)
    lora: dict | None = None


@dataclass(kw_only=True)
class FinetuneExperiment(RunExperiment):
    """A fine-tuning experiment: the run settings and the `finetune:` section."""

    options: FinetuneOptions

    def section_classes(self, config: dict) -> dict[str, type]:
        return {"train": TrainOptions, "checkpoint": CheckpointOptions, "finetune": FinetuneOptions}


def finetune_experiment(config: DictConfig, world_size: int = 1) -> FinetuneExperiment:
    """The validated fine-tuning experiment; every error names its key, and all of them are reported at once."""
    problems = Problems()
    problems.parse(unknown_top_level, config, {*RUN_KEYS, *RUN_SECTIONS, "finetune"})
    options = section(config, "finetune", FinetuneOptions, problems)
    sections = problems.parse(run_sections, config, world_size, check_train)
    resume = problems.parse(resume_of, config)
    if options is not None:
        _check_options(options, problems)
        if sections is not None and options.model == "dual":
            _check_grad_cache(options, sections[0], problems)
        # the model is read once the options are sound; a folder that is no model is init_from's error
        if Path(options.init_from or "").is_dir() and options.model in ("dual", "cross") and not problems.messages:
            try:
                options, config = _with_model_encoding(options, config)  # reads init_from
            except ValueError as e:  # what init_from says about itself, or a key that does not fit it
                problems.add(str(e) if str(e).startswith("finetune.") else f"finetune.init_from: {e}")
            else:
                _check_encoding(options, problems)
                if not problems.messages:
                    _check_passage_prompt(options, problems)
                    _check_query_prompt(options, problems)
    problems.raise_any()
    train, checkpoint, tracking = sections
    return FinetuneExperiment(seed=int(config.get("seed", 42)), run_dir=Path(config.get("run_dir") or
                              f"runs/finetune-{options.model}"), resume=resume, train=train, checkpoint=checkpoint,
                              tracking=tracking, raw=config, options=options)


def _check_options(options: FinetuneOptions, problems: Problems) -> None:
    from pretrieve.finetune.models import LOSSES
    from pretrieve.models.grad_cache import grad_cache_of
    from pretrieve.models.matryoshka import matryoshka_of

    if not options.init_from or not Path(options.init_from).is_dir():
        problems.add(f"finetune.init_from: {options.init_from!r} is not a model directory")
    if options.model not in ("dual", "cross"):
        problems.add(f"finetune.model: {options.model!r} is not dual or cross")
    if sum([bool(options.data), options.msmarco is not None, options.beir is not None]) != 1:
        problems.add("finetune: give exactly one of data: [files], msmarco: DIR or beir: DIR")
    for i, path in enumerate(options.data):
        if not Path(path).is_file():
            problems.add(f"finetune.data[{i}]: {path} not found")
    if options.negatives < 0:
        problems.add(f"finetune.negatives: must be >= 0, got {options.negatives}")
    if options.query_max_len < 3:  # [CLS] ... [SEP] and at least one token
        problems.add(f"finetune.query_max_len: must be >= 3, got {options.query_max_len}")
    if options.temperature <= 0:
        problems.add(f"finetune.temperature: must be > 0, got {options.temperature}")
    if options.loss not in LOSSES:
        problems.add(f"finetune.loss: {options.loss!r} is not one of {', '.join(LOSSES)}")
    try:
        grad_cache_of(options.grad_cache, "finetune")
    except ValueError as e:
        problems.add(str(e))
    if options.grad_cache is not None and options.model != "dual":
        problems.add("finetune.grad_cache: for the dual encoder (model: dual); the cross-encoder scores pairs")
    try:
        matryoshka_of(options.matryoshka_dims, options.matryoshka_weights, "finetune")
    except ValueError as e:
        problems.add(str(e))
    if options.matryoshka_dims is not None and options.model != "dual":
        problems.add("finetune.matryoshka_dims: for the dual encoder (model: dual); the cross-encoder has no vectors")
    lora = problems.parse(lora_of, options)
    if lora is not None:
        from pretrieve.models.lora import settings_without_lora

        for message in settings_without_lora(options.lora, "finetune.lora"):
            problems.add(message)
    if lora is not None and lora.r and options.model != "dual":
        problems.add("finetune.lora: for the dual encoder (model: dual); the cross-encoder teacher trains whole")
    for key, ignored in (("pooling", options.pooling not in (None, "cls")), ("normalize", bool(options.normalize))):
        if options.model == "cross" and ignored:
            problems.add(f"finetune.{key}: {getattr(options, key)} is for the dual encoder's vectors; the cross-encoder "
                         f"scores a pair by a linear layer on its [CLS] state (leave {key} out)")
    if options.model == "cross" and options.loss != "contrastive":
        problems.add(f"finetune.loss: {options.loss} is for the dual encoder; the cross-encoder teacher "
                     "learns with the softmax over each group (leave loss at contrastive)")


def _check_grad_cache(options: FinetuneOptions, train: TrainOptions, problems: Problems) -> None:
    """The chunk must split the micro-batch's passages (B x (1 + negatives) texts, its largest group)."""
    from pretrieve.models.grad_cache import whole_batch_problem

    group = 1 + max(options.negatives, 0)
    rows = train.micro_batch_size * group
    try:
        problem = whole_batch_problem(options.grad_cache, "finetune", rows, f"the {rows} passages of a micro-batch "
                                      f"(train.micro_batch_size {train.micro_batch_size} x (1 + finetune.negatives "
                                      f"{group - 1}))")
    except ValueError:  # a malformed grad_cache: _check_options names it
        return
    if problem:
        problems.add(problem)


def lora_of(options: FinetuneOptions):
    """`finetune.lora` as LoraOptions (r 0: none); errors name their key."""
    from pretrieve.models.lora import lora_options

    return lora_options(options.lora or {}, "finetune.lora")


def _check_encoding(options: FinetuneOptions, problems: Problems) -> None:
    """Checks of the options as filled in from init_from (pooling, normalize, passage_max_len)."""
    from pretrieve.finetune.models import DUAL_POOLINGS, sparse_problems
    from pretrieve.models.encoder import token_head_missing

    if options.passage_max_len < 3:
        problems.add(f"finetune.passage_max_len: must be >= 3, got {options.passage_max_len}")
    if options.model == "dual" and options.pooling not in DUAL_POOLINGS:
        problems.add(f"finetune.pooling: {options.pooling!r} is not one of {', '.join(DUAL_POOLINGS)}")
    if options.pooling == "dupmae" and options.normalize:
        problems.add("finetune.normalize: pooling dupmae scores with eq. (12), an unnormalised inner product")
    if options.pooling == "dupmae" and options.matryoshka_dims is not None:
        problems.add("finetune.matryoshka_dims: pooling dupmae scores with eq. (12), dense and vocabulary parts "
                     "together, whose prefixes are no representation; give a dense pooling (cls, mean, last)")
    if options.pooling == "sparse":
        for message in sparse_problems(bool(options.normalize), options.matryoshka_dims is not None,
                                       not token_head_missing(options.init_from)):
            problems.add(message)
    for key in ("flops_query", "flops_passage"):
        value = getattr(options, key)
        if value is not None and (options.pooling != "sparse" or options.model != "dual"):
            problems.add(f"finetune.{key}: weighs pooling sparse's FLOPS regulariser; this run pools with "
                         f"{options.pooling} (give finetune.pooling: sparse, or drop the key)")
        elif value is not None and value < 0:
            problems.add(f"finetune.{key}: must be >= 0, got {value}")
    if options.sparse_special_tokens and (options.pooling != "sparse" or options.model != "dual"):
        problems.add(f"finetune.sparse_special_tokens: pools [CLS] and [SEP] into pooling sparse's vectors; this "
                     f"run pools with {options.pooling} (give finetune.pooling: sparse, or drop the key)")


def _check_passage_prompt(options: FinetuneOptions, problems: Problems) -> None:
    """A passage prompt must leave room for the passage in passage_max_len, which counts the prompt (the
    export's sentence-transformers max_seq_length; finetune/batches.py). query_max_len counts the query's own
    tokens, so a query prompt of any length leaves it its room."""
    if not options.passage_prompt:
        return
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(options.init_from)(options.passage_prompt)["input_ids"])
    if tokens >= options.passage_max_len:
        problems.add(f"finetune.passage_prompt: takes {tokens} tokens (the tokenizer's special ones included) of "
                     f"the {options.passage_max_len} of finetune.passage_max_len, which counts the prompt as the "
                     "export's max_seq_length does, and leaves none of a passage: raise finetune.passage_max_len, "
                     "or shorten the prompt")



def _check_query_prompt(options: FinetuneOptions, problems: Problems) -> None:
    """A query's row, its prompt and query_max_len of its own, must fit init_from's positions (the export's
    max_seq_length grows to it: export_max_length)."""
    from transformers import AutoTokenizer

    from pretrieve.eval.model_config import position_limit
    from pretrieve.finetune.batches import prompt_tokens

    limit = position_limit(options.init_from)
    if not options.query_prompt or limit is None:
        return
    tokens = prompt_tokens(AutoTokenizer.from_pretrained(options.init_from), options.query_prompt)
    if tokens + options.query_max_len > limit:
        problems.add(f"finetune.query_prompt: takes {tokens} tokens, which with the {options.query_max_len} of "
                     f"finetune.query_max_len (a query's own, after its prompt) pass the {limit} positions of "
                     f"{options.init_from}: shorten the prompt, or lower finetune.query_max_len")


def _with_model_encoding(options: FinetuneOptions, config: DictConfig) -> tuple[FinetuneOptions, DictConfig]:
    """The options with pooling, normalize and passage_max_len filled in (eval.model_config; for the
    cross-encoder: cls, off, PASSAGE_MAX_LENGTH), and the config recording them (config.yaml, the export)."""
    from omegaconf import OmegaConf

    from pretrieve.eval.model_config import resolve_encoding
    from pretrieve.finetune.mine import PASSAGE_MAX_LENGTH

    if options.model == "dual":
        encoding = resolve_encoding(options.init_from, options.pooling, options.normalize, options.passage_max_len,
                                    PASSAGE_MAX_LENGTH, query_prompt=options.query_prompt,
                                    passage_prompt=options.passage_prompt, pooling_key="finetune.pooling")
        filled = {"pooling": encoding.pooling, "normalize": encoding.normalize, "passage_max_len": encoding.max_length,
                  "query_prompt": encoding.query_prompt, "passage_prompt": encoding.passage_prompt}
    else:
        filled = {"pooling": options.pooling or "cls", "normalize": bool(options.normalize),
                  "passage_max_len": options.passage_max_len or PASSAGE_MAX_LENGTH,
                  "query_prompt": options.query_prompt or "", "passage_prompt": options.passage_prompt or ""}
    config = config.copy()
    for key, value in filled.items():
        OmegaConf.update(config, f"finetune.{key}", value)
    return replace(options, **filled), config


def flops_weights(o: FinetuneOptions) -> tuple[float, float]:
    """(query, passage) weights of the FLOPS regulariser: pooling sparse's given or default ones, else none."""
    if o.pooling != "sparse":
        return (0.0, 0.0)
    return tuple(FLOPS_WEIGHTS[i] if given is None else float(given)
                 for i, given in enumerate((o.flops_query, o.flops_passage)))


def resolved(o: FinetuneOptions) -> FinetuneOptions:
    """The options as the run trains with them: pooling sparse's FLOPS weights filled in (MLflow params, the
    export's pretrieve_finetune.json and card)."""
    if o.model != "dual" or o.pooling != "sparse":
        return o
    query, passage = flops_weights(o)
    return replace(o, flops_query=query, flops_passage=passage)
