"""`pretrieve tokenizer train`: a tokenizer of your own, trained on raw corpora with HF tokenizers.

Hub tokenizers cannot be assumed on a cluster, and a new domain or language wants its own vocabulary. Four
kinds, each with the conventions of the backbone family that uses it, so a head finds its special tokens and
word boundaries the same way on each (data/masking.py, `Vocabulary.of_tokenizer`):

- `wordpiece`: BERT's. BertNormalizer (lower-cased by default, as bert-base-uncased), BertPreTokenizer, "##"
  marks a piece that continues a word; [PAD] [UNK] [CLS] [SEP] [MASK].
- `bpe`: RoBERTa's byte-level BPE. Every byte is in the vocabulary (no unknown text); "Ġ" marks a piece that
  starts a word after a space; <s> <pad> </s> <unk> <mask>, the mask token taking the space before it.
- `unigram`: XLM-R's SentencePiece unigram. NMT and NFKC normalisation, "▁" marks a word start (Metaspace,
  prepended to every text); the same special tokens as `bpe`.
- `llm`: a decoder LLM's byte-level BPE, as Llama 3's and Qwen's: text split by their regex (contractions,
  letters with one leading non-letter, digits in threes, punctuation runs, whitespace) before the byte mapping;
  <|begin_of_text|> <|end_of_text|> <|pad|> <|mask|> (the mask for bidirectional MLM / MNTP), 16
  <|reserved_special_token_i|> (Llama2Vec's prompt tokens) and no unknown token. A text ends with
  <|end_of_text|>, the token that last-token pooling reads (LLM2Vec).

The corpora are read by prepare's readers (data/corpora.py: the same sources and fields); a bad record stops
training with its file and line, or is skipped and counted (`on_error="skip"`). The directory is written
beside OUT first and moved into place once it loads again, so an interrupted run leaves nothing half-written.
`prepare --tokenizer OUT` then tokenizes with it and fingerprints it as any other tokenizer directory, and
`data.tokenizer: OUT` pre-trains with it.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from pretrieve import __version__
from pretrieve.data.corpora import SOURCES, BadRecord, CorpusError, ReaderOptions, read_corpus
from pretrieve.utils.output_folder import check_whole_output, replace_directory, staging_folder

KINDS = ("wordpiece", "bpe", "unigram", "llm")
TRAINING_RECORD = "pretrieve_tokenizer.json"  # in the output: how the tokenizer was trained, on what
# token roles (the names transformers gives them) -> each kind's special token; id order is the list's order
SPECIAL_TOKENS = {
    "wordpiece": {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "bpe": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
    "unigram": {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"},
    "llm": {"cls": "<|begin_of_text|>", "sep": "<|end_of_text|>", "pad": "<|pad|>", "mask": "<|mask|>"},
}
# the llm kind's reserved special tokens after its roles, as Llama 3 reserves its own: Llama2Vec's two prompts
# end in 8 each (models/heads/llama2vec.py)
LLM_RESERVED = tuple(f"<|reserved_special_token_{i}|>" for i in range(16))
# Llama 3's (and Qwen2's) pre-tokenising split, applied before the byte mapping
LLM_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")


class TokenizerTrainError(ValueError):
    pass


@dataclass
class TokenizerTrainOptions:
    source: str
    inputs: list[str]
    out: str
    kind: str = "wordpiece"
    vocab_size: int = 30522  # bert-base's; RoBERTa has 50,265, XLM-R 250,002
    min_frequency: int = 2  # wordpiece / bpe: a merge needs this many occurrences
    lowercase: bool | None = None  # None: yes for wordpiece (bert-base-uncased), no for bpe and unigram
    max_documents: int | None = None  # read at most this many documents (the first ones)
    model_max_length: int = 512  # written into the tokenizer config
    on_error: str = "fail"  # fail | skip
    overwrite: bool = False
    reader: ReaderOptions = field(default_factory=ReaderOptions)
    progress: bool = True

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise TokenizerTrainError(f"--source {self.source!r}: choose one of {', '.join(SOURCES)}")
        if self.kind not in KINDS:
            raise TokenizerTrainError(f"--kind {self.kind!r}: choose one of {', '.join(KINDS)}")
        if self.vocab_size < 300:  # byte-level BPE starts from 256 bytes plus the special tokens
            raise TokenizerTrainError(f"--vocab-size must be at least 300, got {self.vocab_size}")
        if self.min_frequency < 1:
            raise TokenizerTrainError(f"--min-frequency must be positive, got {self.min_frequency}")
        if self.max_documents is not None and self.max_documents < 1:
            raise TokenizerTrainError(f"--max-documents must be positive, got {self.max_documents}")
        if self.on_error not in ("fail", "skip"):
            raise TokenizerTrainError(f"--on-error must be fail or skip, got {self.on_error!r}")

    def resolved_lowercase(self) -> bool:
        return self.kind == "wordpiece" if self.lowercase is None else self.lowercase


def train_tokenizer(opts: TokenizerTrainOptions) -> dict:
    """Train a tokenizer on `opts.inputs` and write it to `opts.out` as a HF tokenizer directory; returns the
    training record written beside it."""
    from pretrieve.progress import Progress

    opts.validate()
    out = Path(opts.out)
    check_whole_output(out, "tokenizer trained by pretrieve", lambda path: (path / TRAINING_RECORD).is_file(),
                       opts.overwrite)
    started = time.perf_counter()
    tokenizer, trainer = _untrained(opts)
    counts: Counter = Counter()
    with Progress(opts.max_documents, f"tokenizer {opts.kind}", unit="doc", enabled=opts.progress) as progress:
        tokenizer.train_from_iterator(_texts(opts, counts, progress), trainer=trainer)
    if counts["documents"] == 0:
        raise TokenizerTrainError(f"no documents read from {', '.join(map(str, opts.inputs))} "
                                  f"(skipped: {dict(counts) or 'none'})")
    _add_template(tokenizer, opts.kind)
    record = {
        "kind": opts.kind, "vocab_size": tokenizer.get_vocab_size(), "requested_vocab_size": opts.vocab_size,
        "lowercase": opts.resolved_lowercase(), "min_frequency": opts.min_frequency, "source": opts.source,
        "inputs": [str(p) for p in opts.inputs], "documents": counts.pop("documents"),
        "characters": counts.pop("characters"), "skipped": dict(sorted(counts.items())),
        "max_documents": opts.max_documents, "reader": asdict(opts.reader), "pretrieve_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.perf_counter() - started, 3),
    }
    _write(tokenizer, opts, record, out)
    return record


def _untrained(opts: TokenizerTrainOptions):
    """The empty tokenizer of `opts.kind` with its normaliser, pre-tokeniser and decoder, and its trainer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    special = list(SPECIAL_TOKENS[opts.kind].values()) + list(LLM_RESERVED if opts.kind == "llm" else ())
    lower = [normalizers.Lowercase()] if opts.resolved_lowercase() else []
    if opts.kind == "wordpiece":
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=opts.resolved_lowercase())
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer(vocab_size=opts.vocab_size, min_frequency=opts.min_frequency,
                                            special_tokens=special, continuing_subword_prefix="##",
                                            show_progress=False)
    elif opts.kind in ("bpe", "llm"):
        tokenizer = Tokenizer(models.BPE())
        if lower:
            tokenizer.normalizer = normalizers.Sequence(lower)
        if opts.kind == "bpe":
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:  # the LLM split first, then the byte mapping alone
            tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(LLM_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=opts.vocab_size, min_frequency=opts.min_frequency,
                                      special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    else:
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " "), *lower])
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=opts.vocab_size, special_tokens=special, unk_token="<unk>",
                                          show_progress=False)
    return tokenizer, trainer


