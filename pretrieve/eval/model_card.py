"""The model card (`README.md`, Hugging Face Hub format) of an export, generated from its run directory.

YAML metadata (library, pipeline tag, tags, base model, datasets, and the farm's evaluations of this model as
`model-index` results), then how to use it, what it is (method and options, size, data, tokens and samples
seen, steps, batch, precision, final and validation losses, the MLflow run) and every evaluation the farm has
logged for it. The export writes the card before any evaluation exists; `pretrieve card RUN_DIR` and the
farm (after logging an evaluation of a run's export) write it again with them.

Sources: the run's config.yaml, metrics.jsonl (the last training record; the last `val_*` record), run.json
(the MLflow run and store), the checkpoint's counters (tokens and samples seen) and the export itself
(config.json, weights, pretrieve_head.json / pretrieve_finetune.json, sentence-transformers files). MTEB's scores
(`pretrieve eval --mteb`, logged by the farm or `pretrieve track`) are marked as such, and named `MTEB <task>` in
`model-index`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.eval.prompt_pooling import LLAMA2VEC_METHODS
from pretrieve.models.backbones import BACKBONES
from pretrieve.models.encoder import FINETUNE_META, HEAD_WEIGHTS
from pretrieve.models.st_config import read_st_config
from pretrieve.utils.metric_names import metric_name
from pretrieve.utils.run_dir import latest_checkpoint, step_of, write_atomic

CARD = "README.md"
GENERATED = "<!-- written by pretrieve from the run directory; `pretrieve card RUN_DIR` writes it again -->"
CARD_METRICS = ("ndcg@10", "mrr@10", "recall@100", "recall@1000", "map")  # the card's evaluation columns
_NOT_LOSSES = {"step", "lr", "tokens_per_s", "samples_per_s", "tflops_per_device", "mfu", "grad_norm", "loss_scale"}


def write_model_card(model_dir: str | Path, run_dir: str | Path, tag: str | None = None,
                     tracking_uri: str | None = None, card_dir: str | Path | None = None) -> Path:
    """Write `model_dir`/README.md (or into `card_dir`: an export's temporary directory, with the export's final
    path as `model_dir`) for checkpoint `tag` of `run_dir` (default: the one a fine-tuned export names, else the
    latest), with the evaluations logged in `tracking_uri` (None: none looked up)."""
    from pretrieve.eval.report import evaluations_of

    run_dir, model_dir = Path(run_dir), Path(model_dir)
    files = Path(card_dir) if card_dir is not None else model_dir
    evaluations = []
    if tracking_uri:
        evaluations = evaluations_of(tracking_uri, model_dir, _read_json(run_dir / "run.json").get("run_id"))
    path = files / CARD
    write_atomic(path, model_card(model_dir, run_dir, tag, evaluations, files=files))
    return path


def has_generated_card(model_dir: str | Path) -> bool:
    """Whether `model_dir`/README.md is a card pretrieve wrote (and may write again)."""
    card = Path(model_dir) / CARD
    return card.is_file() and GENERATED in card.read_text(encoding="utf-8", errors="replace")


def refresh_card(run_dir: str | Path, tracking_uri: str | None = None) -> Path:
    """`pretrieve card RUN_DIR`: write RUN_DIR/export/README.md again, with the evaluations in `tracking_uri`
    (default: the run's own MLflow store, from run.json)."""
    run_dir = Path(run_dir)
    export = run_dir / "export"
    if not (export / "config.json").is_file():
        raise FileNotFoundError(f"{export}: no export (a run writes it when its training finishes)")
    uri = tracking_uri or _read_json(run_dir / "run.json").get("tracking_uri")
    return write_model_card(export, run_dir, tracking_uri=uri)


def model_card(model_dir: Path, run_dir: Path, tag: str | None = None, evaluations: list[dict] = (),
               files: Path | None = None) -> str:
    """The card's text (see the module docstring) of the export at `model_dir`, whose files are in `files`
    (default: `model_dir`)."""
    import yaml
    from omegaconf import OmegaConf

    model_dir, run_dir = Path(model_dir), Path(run_dir)
    files = Path(files) if files is not None else model_dir
    raw = OmegaConf.load(run_dir / "config.yaml")
    config = OmegaConf.to_container(raw, resolve=True)
    tag = tag or _read_json(files / FINETUNE_META).get("checkpoint") or latest_checkpoint(run_dir)
    facts = _finetuning_facts(files, config) if "finetune" in config else _pretraining_facts(files, config)
    name = run_dir.name
    st = read_st_config(files)
    sparse = _read_json(files / FINETUNE_META).get("pooling") == "sparse"
    own = [e for e in evaluations if e["this_model"] and e.get("dim") is None]  # whole vectors: model-index
    meta = {"library_name": "sentence-transformers" if st else "transformers",
            "pipeline_tag": "sentence-similarity" if st else "feature-extraction" if sparse else "text-classification",
            "tags": [*(["sentence-transformers", "feature-extraction", "sentence-similarity"] if st else []),
                     "pretrieve", facts["tag"]],
            **({"base_model": facts["base_model"]} if facts["base_model"] else {}),
            "datasets": facts["datasets"]}
    if own:
        meta["model-index"] = [{"name": name, "results": [_model_index_result(e) for e in own]}]
    header = ["---", yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(), "---", GENERATED]
    training = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in _training_rows(run_dir, files, raw, tag, facts)),
                "", f"{facts['options_title']}:", "", "```yaml",
                yaml.safe_dump(facts["options"], sort_keys=False).rstrip(), "```"]
    lines = [*header, "", f"# {name}", "", facts["summary"], "", "## Use", "",
             *(_sparse_usage(model_dir) if sparse else _usage(model_dir, files, st)), "",
             "## Training", "", *training, "", "## Evaluation", "", *_evaluation_lines(evaluations, run_dir)]
    return "\n".join(lines) + "\n"


