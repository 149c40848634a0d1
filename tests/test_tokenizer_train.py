"""`pretrieve tokenizer train`: tokenizers of your own, and pre-training with them (data.tokenizer)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from support import SAMPLES, pretrain_env, result_line, text_methods
from pretrieve.cli import main
from pretrieve.data.collators import MLMCollator
from pretrieve.data.masking import Vocabulary, word_ids
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.spans import word_candidates
from pretrieve.data.stream import ShardStream
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, describe, load_backend
from pretrieve.data.tokenizer_train import TRAINING_RECORD
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import METHODS, get_method

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
TEXT = "The anarchism movement, a political philosophy"
# (kind, its special tokens in the order cls sep pad mask, the word-start marker, TEXT's tokens)
KINDS = [("wordpiece", ("[CLS]", "[SEP]", "[PAD]", "[MASK]"), ""),
         ("bpe", ("<s>", "</s>", "<pad>", "<mask>"), "Ġ"),
         ("unigram", ("<s>", "</s>", "<pad>", "<mask>"), "▁"),
         ("llm", ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|mask|>"), "Ġ")]


def _train(out: Path, kind: str, *extra: str, source="wikipedia", inputs=(SAMPLES / "wikipedia",)) -> int:
    return main(["tokenizer", "train", "--source", source, "--input", *map(str, inputs), "--out", str(out),
                 "--kind", kind, "--vocab-size", "1000", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A tokenizer of each kind, 1,000 tokens, trained on the bundled Wikipedia sample."""
    out = tmp_path_factory.mktemp("tokenizers")
    for kind, _, _ in KINDS:
        assert _train(out / kind, kind) == 0
    return {kind: out / kind for kind, _, _ in KINDS}


@pytest.mark.parametrize("kind,special,marker", KINDS)
def test_each_kind_loads_with_its_family_conventions(trained, kind, special, marker):
    path = trained[kind]
    record = json.loads((path / TRAINING_RECORD).read_text())
    assert record["kind"] == kind and record["vocab_size"] == 1000 and record["documents"] == 60
    assert record["lowercase"] is (kind == "wordpiece") and record["skipped"] == {}
    assert record["fingerprint"] == describe(path).fingerprint
    assert not list(path.parent.glob(f".{kind}*"))  # no temporary directory left

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert (tok.cls_token, tok.sep_token, tok.pad_token, tok.mask_token) == special
    tokens = tok.convert_ids_to_tokens(tok(TEXT)["input_ids"])
    assert tokens[0] == special[0] and tokens[-1] == special[1]  # the template adds them, as BERT's / RoBERTa's
    assert tok.decode(tok(TEXT)["input_ids"], skip_special_tokens=True).strip() == (
        TEXT.lower() if kind == "wordpiece" else TEXT)

    vocab = Vocabulary.of_tokenizer(path)
    assert [vocab.tokens[i] for i in (vocab.cls_id, vocab.sep_id, vocab.pad_id, vocab.mask_id)] == list(special)
    assert vocab.special.sum() == (4 + 16 if kind == "llm" else 5) and not vocab.continuation[vocab.special].any()
    ids = np.array([tok(TEXT)["input_ids"]])
    words, num_words = word_ids(ids, np.array([ids.shape[1]]), vocab)
    # whole words as the family counts them: WordPiece splits "," off; byte-level and SentencePiece words run
    # from space to space ("movement," is one)
    assert num_words[0] == (7 if kind == "wordpiece" else 6), tokens
    if marker:
        assert all(not t.startswith(marker) for t in vocab.tokens)  # compared without the marker
    candidates = word_candidates(vocab)
    the = tok.convert_tokens_to_ids(marker + ("the" if kind == "wordpiece" else "The"))
    assert not candidates[the] and not candidates[vocab.cls_id]  # a stopword, a special token
    assert candidates[ids[0, 2]]  # "anarch" or "anarchism", as the vocabulary has it


