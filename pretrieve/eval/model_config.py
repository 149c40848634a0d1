"""How to encode texts with a model: the pooling, normalisation and maximum length that `eval`, `encode`, `mine`
and `finetune` use when no flag says.

A model directory says how it encodes in, first to last: its sentence-transformers config (`modules.json`,
`1_Pooling/config.json`, a Normalize module, `sentence_bert_config.json`'s max_seq_length), then
`pretrieve_finetune.json` (a model fine-tuned by pretrieve), else nothing: [CLS] (a decoder LLM's last token),
not normalised; [CLS] on a causal decoder LLM, whose first token sees nothing of the text, is refused, and so
is `last` on an encoder (its closing separator) unless a flag asks for it or pretrieve trained the model so. A wrong
pooling or a missing normalisation changes the scores without any error (all-MiniLM-L6-v2 on SciFact:
NDCG@10 0.6067 with mean pooling alone, 0.6451 as its config says), so the choice and its source are printed,
and a flag that contradicts the model's own config is used but warned about. A model fine-tuned with pooling
dupmae scores with eq. (12), which sentence-transformers cannot express (its files hold the dense part only),
and one fine-tuned with pooling sparse has no sentence-transformers files: for them, pretrieve_finetune.json is
read first.

A folder that is not a model directory (a run directory, whose model is RUN/export) is refused saying so, and a
maximum length past the model's positions (its learnt table, or the length a rotary model was made for) is
refused when given, or cut to them (and said) when it came from the model's config or the default.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from pretrieve.data.tokenizer import TOKENIZER_FILES
from pretrieve.models.backbones import backbone_of
from pretrieve.models.encoder import FINETUNE_META, export_meta, finetune_meta
from pretrieve.models.poolings import DENSE_POOLINGS, PROMPT_POOLINGS
from pretrieve.models.st_config import read_st_config

NO_CONFIG = "default: the model directory says nothing"  # the source when the model says nothing


@dataclass(frozen=True)
class Encoding:
    """The settings a model's texts are encoded with, and where they came from."""

    pooling: str
    normalize: bool
    max_length: int
    source: str  # "sentence-transformers config DIR/modules.json", "DIR/pretrieve_finetune.json" or NO_CONFIG
    flags: tuple[str, ...] = ()  # the settings given explicitly (pooling, normalize, max_length, prompts)
    query_prompt: str = ""  # put before each query (an instruction: E5-Mistral, Qwen3-Embedding)
    passage_prompt: str = ""  # put before each passage

    def encode_options(self, batch_size: int, query_own_length: int | None = None):
        """The encoder's options for these settings (`query_own_length`: the queries' tokens after their prompt,
        else max_length counting the prompt)."""
        from pretrieve.eval.options import EncodeOptions

        return EncodeOptions(self.pooling, self.max_length, batch_size, self.normalize,
                             query_prompt=self.query_prompt, passage_prompt=self.passage_prompt,
                             query_own_length=query_own_length)

    def describe(self) -> str:
        dense = self.pooling in (*DENSE_POOLINGS, *PROMPT_POOLINGS)
        norm = f", {'normalized' if self.normalize else 'not normalized'}" if dense else ""
        prompts = "".join(f", {name} prompt {text!r}" for name, text in (("query", self.query_prompt),
                                                                         ("passage", self.passage_prompt)) if text)
        given = f"; given: {', '.join(self.flags)}" if self.flags else ""
        return f"pooling {self.pooling}{norm}, max length {self.max_length}{prompts} ({self.source}{given})"


@dataclass(frozen=True)
class DeclaredEncoding:
    """What a model directory says about its encoding; `problems`: what in it pretrieve does not apply."""

    pooling: str
    normalize: bool
    max_length: int | None
    source: str
    problems: tuple[str, ...] = ()
    prompts: dict = field(default_factory=dict)  # the sentence-transformers config's: query, passage