def _pretraining_facts(model_dir: Path, config: dict) -> dict:
    from pretrieve.models.export import export_meta

    head = export_meta(model_dir)
    method = head.get("method") or config.get("method", {}).get("name", "unknown")
    data = config.get("data", {})
    datasets = _dataset_names(data)
    dense = ("" if method != "dupmae" else " DupMAE's joint representation (eq. 12) adds a vocabulary part to "
             "this [CLS] vector: sentence-transformers gets the dense part only, `pretrieve eval --pooling "
             "dupmae` both.")
    if method in LLAMA2VEC_METHODS:  # what each loader pools, said plainly: only pretrieve applies the prompts
        dense = (" The model was trained to be read through its prompts (Llama2Vec: the text, then the prompt, "
                 "the mean of the prompt's special states): `pretrieve eval --model DIR --pooling llama2vec` "
                 "reads it so. sentence-transformers and the plain last-token pooling of `pretrieve eval` read "
                 "the text's last token without the prompts, which the model was not trained for.")
    st = read_st_config(model_dir)
    vector = {"cls": "[CLS] vector", "last": "last token's state", "mean": "mean token state"}.get(st.pooling,
                                                                                                  "pooled vector")
    norm = "normalised (cosine)" if st.normalize else "not normalised (inner product)"
    summary = f"its {vector} is the text's representation, {norm}.{dense}"
    if _eval_pooling(method) == "sparse":  # the method trains its MLM head's vocabulary vector, not the [CLS] one
        summary = ("its representation is the SPLADE vector of its MLM head (the max over a text's tokens of "
                   "log(1 + relu(MLM logits))): `pretrieve eval --pooling sparse` scores it, `pretrieve finetune` "
                   "trains it with `finetune.pooling: sparse`, and `AutoModelForMaskedLM` loads the head. "
                   f"sentence-transformers, and `pretrieve eval` without `--pooling`, read its {vector} ({norm}), "
                   f"which {method} does not train as a representation.")
    return {"tag": method, "base_model": config.get("model", {}).get("init_from"), "datasets": datasets,
            "summary": f"A {_family(model_dir)} encoder pre-trained with **{method}** by pretrieve; {summary}"
                       f"{_lora_note(model_dir, config.get('model', {}).get('lora') or {})}",
            "method": f"pre-training, {method}", "options_title": f"Method options ({method})",
            "options": head.get("options") or config.get("method", {}), "data": _data_sources(data),
            "samples": "pairs" if method == "contrastive" else "samples (token blocks)"}


