"""A model directory's sentence-transformers description: read what it says, write it beside an export.

sentence-transformers loads a directory through `modules.json`: a Transformer (the HF model in the root, its
`max_seq_length` in `sentence_bert_config.json`), a Pooling (`1_Pooling/config.json`), optionally a Dense (a
linear map) and a Normalize. `write_st_config` writes the classic layout of all-MiniLM-L6-v2, which every
sentence-transformers release since 2.0 reads, plus `config_sentence_transformers.json`'s similarity function
(read since 3.0). `read_st_config` reads that layout and the one releases >= 5 write (`pooling_mode`, the
maximum length in the tokenizer's config). pretrieve itself applies Transformer + Pooling (cls, mean or last) +
Normalize; the Dense it writes for a DupMAE fine-tuned model is W^cls, the dense half of eq. (12). A model
trained with Matryoshka dimensions (models/matryoshka.py) records them as `matryoshka_dims` in
`config_sentence_transformers.json` (sentence-transformers ignores the key; its `truncate_dim` at load or encode
cuts the vectors to any of them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODULES_JSON = "modules.json"
ST_MODEL_CONFIG = "config_sentence_transformers.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
ST_FORMAT_VERSION = "3.0.0"  # the oldest release that reads every file written here (similarity_fn_name)
_TYPES = {"Transformer": "sentence_transformers.models.Transformer", "Pooling": "sentence_transformers.models.Pooling",
          "Dense": "sentence_transformers.models.Dense", "Normalize": "sentence_transformers.models.Normalize"}
# Pooling/config.json's classic boolean keys and the mode names of `pooling_mode` (sentence-transformers >= 5)
_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class STConfig:
    """What a directory's sentence-transformers files say about encoding a text."""

    path: Path  # its modules.json
    pooling: str  # a mode name: cls, mean, max, ... ("+"-joined when several are concatenated)
    normalize: bool
    max_length: int | None  # tokens, special tokens included; None when no file says
    dense: bool  # a Dense module follows the pooling
    unsupported: tuple[str, ...]  # what pretrieve's encoders do not apply: modules, pooling modes
    prompts: dict = field(default_factory=dict)  # name -> the text put before a text (query, passage)
    matryoshka_dims: tuple[int, ...] = ()  # the prefixes the model was trained to be searched at, widest first


def read_st_config(model_dir: str | Path) -> STConfig | None:
    """The sentence-transformers description of `model_dir`, or None when it has no modules.json."""
    model_dir = Path(model_dir)
    modules_file = model_dir / MODULES_JSON
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
        kinds = [(m["type"].rsplit(".", 1)[-1], m.get("path", "")) for m in modules]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{modules_file}: not a sentence-transformers module list ({e})") from e
    pooling, normalize, dense, max_length, unsupported = None, False, False, None, []
    for kind, path in kinds:
        if kind == "Transformer":
            if path not in ("", "."):
                unsupported.append(f"Transformer in {path}/ (pretrieve reads the HF model in the directory itself)")
            max_length = _max_length(model_dir / path)
        elif kind == "Pooling":
            pooling = _pooling_mode(model_dir / path / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind == "Dense":
            dense = True
        else:
            unsupported.append(kind)
    if pooling is None:
        raise ValueError(f"{modules_file}: no Pooling module (pretrieve pools token states with cls, mean or last)")
    pooling = {"lasttoken": "last"}.get(pooling, pooling)
    if pooling not in ("cls", "mean", "last"):
        unsupported.append(f"pooling {pooling}")
    model_config = _model_config(model_dir)
    return STConfig(modules_file, pooling, normalize, max_length, dense, tuple(unsupported), _prompts(model_config),
                    _matryoshka_dims(model_config))


def declared_pooling(model_dir: str | Path) -> tuple[str, bool] | None:
    """(pooling, normalize) of a sentence-transformers model whose encoding pretrieve applies whole (a Pooling
    of cls, mean or last, maybe a Normalize); None for any other folder."""
    try:
        st = read_st_config(model_dir)
    except ValueError:
        return None
    return None if st is None or st.dense or st.unsupported else (st.pooling, st.normalize)


def _model_config(model_dir: Path) -> tuple[Path, dict]:
    """(config_sentence_transformers.json, its content: {} when there is none)."""
    file = model_dir / ST_MODEL_CONFIG
    try:
        return file, json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    except ValueError as e:
        raise ValueError(f"{file}: unreadable ({e})") from e


def _matryoshka_dims(model_config: tuple[Path, dict]) -> tuple[int, ...]:
    file, config = model_config
    dims = config.get("matryoshka_dims") or []
    if not (isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)):
        raise ValueError(f"{file}: matryoshka_dims must be a list of dimensions, got {dims!r}")
    return tuple(sorted(dims, reverse=True))