def check_model_dir(model_dir: str | Path) -> None:
    """`model_dir` is a model directory (a HF config and a tokenizer), or a ValueError says what it is instead;
    a run directory points at its export."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{path}: not found; give a model directory (`pretrieve export`'s output, RUN/export, or "
                         "a HF model folder)")
    if (path / "config.json").is_file():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{path}: a model without a tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
                             "tokenizer it was trained with into it")
        return
    if (path / "export" / "config.json").is_file():
        hint = f"; it is a run directory: its model is {path / 'export'}"
    elif (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        hint = (f"; it is a run directory that has not exported its model yet: `pretrieve export {path} OUT` "
                "writes one from its latest checkpoint")
    else:
        hint = "; give `pretrieve export`'s output (RUN/export) or a HF model folder"
    raise ValueError(f"{path}: not a model directory (no config.json){hint}")


def position_limit(model_dir: str | Path) -> int | None:
    """The most tokens a text of the model may have: its learnt position table less the positions a backbone
    keeps for itself (RoBERTa's padding offset), or with rotary positions the length it was made for (longer
    texts would meet positions it never saw); None for a config that does not say."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int):
        return None
    try:
        offset = backbone_of(SimpleNamespace(model_type=config.get("model_type"))).position_offset(
            config.get("pad_token_id") or 0)
    except ValueError:  # a model type pretrieve has no backbone for: its table as it is
        offset = 0
    return positions if offset is None else positions - offset


def _family_is_decoder(model_dir: str | Path, config: dict | None = None) -> bool | None:
    """Whether the model's family is a decoder LLM's (False: an encoder's); None for a model type pretrieve has
    no backbone for. `config`: its config.json, when already read."""
    config = config or json.loads((Path(model_dir) / "config.json").read_text())
    try:
        return backbone_of(SimpleNamespace(model_type=config.get("model_type"))).causal
    except ValueError:
        return None