def _eval_pooling(method: str) -> str | None:
    """The pooling `method`'s export is evaluated with, where the registry names one (heads.registry)."""
    from pretrieve.models.heads import METHODS

    return METHODS[method].eval_pooling if method in METHODS else None


def _lora_note(model_dir: Path, lora: dict) -> str:
    """A sentence on LoRA training (model.lora, finetune.lora), where the adapters went."""
    from pretrieve.models.lora import ADAPTER_DIR, LoraOptions

    if not lora.get("r"):
        return ""
    where = (f"kept apart in `{ADAPTER_DIR}/` (peft's files; these weights are the frozen base model's)"
             if (model_dir / ADAPTER_DIR).is_dir() else "merged into these weights")
    alpha = lora.get("alpha", LoraOptions.alpha)
    return f" Trained with LoRA (r {lora['r']}, alpha {alpha:g}) on a frozen base model; the adapters are {where}."


def _family(model_dir: Path) -> str:
    """The exported base model's family, as its config.json names it."""
    model_type = _read_json(model_dir / "config.json").get("model_type", "")
    names = {backbone.model_type: backbone.display_name for backbone in BACKBONES.values()}
    return names.get(model_type, model_type or "transformer")


def _finetuning_facts(model_dir: Path, config: dict) -> dict:
    meta = _read_json(model_dir / FINETUNE_META)
    options = meta.get("options") or config["finetune"]
    data = [Path(p).name for p in options.get("data") or []] + \
        [Path(options[k]).name for k in ("beir", "msmarco") if options.get(k)]
    if meta.get("model") == "cross":
        summary = (f"A {_family(model_dir)} cross-encoder (one relevance logit per query-passage pair) fine-tuned by "
                   "pretrieve as a distillation teacher; load it with `AutoModelForSequenceClassification`.")
    else:
        pooling = meta.get("pooling", options.get("pooling"))
        norm = "normalised (cosine)" if meta.get("normalize") else "not normalised (inner product)"
        summary = f"A dense retriever fine-tuned by pretrieve ({meta.get('loss')} loss): {pooling} pooling, {norm}."
        if pooling == "sparse":
            weights = meta.get("flops", {})
            summary = (f"A learned sparse retriever fine-tuned by pretrieve ({meta.get('loss')} loss): SPLADE vectors "
                       "over the vocabulary through its MLM head, trained with the FLOPS regulariser (queries "
                       f"{weights.get('query')}, passages {weights.get('passage')}).")
        if pooling == "dupmae":
            summary += (" It scores with DupMAE's joint representation (eq. 12): sentence-transformers gets the "
                        "dense part only (the [CLS] vector through the learned W^cls), `pretrieve eval` both.")
        summary += _lora_note(model_dir, options.get("lora") or {})
    return {"tag": f"finetune-{meta.get('model', 'dual')}", "base_model": options.get("init_from"),
            "datasets": data, "summary": summary,
            "method": f"fine-tuning, {meta.get('loss', options.get('loss'))} loss from {options.get('init_from')}",
            "options_title": "Fine-tuning options", "options": options, "data": ", ".join(data),
            "samples": "queries (each with its passages)"}


def _sparse_usage(model_dir: Path) -> list[str]:
    return ["```bash", f"pretrieve eval --model {model_dir} --beir DIR --out OUT",
            f"pretrieve mine --model {model_dir} --msmarco DIR --out hard.jsonl", "```", "",
            "pretrieve reads pooling sparse from `pretrieve_finetune.json` and searches through an inverted index. "
            "The directory has no sentence-transformers files (they describe a dense vector); "
            "`AutoModelForMaskedLM.from_pretrained` loads the backbone with the MLM head the vectors come from "
            "(max over a text's tokens of log(1 + relu(logits)))."]