def _prompts(model_config: tuple[Path, dict]) -> dict:
    """config_sentence_transformers.json's prompts (`encode(..., prompt_name=NAME)` puts prompts[NAME] first)."""
    file, config = model_config
    prompts = config.get("prompts")
    if prompts is not None and not (isinstance(prompts, dict) and all(isinstance(v, str) for v in prompts.values())):
        raise ValueError(f"{file}: prompts must map names to texts, got {prompts!r}")
    return dict(prompts or {})


def _pooling_mode(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{config_file}: unreadable Pooling config ({e})") from e
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _POOLING_KEYS.items() if config.get(key)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if not modes:
        raise ValueError(f"{config_file}: no pooling mode is on")
    return "+".join(modes)


def _max_length(transformer_dir: Path) -> int | None:
    """sentence_bert_config.json's max_seq_length; else, as sentence-transformers >= 5 does, the tokenizer's
    model_max_length capped by the model's position embeddings."""
    def read(name: str) -> dict:
        file = transformer_dir / name
        return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}

    declared = read(TRANSFORMER_CONFIG).get("max_seq_length")
    if declared is not None:
        return int(declared)
    limits = [read("tokenizer_config.json").get("model_max_length"), read("config.json").get("max_position_embeddings")]
    limits = [int(v) for v in limits if isinstance(v, (int, float)) and 0 < v < 1_000_000]  # 1e30: "no limit"
    return min(limits) if limits else None


def write_st_config(model_dir: str | Path, pooling: str, normalize: bool, max_length: int,
                    dense_weight: torch.Tensor | None = None, prompts: dict[str, str] | None = None,
                    matryoshka_dims: list[int] | None = None) -> None:
    """Make the HF model directory `model_dir` (config.json + weights + tokenizer) a sentence-transformers model
    that pools with `pooling` (cls | mean | last), then maps with `dense_weight` ([out, hidden], no bias) when
    given, then L2-normalises when `normalize`; texts are cut to `max_length` tokens. The similarity function is
    cosine for normalised vectors, else the dot product pretrieve searches with. `prompts` (query, passage): the
    texts put before each text, as `encode(..., prompt_name="query")` does and `pretrieve eval` reads them.
    `matryoshka_dims`: the dimensions the model was trained at (models/matryoshka.py), recorded widest first."""
    import transformers
    from safetensors.torch import save_file

    mode = {"cls": "cls", "mean": "mean", "last": "lasttoken"}.get(pooling)  # sentence-transformers' mode names
    if mode is None:
        raise ValueError(f"pooling {pooling!r}: sentence-transformers files are written for cls, mean or last")
    model_dir = Path(model_dir)
    hidden = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    modules = [("Transformer", ""), ("Pooling", "1_Pooling")]
    _write_json(model_dir / "1_Pooling" / "config.json",
                {"word_embedding_dimension": hidden, **{key: name == mode for key, name in _POOLING_KEYS.items()},
                 "include_prompt": True})
    if dense_weight is not None:
        folder = f"{len(modules)}_Dense"
        modules.append(("Dense", folder))
        out_features, in_features = dense_weight.shape
        _write_json(model_dir / folder / "config.json",
                    {"in_features": in_features, "out_features": out_features, "bias": False,
                     "activation_function": "torch.nn.modules.linear.Identity"})
        save_file({"linear.weight": dense_weight.detach().float().contiguous()}, str(model_dir / folder /
                                                                                     "model.safetensors"))
    if normalize:
        folder = f"{len(modules)}_Normalize"
        modules.append(("Normalize", folder))
        (model_dir / folder).mkdir(exist_ok=True)  # Normalize has no files; the folder is where it would keep them
    _write_json(model_dir / MODULES_JSON, [{"idx": i, "name": str(i), "path": path, "type": _TYPES[kind]}
                                           for i, (kind, path) in enumerate(modules)])
    _write_json(model_dir / TRANSFORMER_CONFIG, {"max_seq_length": int(max_length), "do_lower_case": False})
    _write_json(model_dir / ST_MODEL_CONFIG, {
        "__version__": {"sentence_transformers": _st_version(), "transformers": transformers.__version__,
                        "pytorch": torch.__version__},
        "model_type": "SentenceTransformer", "prompts": {k: v for k, v in (prompts or {}).items() if v},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine" if normalize else "dot",
        **({"matryoshka_dims": sorted(matryoshka_dims, reverse=True)} if matryoshka_dims else {})})


def _st_version() -> str:
    """The version `__version__` records, as sentence-transformers' own save does: the installed release, which
    made and checked these files (a later one loading them says nothing; an earlier one warns); without it, the
    oldest release that reads them."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sentence-transformers")
    except PackageNotFoundError:
        return ST_FORMAT_VERSION


def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
