"""The tokenizer a corpus is prepared with, and the fingerprint that ties shards to it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOKENIZER = str(Path(__file__).resolve().parent.parent / "assets" / "tokenizer")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model")  # any one: transformers can load a tokenizer from the folder
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json as it is, no model's defaults


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    path: str
    vocab_size: int
    fingerprint: str  # sha256 of the vocabulary in id order

    def as_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "vocab_size": self.vocab_size, "fingerprint": self.fingerprint}


def load_tokenizer(path: str | Path):
    """The transformers tokenizer of a local HF tokenizer directory, which must be a fast one.

    Goes through `AutoTokenizer` so a directory with only `vocab.txt` works too (converted to fast). A tokenizer
    saved as the generic fast class (`pretrieve tokenizer train`'s) loads as that class even beside a model's
    config.json: AutoTokenizer would take the model type's class, which adds its own special tokens (a qwen2
    folder gained Qwen2's <|endoftext|>), and the vocabulary would no longer be the shards'.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"tokenizer directory not found: {path} (pass a local HF tokenizer directory)")
    declared = tokenizer_config(path).get("tokenizer_class")
    loader = PreTrainedTokenizerFast if declared in GENERIC_CLASSES else AutoTokenizer
    try:
        tok = loader.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        raise TokenizerError(f"{path}: cannot load a tokenizer ({e})") from e
    if getattr(tok, "backend_tokenizer", None) is None:
        raise TokenizerError(f"{path}: no fast tokenizer available; pretrieve needs a HF fast tokenizer")
    return tok


def tokenizer_config(path: str | Path) -> dict:
    """A folder's tokenizer_config.json ({} without one)."""
    config = Path(path) / "tokenizer_config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{config}: cannot read it ({e})") from e


def load_backend(path: str | Path):
    """The `tokenizers.Tokenizer` of a local HF tokenizer directory, without truncation or padding."""
    backend = load_tokenizer(path).backend_tokenizer
    backend.no_truncation()
    backend.no_padding()
    return backend


def describe(path: str | Path, backend=None) -> TokenizerInfo:
    backend = backend or load_backend(path)
    vocab = backend.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    digest = hashlib.sha256("\n".join(token for token, _ in by_id).encode("utf-8")).hexdigest()
    name = tokenizer_config(path).get("name_or_path") or Path(path).name
    return TokenizerInfo(name=name, path=str(path), vocab_size=len(vocab), fingerprint=f"sha256:{digest}")


def has_tokenizer(path: str | Path) -> bool:
    """Whether the folder `path` holds a tokenizer (a model checkpoint saved with its own, say)."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def in_words(info: dict) -> str:
    """A tokenizer as a manifest (`tokenizer`) or TokenizerInfo.as_dict records it: name, folder, size and the
    start of its fingerprint, so that an error about two tokenizers names both."""
    size = info.get("vocab_size")
    size = f"{size:,} tokens" if isinstance(size, int) else "size not recorded"
    return f"{info.get('name') or '?'} ({info.get('path') or '?'}, {size}, {str(info.get('fingerprint'))[:19]}...)"
