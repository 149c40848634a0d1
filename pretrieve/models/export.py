"""Export a pre-training head as a plain HF model directory, and load one back to continue pre-training.

An export holds what `transformers.AutoModel.from_pretrained(OUT)` needs (config.json, model.safetensors
with the base model, the tokenizer files; on an encoder family also the MLM head, in the family's MaskedLM
layout, so that `AutoModelForMaskedLM.from_pretrained(OUT)` predicts tokens as pretrieve's head does) plus,
beside it, the head's extra weights (`pretrieve_head.safetensors`: MLM head, decoder, projections) and
`pretrieve_head.json` (method name and options). It is also a
sentence-transformers model (models.st_config): [CLS] pooling (the last token's on a decoder LLM), not
normalised, texts cut at the pre-training length, the representation every method here pre-trains (DupMAE's
joint representation: its dense part; the contrastive method's own pooling and normalisation). It is
written to a temporary directory beside OUT and renamed, so an export is complete or absent; OUT may be new,
empty or an earlier export, which `--overwrite` replaces (utils/output_folder.py).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from pretrieve import __version__
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.models.encoder import (EXPORT_FORMAT, FINETUNE_META, HEAD_CONFIG, HEAD_WEIGHTS, ModelOptions,
                                      check_weights, export_meta, finetune_meta, own_load_report)
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import METHODS, get_method
from pretrieve.models.lora import unadapt_for_saving
from pretrieve.models.st_config import write_st_config
from pretrieve.utils.output_folder import check_whole_output, replace_directory, staging_folder

log = logging.getLogger(__name__)

# methods that train token predictions and no pooled vector: their export pools as the model they continued did
# (a sentence-transformers model's mean pooling, say), as the quality study reads an mlm arm (study/plan.py)
NO_REPRESENTATION = ("mlm", "mntp")


def is_export(path: Path) -> bool:
    """Whether `path` holds an export of pretrieve's: a pre-training head's or a fine-tuning run's."""
    return (path / HEAD_CONFIG).is_file() or (path / FINETUNE_META).is_file()


def check_export_folder(out: str | Path, overwrite: bool) -> None:
    """`pretrieve export`'s OUT before any work: new, empty, or an earlier export with `overwrite`."""
    check_whole_output(out, "pretrieve export", is_export, overwrite)


def write_model_code(out: Path, model) -> bool:
    """Give the model directory `out` its own model class (models/hf_model_code.py, named in config.json's
    auto_map) where HF's class would encode it otherwise than it was trained: a decoder LLM made bidirectional,
    or one whose adapter is kept apart in `out`/adapter/. Returns whether it did."""
    from pretrieve.models import hf_model_code
    from pretrieve.models.backbones.registry import backbone_of

    adapter = (out / hf_model_code.ADAPTER_DIR / "adapter_config.json").is_file()
    if not backbone_of(model.config).causal or not (getattr(model.config, "bidirectional", False) or adapter):
        return False
    source = Path(hf_model_code.__file__).read_text(encoding="utf-8")
    default = f'BASE_MODEL = "{hf_model_code.BASE_MODEL}"'
    assert default in source, f"{hf_model_code.__file__}: no {default} line to name the family's class in"
    base = type(model).__name__
    (out / hf_model_code.CODE_FILE).write_text(source.replace(default, f'BASE_MODEL = "{base}"'), encoding="utf-8")
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoModel": f"{Path(hf_model_code.CODE_FILE).stem}.{hf_model_code.CLASS_NAME}"}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return True


def save_base_model(encoder, out: Path) -> None:
    """Save `encoder`'s base model into `out` with `save_pretrained`; an encoder family's inside its *ForMaskedLM
    (config.json's architectures), the MLM head under the names that class reads (`cls.predictions.*`,
    `lm_head.*`, `head.*` + `decoder.bias`: backbone.hf_mlm_keys) and its output weights tied to the word
    embeddings, so the file holds them once. AutoModel reads the base model and reports the head's keys
    unexpected, as it does for a released BERT checkpoint. A decoder LLM's base model is saved alone."""
    import torch
    from transformers import AutoModelForMaskedLM

    model = encoder.model
    if encoder.backbone.causal:
        model.save_pretrained(str(out))
        return
    with torch.device("meta"):  # its base model is swapped for the encoder's, its head loaded: nothing to allocate
        masked_lm = AutoModelForMaskedLM.from_config(model.config)
    setattr(masked_lm, masked_lm.base_model_prefix, model)
    masked_lm.config = model.config
    head = {hf + name[len(ours):]: p.detach() for name, p in encoder.token_head_parameters()
            for hf, ours in encoder.backbone.hf_mlm_keys.items() if name.startswith(ours)}
    masked_lm.load_state_dict(head, strict=False, assign=True)
    masked_lm.tie_weights()  # the output weights: the word embeddings
    left = [name for name, p in [*masked_lm.named_parameters(), *masked_lm.named_buffers()] if p.is_meta]
    assert not left, f"{type(masked_lm).__name__}: no value for {left} (backbone.hf_mlm_keys misses them)"
    masked_lm.save_pretrained(str(out))