def is_decoder_llm(model_dir: str | Path, causal_only: bool = False) -> bool:
    """Whether the model is a decoder LLM (with `causal_only`: one attending causally, whose first token sees
    nothing after it)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(_family_is_decoder(model_dir, config)) and not (causal_only and config.get("bidirectional", False))


def trained_pooling(model_dir: str | Path) -> str | None:
    """The pooling pretrieve trained the model with, as its export records it (pretrieve_finetune.json, or the
    pre-training method's options in pretrieve_head.json); None when it records none."""
    return finetune_meta(model_dir).get("pooling") or export_meta(model_dir).get("options", {}).get("pooling")


def declared_encoding(model_dir: str | Path) -> DeclaredEncoding:
    """What `model_dir` says about its own encoding (see the module docstring), without any flag."""
    model_dir = Path(model_dir)
    tuned = finetune_meta(model_dir)
    st = read_st_config(model_dir)
    tuned_options = tuned.get("options", {})
    # the length its export's texts are read at (the longest of a query with its prompt and a passage), else, from
    # an export that did not record it, the passages'
    tuned_length = tuned.get("max_length") or tuned_options.get("passage_max_len")
    # the prompts its fine-tuning put before its texts
    tuned_prompts = {kind: tuned_options.get(f"{kind}_prompt") or "" for kind in ("query", "passage")}
    if tuned.get("pooling") == "dupmae":
        return DeclaredEncoding("dupmae", False, st.max_length if st else tuned_length,
                                f"{model_dir / FINETUNE_META} (eq. 12; the sentence-transformers files hold its "
                                "dense part only)", prompts=st.prompts if st else tuned_prompts)
    if tuned.get("pooling") == "sparse":  # its export writes no sentence-transformers files; any found are not its
        return DeclaredEncoding("sparse", False, tuned_length, str(model_dir / FINETUNE_META), prompts=tuned_prompts)
    if st is not None:
        problems = (*st.unsupported, *(["a Dense module"] if st.dense else []))
        return DeclaredEncoding(st.pooling, st.normalize, st.max_length, f"sentence-transformers config {st.path}",
                                problems, st.prompts)
    if tuned:
        return DeclaredEncoding(tuned.get("pooling", "cls"), bool(tuned.get("normalize", False)), tuned_length,
                                str(model_dir / FINETUNE_META))
    # a decoder LLM's text is read at its last token: its first sees nothing of the text (causal), or is a <bos>
    return DeclaredEncoding("last" if is_decoder_llm(model_dir) else "cls", False, None, NO_CONFIG)


def resolve_encoding(model_dir: str | Path, pooling: str | None = None, normalize: bool | None = None,
                     max_length: int | None = None, default_max_length: int = 256, announce: bool = True,
                     query_prompt: str | None = None, passage_prompt: str | None = None,
                     pooling_key: str = "--pooling") -> Encoding:
    """The flags given (not None), else what the model says, else cls (last for a decoder LLM) / not normalised /
    `default_max_length` / no prompts (the sentence-transformers config's `prompts`: query, passage).
    `pooling_key`: how errors name a given pooling (the flag, or a config key).
    Printed to stderr once (rank 0) when `announce`; a dense pooling or a normalisation that contradicts the
    model's config is a warning. A config pretrieve cannot follow (a Dense layer, max pooling, ...) is an
    error unless --pooling is given."""
    check_model_dir(model_dir)
    declared = declared_encoding(model_dir)
    limit = position_limit(model_dir)
    if max_length is not None and limit is not None and max_length > limit:
        raise ValueError(f"max length {max_length}: {model_dir} has {limit} positions (its config.json's "
                         f"max_position_embeddings); give at most {limit}")
    if declared.problems and pooling is None:
        raise ValueError(f"{declared.source}: pretrieve's encoders do not apply {', '.join(declared.problems)}, so "
                         "their vectors would not be this model's; give a pooling (--pooling, and --normalize or "
                         "--no-normalize) to encode with pretrieve's pooling anyway")
    given = tuple(name for name, value in (("pooling", pooling), ("normalize", normalize), ("max_length", max_length),
                                           ("query_prompt", query_prompt), ("passage_prompt", passage_prompt))
                  if value is not None)
    length = max_length or declared.max_length or default_max_length
    cut = limit is not None and length > limit  # the model's config or the default asks for more than it has
    prompts = {"query_prompt": declared.prompts.get("query", "") if query_prompt is None else query_prompt,
               "passage_prompt": declared.prompts.get("passage", "") if passage_prompt is None else passage_prompt}
    encoding = Encoding(pooling or declared.pooling, declared.normalize if normalize is None else normalize,
                        min(length, limit) if cut else length, declared.source, given, **prompts)
    if encoding.pooling == "cls" and is_decoder_llm(model_dir, causal_only=True):
        what = f"{pooling_key} cls" if pooling else f"pooling cls ({declared.source})"
        raise ValueError(f"{what}: on a causal decoder LLM ({model_dir}) that is its first token's state, which "
                         "sees nothing of the text after it (every text would get the same vector); pool with last "
                         "(or mean)")
    if (encoding.pooling == "last" and pooling is None and _family_is_decoder(model_dir) is False
            and trained_pooling(model_dir) != "last"):
        raise ValueError(f"pooling last ({declared.source}): on an encoder ({model_dir}) the last token is the "
                         f"closing separator, which pretrieve never trained this model to pool; give {pooling_key} "
                         "last to use it anyway, or cls / mean")
    if not announce or os.environ.get("RANK", "0") != "0":
        return encoding
    print(f"pretrieve: {model_dir}: {encoding.describe()}", file=sys.stderr)
    if cut:
        print(f"pretrieve: note: max length cut from {length} to the model's {limit} positions", file=sys.stderr)
    if declared.source != NO_CONFIG:
        for warning in _contradictions(encoding, declared, pooling, normalize):
            print(f"pretrieve: warning: {warning}", file=sys.stderr)
    return encoding


def _contradictions(encoding: Encoding, declared: DeclaredEncoding, pooling, normalize) -> list[str]:
    warnings = []
    if declared.problems:
        warnings.append(f"{declared.source}: has {', '.join(declared.problems)}, which pretrieve does not apply; "
                        f"encoding with pooling {encoding.pooling} anyway")
    if pooling in DENSE_POOLINGS and pooling != declared.pooling:
        warnings.append(f"pooling {pooling} was given, but {declared.source} says {declared.pooling}")
    if normalize is not None and encoding.pooling in DENSE_POOLINGS and normalize != declared.normalize:
        warnings.append(f"normalize={normalize} was given, but {declared.source} "
                        f"{'does not normalise' if normalize else 'normalises'}")
    return warnings
