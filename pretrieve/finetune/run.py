"""`pretrieve finetune CONFIG [key=value ...]`: fine-tune a pre-trained encoder on the pre-training engine, by
the config of finetune/config.py.

At the end run_dir/export holds the fine-tuned model: for `dual`, a HF model directory (its backbone's) that
`pretrieve eval` / `AutoModel` load (plus query experts for a CoT-MoTE encoder, W^cls and the LPU for pooling
`dupmae`, and `pretrieve_finetune.json` with the pooling it was trained with), which is also a
sentence-transformers model (models.st_config: its pooling and normalisation, texts cut at passage_max_len, or
at query_max_len plus the query prompt's tokens where that is more, so that a query keeps its own: export_max_length;
for pooling `dupmae` the dense part of eq. 12, [CLS] through W^cls); for `cross`, a
BertForSequenceClassification directory that `pretrieve teacher-scores` reads. Both get a model card
(eval.model_card). The stages are chained by files: `pretrieve mine` writes stage 2's hard negatives,
`pretrieve teacher-scores` stage 3's soft labels.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from pretrieve.config import section
from pretrieve.finetune.config import FinetuneExperiment, FinetuneOptions, flops_weights, lora_of, resolved
from pretrieve.models.encoder import FINETUNE_META

MODEL_CONFIG = "model_config.json"  # in the run directory: the architecture, for the export
TOKENIZER = "tokenizer"  # in the run directory


def export_max_length(options: FinetuneOptions, tokenizer) -> int:
    """The export's one maximum length (sentence-transformers' max_seq_length, and pretrieve_finetune.json's
    `max_length` for a model without those files, which `pretrieve eval` reads), counting the prompt: passage_max_len, or more where a query (query_max_len of its own after its prompt) needs
    it, so that no query is cut inside its prompt; passages are then read that far too."""
    from pretrieve.finetune.batches import prompt_tokens

    return max(options.passage_max_len, options.query_max_len + prompt_tokens(tokenizer, options.query_prompt or ""))


def load_examples(options: FinetuneOptions):
    from pretrieve.data.retrieval import load_retrieval_set
    from pretrieve.finetune.examples import examples_from_ids, read_all

    if options.data:
        return read_all(options.data)
    data = load_retrieval_set(options.beir, options.msmarco, options.split, options.on_missing)
    return examples_from_ids(data, options.hard_negatives)


def finetune(exp: FinetuneExperiment) -> dict:
    from pretrieve.engine.train import run_training

    return run_training(exp, _finetuning_job)


def _finetuning_job(exp: FinetuneExperiment, rank: int):
    import os

    from transformers import AutoTokenizer

    from pretrieve.engine.tracking import run_tags
    from pretrieve.engine.train import TrainingJob
    from pretrieve.finetune.batches import GroupLoader, PairLoader
    from pretrieve.engine.flops import with_backward
    from pretrieve.models.flops import layer_flops, vocab_flops
    from pretrieve.models.lora import adapter_shape, trained_summary
    from pretrieve.utils.run_dir import write_atomic

    o = exp.options
    tokenizer = AutoTokenizer.from_pretrained(o.init_from)
    module = build_model(o)
    config = module.encoder.config if o.model == "dual" else module.model.config
    adapters = adapter_shape(module.encoder.model) if o.model == "dual" else None
    if adapters is not None and rank == 0:
        print(trained_summary(module, adapters[0]), file=sys.stderr, flush=True)
    if rank == 0:
        config.to_json_file(exp.run_dir / MODEL_CONFIG)
        write_atomic(exp.run_dir / FINETUNE_META, json.dumps(_meta(module, o), indent=1) + "\n")
        tokenizer.save_pretrained(str(exp.run_dir / TOKENIZER))  # the export's, even if init_from moves
    loader_class = GroupLoader if o.model == "dual" else PairLoader
    loader = loader_class(load_examples(o), tokenizer, exp.train.micro_batch_size, o.negatives, o.query_max_len,
                          o.passage_max_len, exp.seed, rank, int(os.environ.get("WORLD_SIZE", 1)),
                          teacher_scores=o.model == "dual" and o.loss == "distill",
                          prompts=(o.query_prompt or "", o.passage_prompt or ""))

    def count(batch: dict) -> tuple[int, int, int]:  # (queries, non-padding tokens, positions)
        masks = [v for k, v in batch.items() if k.endswith("attention_mask")]
        queries = len(masks[0]) // (1 + o.negatives) if o.model == "cross" else len(masks[0])
        return queries, int(sum(m.sum() for m in masks)), sum(m.numel() for m in masks)

    def flops(batch: dict) -> int:  # engine.flops' forward + backward over every text of the batch
        total = 0
        for key, ids in batch.items():
            if key.endswith("input_ids"):
                forward = config.num_hidden_layers * layer_flops(config, ids.shape[0], ids.shape[1], ids.shape[1])
                if o.model == "dual" and o.pooling == "sparse":  # the MLM head at every position
                    forward += vocab_flops(config, ids.numel())
                if o.model == "dual" and o.pooling == "dupmae":  # eq. (6)'s LPU at every position
                    forward += (vocab_flops(config, ids.numel()) if module.joint.lpu is None  # MLM head: + transform
                                else 2 * ids.numel() * config.hidden_size * config.vocab_size)
                total += with_backward(forward, config, {"input_ids": ids}, adapters)
        return total

    tags = {**run_tags(f"finetune-{o.model}", None, config), "stage_loss": o.loss, "init_from": str(o.init_from)}
    return TrainingJob(name=f"finetune {o.loss}" if o.model == "dual" else "finetune teacher", module=module,
                       loader=loader, position=loader, count=count, flops=flops,
                       export=lambda run_dir: export_finetuned(run_dir, run_dir / "export", overwrite=True), tags=tags,
                       resolved={"finetune": asdict(resolved(o))})


def build_model(o: FinetuneOptions, config_file: Path | None = None):
    """The module fine-tuning trains: from `o.init_from`'s weights, or (for the export) the architecture in
    `config_file` with fresh weights that the checkpoint then overwrites."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from pretrieve.finetune.models import CrossEncoder, DualEncoder
    from pretrieve.models.encoder import Encoder, check_weights, load_encoder
    from pretrieve.models.lora import add_lora
    from pretrieve.models.matryoshka import matryoshka_of
    from pretrieve.models.representation import JointRepresentation, load_joint

    if o.model == "cross":
        if config_file is not None:
            model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(str(config_file)))
        else:
            check_weights(o.init_from)
            model = AutoModelForSequenceClassification.from_pretrained(o.init_from, num_labels=1,
                                                                       local_files_only=True)
        return CrossEncoder(model, group_size=1 + o.negatives)
    joint = None
    if config_file is not None:
        encoder = Encoder.from_config_file(config_file)
        meta = json.loads((config_file.parent / FINETUNE_META).read_text())
        if meta.get("query_experts"):
            encoder.add_query_experts()
        if o.pooling == "dupmae":
            spec = meta["joint"]
            joint = JointRepresentation(encoder.config.hidden_size, spec["cls_dim"], spec["ot_topk"],
                                        lpu_vocab=encoder.config.vocab_size if spec["lpu"] == "linear" else None)
    else:
        encoder = load_encoder(o.init_from)
        if o.pooling == "dupmae":
            joint = load_joint(o.init_from, encoder, o.cls_dim, o.ot_topk)
    dual = DualEncoder(encoder, loss=o.loss, pooling=o.pooling, normalize=o.normalize, temperature=o.temperature,
                       in_batch=o.in_batch, cross_device=o.cross_device, margin=o.margin, text_experts=o.text_experts,
                       joint=joint, grad_cache=o.grad_cache["chunk"] if o.grad_cache else None,
                       matryoshka=matryoshka_of(o.matryoshka_dims, o.matryoshka_weights, "finetune"),
                       flops=flops_weights(o), sparse_special_tokens=o.sparse_special_tokens)
    lora = lora_of(o)
    if lora.r:  # the base model's layers only: DupMAE's W^cls and LPU, CoT-MoTE's query experts train whole
        add_lora(dual.encoder.model, lora, "finetune.lora")
    return dual