def _usage(model_dir: Path, files: Path, st) -> list[str]:
    if st is None:
        return ["```python", "from transformers import AutoModelForSequenceClassification", "",
                f'model = AutoModelForSequenceClassification.from_pretrained("{model_dir}")  # one logit per pair',
                "```"]
    from pretrieve.eval.encode import has_query_experts
    from pretrieve.models.hf_model_code import ADAPTER_DIR, CODE_FILE

    # a prompt name only where the directory names that prompt: encode() refuses a name it does not know
    prompt_names = {name: f', prompt_name="{name}"' if name in st.prompts else "" for name in ("query", "passage")}
    plural = {"query": "queries", "passage": "passages"}
    encode = [f'{plural[name]} = model.encode(["a {name}"]{prompt})' for name, prompt in prompt_names.items()]
    prompts = "".join(f" The {name} prompt, put before each {name}: `{text!r}`." for name, text in st.prompts.items())
    own_code = (files / CODE_FILE).is_file()
    lines = ["```python", "from sentence_transformers import SentenceTransformer", "",
             f'model = SentenceTransformer("{model_dir}"{", trust_remote_code=True" if own_code else ""})', *encode,
             "```", "",
             f"sentence-transformers reads {st.pooling} pooling{', a Dense layer' if st.dense else ''}"
             f"{', normalisation' if st.normalize else ''} and at most {st.max_length} tokens from this directory "
             f"(`modules.json`); `pretrieve eval --model {model_dir} ...` "
             f"{'scores with eq. (12) (pretrieve_finetune.json)' if st.dense else 'reads the same'}.{prompts}"]
    if st.matryoshka_dims:
        dims = ", ".join(map(str, st.matryoshka_dims))
        after = ("after normalising, so the cut vectors are not unit length: pass `normalize_embeddings=True` to "
                 "`encode` (or score with `model.similarity`, cosine) for the vectors pretrieve searches"
                 if st.normalize else "as they are; their inner products are what pretrieve scores")
        lines.append(f"Trained at the Matryoshka dimensions {dims}: `SentenceTransformer(\"{model_dir}\", "
                     f"truncate_dim=N)` keeps each vector's first N coordinates (`pretrieve eval --dim N`). It cuts "
                     f"them {after}.")
    if own_code:
        config = _read_json(files / "config.json")
        what = [*(["attends in both directions as trained"] if config.get("bidirectional") else []),
                *([f"folds in the LoRA adapter of `{ADAPTER_DIR}/` (needs peft)"]
                  if (files / ADAPTER_DIR).is_dir() else [])]
        lines.append(f"The directory carries its own model class (`{CODE_FILE}`, named in config.json's auto_map), "
                     f"which {' and '.join(what)}: load it with `trust_remote_code=True` (also "
                     "`AutoModel.from_pretrained`); without it, the library's own class encodes otherwise than "
                     "the model was trained.")
    if has_query_experts(files):
        lines.append("Queries and passages go through different experts in pretrieve (CoT-MoTE); "
                     "sentence-transformers encodes every text with the passage experts.")
    return lines