@pytest.mark.parametrize("kind", ["wordpiece", "bpe", "unigram"])
def test_the_unknown_token_is_special_and_never_masked(trained, kind):
    """Each family's unknown token is among the special ids, so whole-word masking never takes it, even with a
    budget of every token (byte-level BPE spells any character in bytes and never emits it)."""
    tok = AutoTokenizer.from_pretrained(str(trained[kind]), local_files_only=True)
    vocab = Vocabulary.of_tokenizer(trained[kind])
    assert vocab.special[tok.unk_token_id]
    ids = np.array(tok(TEXT + " \u2603 of \U0001F600 rivers", add_special_tokens=False)["input_ids"])
    assert bool((ids == tok.unk_token_id).sum() >= 2) == (kind != "bpe")
    masked = MLMCollator(vocab, mlm_ratio=1.0)([{"ids": ids}] * 8)["mlm_labels"][:, 1:len(ids) + 1].numpy() != -100
    assert (masked == (ids != tok.unk_token_id)).all()


def test_the_llm_kind_splits_as_llama3_and_ends_each_text_with_eos(trained):
    llm = AutoTokenizer.from_pretrained(str(trained["llm"]), local_files_only=True)
    # digits go in threes at most (the split's \p{N}{1,3}), so no long number becomes one piece
    assert "".join(llm.tokenize(" 1234567")) == "Ġ1234567"
    assert max(len(piece.lstrip("Ġ")) for piece in llm.tokenize(" 1234567")) <= 3
    pair = llm.convert_ids_to_tokens(llm("a query", "a passage")["input_ids"])
    assert pair[0] == "<|begin_of_text|>" and pair.count("<|end_of_text|>") == 2 and pair[-1] == "<|end_of_text|>"
    assert llm.unk_token is None  # byte-level: every text has its bytes


def test_a_trained_tokenizer_beside_a_models_config_keeps_its_vocabulary(trained, tmp_path):
    """An export of a decoder LLM holds the shards' tokenizer beside the model's config.json: read from there, its
    vocabulary (and fingerprint) is the one trained, not the model type's class with its own special tokens
    (a qwen2 folder once gained Qwen2's <|endoftext|>), so runs from the export take the same shards."""
    import shutil

    from transformers import Qwen2Config

    folder = tmp_path / "export"
    shutil.copytree(trained["llm"], folder)
    Qwen2Config(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64).save_pretrained(folder)
    alone, beside = describe(trained["llm"]), describe(folder)
    assert beside.vocab_size == alone.vocab_size == 1000 and beside.fingerprint == alone.fingerprint
    assert "<|endoftext|>" not in load_backend(folder).get_vocab(with_added_tokens=True)


def test_the_bundled_vocabulary_is_read_as_before():
    """The bundled bert-base-uncased tokenizer gives the same Vocabulary through its config's roles as through
    BERT's names: masking on BERT is unchanged."""
    named = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    read = Vocabulary.of_tokenizer(DEFAULT_TOKENIZER)
    assert (named.cls_id, named.sep_id, named.pad_id, named.mask_id) == (read.cls_id, read.sep_id, read.pad_id,
                                                                         read.mask_id) == (101, 102, 0, 103)
    assert np.array_equal(named.continuation, read.continuation) and named.tokens == read.tokens
    assert read.continuation.sum() == 5828  # the "##" pieces of bert-base-uncased


def test_bad_records_stop_with_their_line_or_are_skipped_and_counted(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"id": str(i), "text": f"Document {i} speaks of rivers and mountains."}) for i in range(50)]
    lines[7] = "{not json"
    corpus.write_text("\n".join(lines) + "\n")
    assert _train(tmp_path / "tok", "bpe", source="jsonl", inputs=[corpus]) == 1
    assert f"{corpus}:8" in capsys.readouterr().err and not (tmp_path / "tok").exists()
    assert _train(tmp_path / "tok", "bpe", "--on-error", "skip", "--max-documents", "40", source="jsonl",
                  inputs=[corpus]) == 0
    record = json.loads((tmp_path / "tok" / TRAINING_RECORD).read_text())
    assert record["skipped"] == {"bad_json": 1} and record["documents"] == 40
    assert "40 documents" in capsys.readouterr().out
    # an existing tokenizer is not replaced unless asked
    assert _train(tmp_path / "tok", "bpe", source="jsonl", inputs=[corpus]) == 1
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("method", text_methods(METHODS))
def test_every_head_trains_on_a_byte_level_bpe_vocabulary(trained, tmp_path_factory, method):
    """Shards prepared with a trained RoBERTa-style tokenizer: each method's collator takes its <s> / </s> /
    <mask> and its word starts, and the head's loss goes down a step (a 1,000-token embedding table)."""
    shards = tmp_path_factory.getbasetemp() / "bpe-shards"
    if not (shards / "manifest.json").exists():
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(shards),
                               tokenizer=str(trained["bpe"]), max_len=128, workers=0))
    vocab = Vocabulary.of_tokenizer(trained["bpe"])
    stream = ShardStream([shards / "manifest.json"], seed=0, shuffle_buffer=8, tokenizer=str(trained["bpe"]))
    samples = [sample for sample, _ in zip(stream, range(8))]
    spec = get_method(method)
    options = spec.options_from({"max_len": 128})
    batch = spec.collator.from_options(options, vocab, seed=0)(samples)
    assert (batch["input_ids"][:, 0] == vocab.cls_id).all() and int(batch["input_ids"].max()) < 1000
    head = spec.build(options, ModelOptions(vocab_size=1000, hidden_size=32, num_layers=2, num_heads=2,
                                            intermediate_size=64), seed=0)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    first = head(batch)["loss"]
    first.backward()
    optimizer.step()
    assert torch.isfinite(first) and head(batch)["loss"].item() < first.item()


