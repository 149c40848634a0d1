"""Every loader of an export encodes as the model was trained: pretrieve's `eval` / `encode` / `mine` encoder and
sentence-transformers, for a bidirectional decoder LLM (LLM2Vec's MNTP) and for a LoRA export whose adapter is kept
apart (models/hf_model_code.py, models/export.py write_model_code / load_base_model). A weights file cut short is an
error naming it, in every loader."""

import pytest
import torch

from support import SAMPLES

from pretrieve.data.masking import Vocabulary
from pretrieve.eval.encode import DenseEncoder
from pretrieve.eval.model_config import resolve_encoding
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.export import export
from pretrieve.models.heads.registry import get_method
from pretrieve.models.hf_model_code import CODE_FILE
from pretrieve.models.lora import LoraOptions, add_lora

FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
TEXTS = ["Rivers cut valleys into the rock of the mountains.", "A short one.",
         "The library keeps old maps of the coast and its harbours, some drawn by hand."]


def _head(llm, method: str, bidirectional: bool):
    vocab = Vocabulary.of_tokenizer(llm[0])
    options = ModelOptions(backbone="qwen3", vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                           intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0, bidirectional=bidirectional)
    spec = get_method(method)
    return spec.build(spec.options_from({"max_len": 64}), options, seed=0).eval()


def _trained_vectors(head, tokenizer) -> torch.Tensor:
    """Each text's last-token state as the trained encoder computes it, one text at a time (no padding)."""
    with torch.no_grad():
        rows = [tokenizer(text, return_tensors="pt") for text in TEXTS]
        return torch.stack([head.encoder(r["input_ids"], r["attention_mask"])[0, -1] for r in rows])


def _st_vectors(path, **kwargs) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.from_numpy(SentenceTransformer(str(path), device="cpu", **kwargs).encode(TEXTS, batch_size=3))


def _pretrieve_vectors(path) -> torch.Tensor:
    """As `pretrieve eval` / `encode` encode passages with the model's own settings."""
    options = resolve_encoding(path, announce=False).encode_options(batch_size=3)
    return torch.from_numpy(DenseEncoder(path, options, device="cpu").encode(TEXTS, progress=False))


def test_a_bidirectional_export_encodes_bidirectionally_in_every_loader(llm, tmp_path):
    from transformers import AutoTokenizer

    head = _head(llm, "mntp", bidirectional=True)  # pools the last token
    out = export(head, tmp_path / "mntp", tokenizer=llm[0])
    assert (out / CODE_FILE).is_file()
    expected = _trained_vectors(head, AutoTokenizer.from_pretrained(str(llm[0])))
    torch.testing.assert_close(_pretrieve_vectors(out), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_st_vectors(out, trust_remote_code=True), expected, rtol=1e-4, atol=1e-5)
    # HF's own class, which the export's code replaces, attends causally: the vectors differ
    assert (_st_vectors(out) - expected).abs().max() > 1e-2

    causal = export(_head(llm, "contrastive", bidirectional=False), tmp_path / "causal", tokenizer=llm[0])
    assert not (causal / CODE_FILE).is_file()  # HF's class already encodes a causal model as trained