def _training_rows(run_dir: Path, model_dir: Path, config, tag: str | None, facts: dict) -> list[tuple]:
    from pretrieve.config import TrainOptions, section

    train = section(config, "train", TrainOptions)
    encoder = _read_json(model_dir / "config.json")
    counters, world = _checkpoint_counters(run_dir, tag)
    final, validation = _last_losses(run_dir / "metrics.jsonl")
    sizes = _parameter_counts(model_dir)
    run = _read_json(run_dir / "run.json")
    rows = [("method", facts["method"]),
            ("architecture", f"{_family(model_dir)}, {encoder.get('num_hidden_layers')} layer(s), hidden "
                             f"{encoder.get('hidden_size')}, "
                             f"{encoder.get('num_attention_heads')} heads, vocabulary {encoder.get('vocab_size')}"),
            ("parameters", f"{sizes['encoder']:,} in the encoder ({sizes['embeddings']:,} of them embeddings)"
                           + (f"; {sizes['head']:,} more beside it ({HEAD_WEIGHTS})" if sizes["head"] else "")),
            ("data", facts["data"] or "–"),
            ("tokens seen", f"{counters['tokens']:,} (non-padding)" if counters else "–"),
            (f"{facts['samples']} seen", f"{counters['samples']:,}" if counters else "–"),
            ("steps", f"{_step(tag, final):,} of {train.max_steps:,} (checkpoint {tag})"),
            ("batch", f"{train.micro_batch_size} per rank x {train.grad_accum} accumulation"
                      + (f" x {world} rank{'s' if world > 1 else ''}" if world else "")),
            ("precision", f"{train.precision}, ZeRO stage {train.zero_stage}"),
            ("learning rate", f"{train.lr:g} peak, {train.lr_schedule}, warm-up {train.warmup_ratio:g}"),
            ("final loss", _losses_text(final)),
            ("validation loss", _losses_text(validation) if validation else "not measured"),
            ("MLflow run", f"`{run['run_id']}` in {run.get('tracking_uri')}" if run.get("run_id") else "–")]
    return rows


def _evaluation_lines(evaluations: list[dict], run_dir: Path) -> list[str]:
    if not evaluations:
        return [f"No evaluation logged yet. `pretrieve card {run_dir}` writes this card again with those the farm "
                "(or `pretrieve track`) has logged since (the farm does it itself after evaluating this export)."]
    shown = [m for m in CARD_METRICS if any(metric_name(m) in e["metrics"] for e in evaluations)]
    mteb = (" (MTEB): scored by the mteb package (`pretrieve eval --mteb`), MTEB's own result files beside "
            "the evaluation" if any(e.get("mteb") for e in evaluations) else "")
    loggers = " and ".join(f"`{name}`" for name in sorted({e.get("logged_by", "pretrieve farm") for e in evaluations}))
    cut = (" A dimension: the vectors' first N coordinates searched (a farm's `dims:`, `pretrieve eval --dim`)."
           if any(e.get("dim") for e in evaluations) else "")
    lines = [f"Logged by {loggers} (the latest run of each dataset and stage; zero-shot: this model as it "
             f"is, stage1-3: this model after the farm's fine-tuning stages){mteb}.{cut}", "",
             "| dataset | split | stage | " + " | ".join(shown) + " | MLflow run |",
             "|---|---|---|" + "---|" * len(shown) + "---|"]
    for e in evaluations:
        values = [e["metrics"].get(metric_name(m)) for m in shown]
        stage = e["stage"] if e["this_model"] else f"{e['stage']} (fine-tuned from this model)"
        stage += f", dim {e['dim']}" if e.get("dim") else ""
        dataset = f"{e['dataset']} (MTEB)" if e.get("mteb") else e["dataset"]
        lines.append(f"| {dataset} | {e['split'] or '–'} | {stage} | "
                     + " | ".join("–" if v is None else f"{v:.4f}" for v in values) + f" | `{e['run_id']}` |")
    return lines


def _model_index_result(evaluation: dict) -> dict:
    """A `model-index` result; an MTEB task's score names its dataset as MTEB's own cards do (`MTEB <task>`), a
    BEIR folder's that MTEB scored (a local task) `<folder> (MTEB)`, beside the folder's own evaluation."""
    name = evaluation["dataset"]
    if evaluation.get("mteb"):
        name = f"{name} (MTEB)" if evaluation.get("mteb_local") else f"MTEB {name}"
    return {"task": {"type": "retrieval", "name": "Retrieval"},
            "dataset": {"type": evaluation["dataset"], "name": name,
                        **({"split": evaluation["split"]} if evaluation["split"] else {})},
            "metrics": [{"type": metric_name(m), "value": round(evaluation["metrics"][metric_name(m)], 6), "name": m}
                        for m in CARD_METRICS if metric_name(m) in evaluation["metrics"]]}