def _meta(module, o: FinetuneOptions) -> dict:
    from pretrieve import __version__

    meta = {"model": o.model, "loss": o.loss, "pooling": o.pooling, "normalize": o.normalize,
            "temperature": o.temperature, "init_from": str(o.init_from), "pretrieve_version": __version__}
    if o.model == "dual":
        meta["query_experts"] = module.encoder.query_experts is not None
        meta["text_experts"] = module.routed
        if module.sparse:
            meta["flops"] = dict(zip(("query", "passage"), module.flops))
            meta["sparse_special_tokens"] = module.sparse_special_tokens
        if module.joint is not None:
            meta["joint"] = {"cls_dim": module.joint.cls_dim, "ot_topk": module.joint.ot_topk,
                             "lpu": "mlm_head" if module.joint.lpu is None else "linear"}
    return meta


def export_finetuned(run_dir: str | Path, out: str | Path, keep_adapter: bool | None = None,
                     overwrite: bool = False) -> Path:
    """The latest checkpoint of a fine-tuning run (or the checkpoint `run_dir` names) as a model directory (see
    the module docstring). LoRA adapters are merged, or written apart with `keep_adapter` (None: as the run's
    finetune.lora.keep_adapter says). OUT may be new, empty, or an earlier export that `overwrite` replaces."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from pretrieve.engine.checkpoint import load_checkpoint_weights
    from pretrieve.eval.model_card import write_model_card
    from pretrieve.finetune.mine import PASSAGE_MAX_LENGTH
    from pretrieve.models.encoder import HEAD_WEIGHTS
    from pretrieve.models.export import check_export_folder, save_base_model, write_model_code
    from pretrieve.models.heads.base import ENCODER_MODEL
    from pretrieve.models.lora import unadapt_for_saving
    from pretrieve.models.st_config import write_st_config
    from pretrieve.utils.output_folder import replace_directory, staging_folder
    from pretrieve.utils.run_dir import locate

    run_dir, ckpt_dir, tag = locate(Path(run_dir))
    check_export_folder(out, overwrite)
    meta = json.loads((run_dir / FINETUNE_META).read_text())
    options = section(OmegaConf.load(run_dir / "config.yaml"), "finetune", FinetuneOptions)
    # config.yaml of a run started before it recorded them: what the run trained with, and the old default length
    options = resolved(replace(options, pooling=options.pooling or meta["pooling"],
                               normalize=meta["normalize"] if options.normalize is None else options.normalize,
                               passage_max_len=options.passage_max_len or PASSAGE_MAX_LENGTH))
    if keep_adapter and (options.model == "cross" or not lora_of(options).r):
        from pretrieve.models.lora import no_adapter

        raise ValueError(no_adapter(run_dir, "finetune.lora"))
    module = build_model(options, config_file=run_dir / MODEL_CONFIG)
    load_checkpoint_weights(module, ckpt_dir, tag)
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / TOKENIZER))
    out = Path(out)
    tmp = staging_folder(out)
    if options.model == "cross":
        module.model.save_pretrained(str(tmp))
    else:
        unadapt_for_saving(module.encoder.model, tmp, lora_of(options).keep_adapter if keep_adapter is None
                           else keep_adapter)
        save_base_model(module.encoder, tmp)  # with the MLM head, which pooling sparse and dupmae read
        write_model_code(tmp, module.encoder.model)
        # MLM head, query experts (`load_encoder` reads them back), W^cls and LPU (`load_joint`)
        extra = {k: v.detach().contiguous() for k, v in module.state_dict().items()
                 if not k.startswith(ENCODER_MODEL)}
        save_file(extra, str(tmp / HEAD_WEIGHTS))
        dupmae = options.pooling == "dupmae"  # sentence-transformers gets eq. 12's dense part: [CLS] through W^cls
        # no sentence-transformers files for a sparse model: they describe a dense vector;
        # pretrieve_finetune.json says it, and AutoModelForMaskedLM reads the MLM head its vectors come from
        if options.pooling != "sparse":
            write_st_config(tmp, "cls" if dupmae else options.pooling, options.normalize,
                            export_max_length(options, tokenizer),
                            dense_weight=module.joint.cls_proj.weight if dupmae else None,
                            prompts={"query": options.query_prompt or "", "passage": options.passage_prompt or ""},
                            matryoshka_dims=options.matryoshka_dims)
    tokenizer.save_pretrained(str(tmp))
    (tmp / FINETUNE_META).write_text(json.dumps({**meta, "checkpoint": tag, "max_length": export_max_length(
        options, tokenizer), "options": asdict(options)}, indent=1) + "\n")
    write_model_card(out, run_dir, tag, card_dir=tmp)
    return replace_directory(tmp, out)