def _adapted_head(llm):
    """A causal decoder LLM's contrastive head with LoRA adapters whose weights are what a training would give
    (lora_B starts at zero, the adapter a no-op); the same weights at every call."""
    head = _head(llm, "contrastive", bidirectional=False)
    add_lora(head.encoder.model, LoraOptions(r=4, alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in head.encoder.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    return head


def test_an_export_with_its_adapter_apart_encodes_as_the_merged_one(llm, tmp_path):
    kept = export(_adapted_head(llm), tmp_path / "kept", tokenizer=llm[0], keep_adapter=True)
    assert (kept / CODE_FILE).is_file() and (kept / "adapter" / "adapter_config.json").is_file()
    merged = export(_adapted_head(llm), tmp_path / "merged", tokenizer=llm[0])
    assert not (merged / CODE_FILE).is_file()
    reference = _st_vectors(merged)
    torch.testing.assert_close(_pretrieve_vectors(merged), reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_pretrieve_vectors(kept), reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_st_vectors(kept, trust_remote_code=True), reference, rtol=1e-4, atol=1e-5)
    assert (_st_vectors(kept) - reference).abs().max() > 1e-2  # HF's class reads the frozen base alone


@pytest.mark.parametrize("method", ["mntp"])
def test_the_card_of_a_bidirectional_export_loads_it_with_its_own_code(llm, tmp_path, method):
    from pretrieve.eval.model_card import _usage
    from pretrieve.models.st_config import read_st_config

    out = export(_head(llm, method, bidirectional=True), tmp_path / "export", tokenizer=llm[0])
    usage = "\n".join(_usage(out, out, read_st_config(out)))
    assert f'SentenceTransformer("{out}", trust_remote_code=True)' in usage
    assert "attends in both directions as trained" in usage
    assert "prompt_name" not in usage  # the export names no prompt: encode() would refuse a name it lacks


def test_a_causal_decoder_llm_is_never_read_at_its_first_token(llm, tmp_path):
    """cls pooling on a causal decoder LLM gives every text the same vector: refused wherever it is asked for,
    naming the flag or key; with nothing said, a decoder LLM is read at its last token. A rotary model's
    positions bound --max-length as a position table does."""
    from omegaconf import OmegaConf

    from pretrieve.config import ConfigError
    from pretrieve.finetune.config import finetune_experiment

    causal = export(_head(llm, "contrastive", bidirectional=False), tmp_path / "causal", tokenizer=llm[0])
    with pytest.raises(ValueError, match=r"^--pooling cls: on a causal decoder LLM .* sees nothing of the text"):
        resolve_encoding(causal, pooling="cls", announce=False)
    bare = tmp_path / "bare"  # the same model with no sentence-transformers files
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (bare / name).write_bytes((causal / name).read_bytes())
    assert resolve_encoding(bare, announce=False).pooling == "last"
    with pytest.raises(ValueError, match="max length 100000: .* has 512 positions"):
        resolve_encoding(causal, max_length=100000, announce=False)
    bidirectional = export(_head(llm, "mntp", bidirectional=True), tmp_path / "mntp", tokenizer=llm[0])
    assert resolve_encoding(bidirectional, pooling="cls", announce=False).pooling == "cls"  # it sees the text
    config = {"finetune": {"init_from": str(causal), "data": [str(FLAG)], "pooling": "cls"}}
    with pytest.raises(ConfigError, match=r"finetune.pooling cls: on a causal decoder LLM"):
        finetune_experiment(OmegaConf.create(config))


def test_a_llama2vec_card_says_which_pooling_each_loader_gets(llm, tmp_path):
    from pretrieve.eval.model_card import _pretraining_facts

    out = export(_head(llm, "llama2vec", bidirectional=False), tmp_path / "export", tokenizer=llm[0])
    summary = _pretraining_facts(out, {})["summary"]
    assert "`pretrieve eval --model DIR --pooling llama2vec` reads it so" in summary
    assert "sentence-transformers and the plain last-token pooling" in summary


def test_a_contrastive_decoder_card_says_what_the_model_is(llm, tmp_path):
    """The card of a contrastive export on a decoder LLM: normalised as trained, its parameters' embeddings
    counted (a decoder's are `embed_tokens`), its samples pairs, and a BEIR collection named as such."""
    import json

    from pretrieve.eval.model_card import _dataset_names, _parameter_counts, _pretraining_facts

    out = export(_head(llm, "contrastive", bidirectional=False), tmp_path / "export", tokenizer=llm[0])
    manifest = tmp_path / "pairs" / "manifest.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"source": "beir", "inputs": [{"path": "/data/beir/scifact/corpus.jsonl"}]}))
    facts = _pretraining_facts(out, {"data": {"manifests": [str(manifest)], "corpora": ["beir"]}})
    assert "normalised (cosine)" in facts["summary"] and "not normalised" not in facts["summary"]
    assert facts["samples"] == "pairs" and facts["datasets"] == ["scifact"]
    counts = _parameter_counts(out)
    assert 0 < counts["embeddings"] < counts["encoder"]
    assert _dataset_names({"manifests": [str(tmp_path / "gone.json")], "corpora": ["wikipedia"]}) == ["wikipedia"]


def test_a_truncated_weights_file_is_named_by_every_loader(tmp_path, capsys):
    """A model.safetensors cut short (an interrupted copy) gives safetensors' SafetensorError, which names no file
    and is no ValueError (a traceback from the command line): every loader names the file instead."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from pretrieve.cli import main as cli
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
    from pretrieve.finetune.config import FinetuneOptions
    from pretrieve.finetune.mine import TeacherOptions, teacher_scores
    from pretrieve.finetune.run import build_model
    from pretrieve.models.encoder import Encoder, load_encoder
    from pretrieve.models.export import load_base_model

    model = tmp_path / "model"
    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(str(model))
    AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER).save_pretrained(str(model))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    named = f"{weights}: not a readable safetensors file"
    loaders = {"pretrain init_from": lambda: Encoder.build(ModelOptions(init_from=str(model))),
               "eval, encode, finetune dual": lambda: load_encoder(model), "eval dense": lambda: load_base_model(model),
               "finetune cross": lambda: build_model(FinetuneOptions(init_from=str(model), model="cross")),
               "teacher-scores": lambda: teacher_scores(TeacherOptions(str(model), [str(FLAG)], str(tmp_path / "s")))}
    for name, load in loaders.items():
        with pytest.raises(ValueError, match=named):
            load()
    for pooling in ("mean", "sparse"):
        assert cli(["eval", "--model", str(model), "--beir", str(SAMPLES / "beir" / "scifact-sample"), "--pooling",
                    pooling, "--out", str(tmp_path / f"eval-{pooling}")]) == 1
        assert f"pretrieve eval: error: {named}" in capsys.readouterr().err