def _checkpoint_counters(run_dir: Path, tag: str | None) -> tuple[dict | None, int | None]:
    """({samples, tokens} seen over all ranks, ranks) from checkpoint `tag`'s client state; (None, None) when
    it is not there (the export outlived its checkpoint)."""
    import torch

    if tag is None:
        return None, None
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):  # ZeRO 0-2, 3
        file = run_dir / "checkpoints" / tag / name
        if file.is_file():
            state = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
            per_rank = state.get("counters") or []
            if per_rank:
                return {key: sum(c[key] for c in per_rank) for key in ("samples", "tokens")}, len(per_rank)
    return None, None


def _last_losses(metrics_file: Path) -> tuple[dict | None, dict | None]:
    """The last training record and the last validation record of metrics.jsonl."""
    final = validation = None
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            if "loss" in record:
                final = record
            if any(k.startswith("val_") for k in record):
                validation = record
    return final, validation


def _losses_text(record: dict | None) -> str:
    if record is None:
        return "–"
    losses = {k: v for k, v in record.items() if k not in _NOT_LOSSES and isinstance(v, (int, float))}
    main = "val_loss" if "val_loss" in losses else "loss"
    parts = ", ".join(f"{k} {v:.4f}" for k, v in losses.items() if k != main)
    return f"{losses.get(main, float('nan')):.4f}" + (f" ({parts})" if parts else "") + f" at step {record['step']}"


def _step(tag: str | None, final: dict | None) -> int:
    if tag and (step := step_of(tag)) is not None:
        return step
    return final["step"] if final else 0


def _parameter_counts(model_dir: Path) -> dict:
    """Parameters of the exported base model (and of the embeddings among them), and of the weights beside it;
    the MLM head an encoder family's weights also hold (models.export.save_base_model) is counted beside them in
    pretrieve_head.safetensors."""
    from safetensors import safe_open

    model_type = _read_json(model_dir / "config.json").get("model_type")
    mlm_head = tuple(next((b.hf_mlm_keys for b in BACKBONES.values() if b.model_type == model_type), {}))
    counts = {"encoder": 0, "embeddings": 0, "head": 0}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                size = 1
                for dim in f.get_slice(key).get_shape():
                    size *= dim
                if key.startswith(mlm_head) and file.name != HEAD_WEIGHTS:
                    continue
                if file.name == HEAD_WEIGHTS:
                    counts["head"] += size
                else:
                    counts["encoder"] += size
                    # BERT's embeddings module, a decoder LLM's embed_tokens
                    counts["embeddings"] += size if any(m in f".{key}" for m in (".embeddings.", ".embed_tokens.")) \
                        else 0
    return counts


def _data_sources(data: dict) -> str:
    manifests = data.get("manifests") or []
    names = data.get("corpora") or []
    return ", ".join(names) + (f" ({len(manifests)} manifest{'s' if len(manifests) != 1 else ''})" if manifests
                               else "")


def _dataset_names(data: dict) -> list[str]:
    """The data a run read, a name per manifest: its corpus, or for a retrieval collection (BEIR, MS MARCO:
    the corpus is `beir`) the collection's folder, where its first input file lies."""
    names = []
    for i, manifest in enumerate(data.get("manifests") or []):
        record = _read_json(Path(manifest)) if "://" not in str(manifest) else {}
        corpora = data.get("corpora") or []
        name = corpora[i] if i < len(corpora) else record.get("source") or Path(manifest).parent.name
        inputs = record.get("inputs") or []
        if record.get("source") in ("beir", "msmarco", "msmarco-passage", "msmarco-doc") and inputs:
            name = Path(inputs[0]["path"]).parent.name
        names.append(name)
    return names


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