def load_base_model(path: str | Path):
    """An exported model's HF base model, encoding as it was trained: a decoder LLM through its class in
    models/hf_model_code.py (causal or bidirectional as its config says; its own copy in the directory is not
    run), any other through AutoModel; an adapter kept apart folded in."""
    from transformers import AutoConfig, AutoModel

    from pretrieve.models.backbones.registry import backbone_of
    from pretrieve.models.hf_model_code import hf_model_class
    from pretrieve.models.lora import merge_saved_adapter

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    check_weights(path)
    try:
        backbone = backbone_of(config)
    except ValueError:  # a model type pretrieve does not train: HF's own class
        backbone = None
    if backbone is not None and backbone.causal:
        return hf_model_class(backbone.model_class).from_pretrained(str(path), local_files_only=True)
    if backbone is None:
        return merge_saved_adapter(AutoModel.from_pretrained(str(path), local_files_only=True), Path(path))
    with own_load_report():
        model, info = AutoModel.from_pretrained(str(path), local_files_only=True, output_loading_info=True)
    # what transformers would report, less the family's MLM head (which an export and a released MaskedLM
    # checkpoint hold beside the base model)
    lines = [f"{key}: not in {path}, initialised" for key in sorted(info["missing_keys"])]
    lines += [f"{key}: in {path}, not used" for key in sorted(info["unexpected_keys"])
              if not key.startswith(tuple(backbone.hf_mlm_keys))]
    for line in lines:
        log.warning("%s", line)
    return merge_saved_adapter(model, Path(path))


def method_name(head: PretrainingHead) -> str:
    get_method("mlm")  # make sure the built-in methods are registered
    for name, method in METHODS.items():
        if type(head) is method.head:
            return name
    raise KeyError(f"{type(head).__name__} is not a registered method head")


def export(head: PretrainingHead, out: str | Path, tokenizer: str | Path = DEFAULT_TOKENIZER,
           before_rename: Callable[[Path], None] | None = None, keep_adapter: bool = False,
           continued: tuple[str, bool] | None = None) -> Path:
    """Export `head` to `out`; `before_rename(tmp)` adds files (a model card) to the finished temporary
    directory before it becomes `out`. LoRA adapters (models/lora.py) are merged into the base model, in `head`
    itself, or with `keep_adapter` written apart (`head`'s base model then has no adapters). `continued`: the
    (pooling, normalize) of the sentence-transformers model the run started from, which a method that trains no
    representation keeps (NO_REPRESENTATION)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out = Path(out)
    tmp = staging_folder(out)
    unadapt_for_saving(head.encoder.model, tmp, keep_adapter)
    save_base_model(head.encoder, tmp)
    write_model_code(tmp, head.encoder.model)
    AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).save_pretrained(str(tmp))
    save_file(head.extra_state(), str(tmp / HEAD_WEIGHTS))
    meta = {"format": EXPORT_FORMAT, "method": method_name(head), "options": asdict(head.options),
            "pretrieve_version": __version__}
    (tmp / HEAD_CONFIG).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    config = head.encoder.config
    # a head that trains its representation says how it pools (contrastive); one that trains none keeps the
    # encoding of the model it continued; the others are read at [CLS], or at the last token on a decoder LLM
    # (its first token sees nothing of the text)
    pooling = getattr(head.options, "pooling", "last" if head.encoder.backbone.causal else "cls")
    normalize = getattr(head.options, "normalize", False)
    if continued is not None and meta["method"] in NO_REPRESENTATION:
        pooling, normalize = continued
    write_st_config(tmp, pooling, normalize, getattr(head.options, "max_len", min(512, config.max_position_embeddings)),
                    matryoshka_dims=getattr(head.options, "matryoshka_dims", None))
    if before_rename is not None:
        before_rename(tmp)
    return replace_directory(tmp, out)


def describe_export(out: str | Path, source: str | None = None) -> str:
    """What the export directory `out` holds, in words (`pretrieve export` prints it): its format, files and
    pooling. `source`: where its weights came from (a checkpoint)."""
    import textwrap

    from pretrieve.models.st_config import read_st_config

    out = Path(out)
    meta, st = export_meta(out), read_st_config(out)
    files = [f"{p.relative_to(out)} ({_size(p.stat().st_size)})" for p in sorted(out.rglob("*")) if p.is_file()]
    origin = f" from {source}" if source else ""
    if meta:
        what = [f"{out}: {meta['method']}{origin}",
                f"  format: {meta['format']}, a Hugging Face model directory and a sentence-transformers model, "
                "with the head's weights"]
    else:  # a fine-tuning run's export (finetune/run.py)
        tuned = finetune_meta(out)
        kind = "cross-encoder" if tuned["model"] == "cross" else "dual encoder"
        what = [f"{out}: a fine-tuned {kind} ({tuned['loss']} loss){origin}",
                f"  format: a Hugging Face model directory{'' if st is None else ' and a sentence-transformers model'}"]
    pooling = [] if st is None else [
        f"  pooling: {st.pooling}, {'L2-normalised' if st.normalize else 'not normalised'}, texts cut at "
        f"{st.max_length} tokens (sentence-transformers config)"]
    if st is not None and st.matryoshka_dims:
        pooling.append(f"  Matryoshka dimensions: {', '.join(map(str, st.matryoshka_dims))} (search a prefix with "
                       "`pretrieve eval --dim N`, sentence-transformers' truncate_dim)")
    return "\n".join([*what, *textwrap.wrap(", ".join(files), width=110, initial_indent="  files: ",
                                            subsequent_indent=" " * 9), *pooling])


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def load_export(path: str | Path, method_options: dict | None = None) -> PretrainingHead:
    """The head of an export with all its weights (encoder, MLM head, decoder, projections)."""
    meta = export_meta(path)
    if not meta:
        raise FileNotFoundError(f"{path}: no {HEAD_CONFIG}; not a pretrieve export")
    method = get_method(meta["method"])
    options = method.options_from({**method.options.saved(meta["options"]), **(method_options or {})},
                                  where=str(Path(path) / HEAD_CONFIG))
    return method.build(options, ModelOptions(init_from=str(path)))