def _texts(opts: TokenizerTrainOptions, counts: Counter, progress) -> Iterator[str]:
    """The documents' texts in corpus order; bad records raise with their location, or are counted."""
    for record in read_corpus(opts.source, opts.inputs, opts.reader):
        if isinstance(record, BadRecord):
            if opts.on_error == "fail":
                raise CorpusError(f"{record.where}: {record.reason}: {record.detail} "
                                  "(--on-error skip to skip and count such records)")
            counts[record.reason] += 1
            continue
        counts["documents"] += 1
        counts["characters"] += len(record.text)
        progress.update(1)
        yield record.text
        if opts.max_documents is not None and counts["documents"] >= opts.max_documents:
            return


def _add_template(tokenizer, kind: str) -> None:
    """Special tokens around encoded texts, as the backbone family adds them: [CLS] A [SEP] (B [SEP]) for
    WordPiece and for `llm`'s bos / eos, <s> A </s> (</s> B </s>) for RoBERTa / XLM-R pairs."""
    from tokenizers import processors

    roles = SPECIAL_TOKENS[kind]
    cls, sep = roles["cls"], roles["sep"]
    ids = [(cls, tokenizer.token_to_id(cls)), (sep, tokenizer.token_to_id(sep))]
    pair = f"{cls} $A {sep} $B:1 {sep}:1" if kind in ("wordpiece", "llm") else f"{cls} $A {sep} {sep} $B:1 {sep}:1"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=pair,
                                                             special_tokens=ids)


def _write(tokenizer, opts: TokenizerTrainOptions, record: dict, out: Path) -> None:
    """Save as a HF tokenizer directory in a sibling folder, check it loads with its roles, then move it in."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import describe

    roles = dict(SPECIAL_TOKENS[opts.kind])
    if opts.kind != "wordpiece":  # RoBERTa's <mask> absorbs the space before it ("a <mask> b")
        roles["mask"] = AddedToken(roles["mask"], lstrip=True, special=True)
    extra = {} if opts.kind == "wordpiece" else {"bos_token": roles["cls"], "eos_token": roles["sep"]}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=opts.model_max_length,
                                      **{f"{role}_token": token for role, token in roles.items()}, **extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_folder(out)
    try:
        wrapped.save_pretrained(str(tmp))
        Vocabulary.of_tokenizer(tmp)  # what pre-training will read: fails here, not on a cluster
        record["fingerprint"] = describe(tmp).fingerprint
        (tmp / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        replace_directory(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