def test_pretraining_takes_the_tokenizer_of_its_shards(trained, tmp_path):
    """prepare -> pretrain (data.tokenizer) -> export with that tokenizer; shards of another vocabulary than
    the training tokenizer are refused before a step."""
    shards = tmp_path / "shards"
    manifest = prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(shards),
                                      tokenizer=str(trained["unigram"]), max_len=128, workers=0))
    assert manifest["tokenizer"]["fingerprint"] == describe(trained["unigram"]).fingerprint

    def pretrain(run_dir, *overrides):
        return subprocess.run(
            [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-retromae.yaml"), f"run_dir={run_dir}",
             f"data.manifests=[{shards / 'manifest.json'}]", "data.weights=null", "model.vocab_size=1000",
             "train.max_steps=2", "train.micro_batch_size=4", "checkpoint.every=2", *overrides],
            env=pretrain_env(), capture_output=True, text=True, timeout=600)

    refused = pretrain(tmp_path / "bundled")  # no data.tokenizer: the bundled WordPiece, not the shards' own
    assert refused.returncode == 1 and "another vocabulary than the training tokenizer" in refused.stderr
    assert "set data.tokenizer to the tokenizer they were prepared with" in refused.stderr  # the usual fix
    assert not (tmp_path / "bundled").exists()  # no skeleton of a run that never began

    done = pretrain(tmp_path / "run", f"data.tokenizer={trained['unigram']}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert result_line(done.stdout)["step"] == 2
    export = tmp_path / "run" / "export"
    assert describe(export).fingerprint == describe(trained["unigram"]).fingerprint
    assert AutoTokenizer.from_pretrained(str(export), local_files_only=True).cls_token == "<s>"


def test_a_vocabulary_past_65535_is_stored_as_int32(tmp_path):
    """XLM-R's 250k vocabulary does not fit uint16: the shards hold int32 ids, and ids past 65,535 come back."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words = [f"w{i}" for i in range(70_000)]
    backend = Tokenizer(models.WordPiece({t: i for i, t in enumerate(special + words)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(str(tmp_path / "tok"))
    corpus = tmp_path / "corpus.jsonl.gz"
    texts = [" ".join(f"w{(i * 7919 + j * 104729) % 70_000}" for j in range(40)) + "." for i in range(30)]
    with gzip.open(corpus, "wt") as f:
        f.writelines(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
    manifest = prepare(PrepareOptions(source="jsonl", inputs=[str(corpus)], out=str(tmp_path / "shards"),
                                      tokenizer=str(tmp_path / "tok"), max_len=64, packing="passage", workers=0))
    assert manifest["token_dtype"] == "int32" and manifest["tokenizer"]["vocab_size"] == 70_005
    expected = {tuple(backend.encode(t, add_special_tokens=False).ids[:62]) for t in texts}
    got = {tuple(int(i) for i in sample["ids"])
           for sample in ShardStream([tmp_path / "shards" / "manifest.json"], seed=0, shuffle_buffer=1)}
    assert got == expected and max(max(ids) for ids in got) > 65_535
