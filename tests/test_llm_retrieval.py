"""A decoder LLM as a retriever downstream of pre-training: fine-tuned with last-token pooling and instruction
prompts (E5-Mistral / Qwen3-Embedding style), exported as a sentence-transformers model that carries both, and
evaluated by `pretrieve eval`, which reads them from the model."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support import SAMPLES, pretrain_env
from pretrieve.cli import main
from pretrieve.data.masking import Vocabulary
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.export import export
from pretrieve.models.heads import get_method

pytestmark = pytest.mark.integration  # fine-tuning, export, sentence-transformers and eval together

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SCIFACT = SAMPLES / "beir" / "scifact-sample"
PAIRS = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
QUERY = "Instruct: Given a question, retrieve the passage that answers it\nQuery: "
QUERY_OVERRIDE = 'finetune.query_prompt="Instruct: Given a question, retrieve the passage that answers it\\nQuery: "'


@pytest.fixture(scope="module")
def init(llm, tmp_path_factory) -> Path:
    """A tiny Qwen3 pooling its last token: a contrastive export."""
    tokenizer = llm[0]
    vocab = Vocabulary.of_tokenizer(tokenizer)
    method = get_method("contrastive")
    options = method.options_from({"pooling": "last", "max_len": 64})
    model = ModelOptions(backbone="qwen3", vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0)
    out = tmp_path_factory.mktemp("llm-retriever") / "init"
    return export(method.build(options, model, seed=0), out, tokenizer=tokenizer)


def _finetune(init: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`pretrieve finetune` of `init` for 2 steps, with a query instruction and a passage prompt."""
    done = subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(CONFIGS / "finetune" / "tiny.yaml"),
                           f"finetune.init_from={init}", f"finetune.data=[{PAIRS}]",
                           QUERY_OVERRIDE,  # quoted: YAML reads an unquoted "a: b" as a mapping
                           'finetune.passage_prompt="Passage: "', "finetune.passage_max_len=64",
                           "train.micro_batch_size=4", "train.max_steps=2", "checkpoint.every=2", f"run_dir={run_dir}",
                           *overrides], env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def finetuned(init) -> Path:
    """The tiny Qwen3 fine-tuned; its export."""
    _finetune(init, init.parent / "run")
    return init.parent / "run" / "export"


def test_the_export_carries_its_prompts_and_pooling(finetuned):
    st = json.loads((finetuned / "config_sentence_transformers.json").read_text())
    assert st["prompts"] == {"query": QUERY, "passage": "Passage: "}
    assert json.loads((finetuned / "1_Pooling" / "config.json").read_text())["pooling_mode_lasttoken"] is True
    assert json.loads((finetuned / "config.json").read_text())["model_type"] == "qwen3"
    card = (finetuned / "README.md").read_text()  # the card names the family, the pooling and the prompts
    assert "Qwen3" in card and "last pooling" in card and 'prompt_name="query"' in card and repr(QUERY) in card


def test_sentence_transformers_encodes_as_pretrieve_does(finetuned):
    """`SentenceTransformer(path).encode(texts, prompt_name=...)` equals pretrieve's encoder with the settings it
    reads from the model (last token, the prompts), for queries and for passages."""
    from sentence_transformers import SentenceTransformer

    from pretrieve.eval.encode import DenseEncoder
    from pretrieve.eval.model_config import resolve_encoding

    encoding = resolve_encoding(finetuned, announce=False)
    assert (encoding.pooling, encoding.query_prompt, encoding.passage_prompt) == ("last", QUERY, "Passage: ")
    ours = DenseEncoder(finetuned, encoding.encode_options(batch_size=4))
    st = SentenceTransformer(str(finetuned), device="cpu")
    texts = ["What causes tides on Earth?", "The moon's gravity pulls the oceans, raising two bulges.", "Tides."]
    for name, queries in (("query", True), ("passage", False)):
        expected = st.encode(texts, prompt_name=name, convert_to_numpy=True, batch_size=4)
        np.testing.assert_allclose(ours.encode(texts, progress=False, queries=queries), expected, rtol=1e-4,
                                   atol=1e-5)
    assert not np.allclose(ours.encode(texts, progress=False, queries=True),
                           ours.encode(texts, progress=False, queries=False), atol=1e-3)  # the prompts count


def test_eval_reads_the_prompts_from_the_model_and_takes_others_given(finetuned, tmp_path, capsys):
    from pretrieve.eval.model_config import resolve_encoding

    assert main(["eval", "--model", str(finetuned), "--beir", str(SCIFACT), "--out", str(tmp_path / "eval")]) == 0
    said = capsys.readouterr().err
    assert "pooling last" in said and f"query prompt {QUERY!r}" in said and "passage prompt 'Passage: '" in said
    assert 0 <= json.loads((tmp_path / "eval" / "metrics.json").read_text())["ndcg@10"] <= 1
    given = resolve_encoding(finetuned, query_prompt="", announce=False)  # `--query-prompt ""`: none
    assert (given.query_prompt, given.passage_prompt, given.flags) == ("", "Passage: ", ("query_prompt",))


def test_lora_fine_tuning_trains_adapters_on_the_frozen_base_and_exports_them(init, tmp_path):
    """`finetune.lora` (LLARA's and E5-Mistral's fine-tuning): the run's export keeps the adapter apart
    (`keep_adapter`) over the base weights exactly as init_from had them; a merged export of the same checkpoint
    (`pretrieve export RUN OUT --no-keep-adapter`) is a plain model that encodes as `pretrieve eval` encodes the
    kept-apart one; the card says which."""
    from safetensors.torch import load_file

    from pretrieve.eval.encode import DenseEncoder, EncodeOptions
    from pretrieve.models.lora import ADAPTER_DIR

    done = _finetune(init, tmp_path / "run", "finetune.lora.r=4", "finetune.lora.keep_adapter=true", "train.lr=0.05")
    assert "LoRA r=4:" in done.stderr
    kept = tmp_path / "run" / "export"
    base, plain = load_file(init / "model.safetensors"), load_file(kept / "model.safetensors")
    assert plain.keys() == base.keys() and all(torch.equal(plain[k], base[k]) for k in base)
    assert (kept / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert "adapters are kept apart" in (kept / "README.md").read_text()

    done = subprocess.run([sys.executable, "-m", "pretrieve", "export", str(tmp_path / "run"),
                           str(tmp_path / "merged"), "--no-keep-adapter"], env=pretrain_env(), capture_output=True,
                          text=True, check=True)
    assert "a fine-tuned dual encoder (contrastive loss) from" in done.stdout, done.stdout
    merged = tmp_path / "merged"
    weights = load_file(merged / "model.safetensors")
    assert weights.keys() == base.keys() and not (merged / ADAPTER_DIR).exists()
    changed = [k for k in base if not torch.equal(weights[k], base[k])]
    assert changed and all(k.split(".")[-2].endswith("proj") for k in changed)  # the adapted layers only
    texts = ["What causes tides on Earth?", "The moon's gravity pulls the oceans, raising two bulges."]
    vectors = [DenseEncoder(model, EncodeOptions("last", normalize=True, max_length=64, batch_size=2)).encode(
               texts, progress=False) for model in (kept, merged)]
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=1e-4, atol=1e-5)
    assert not np.allclose(vectors[1], DenseEncoder(init, EncodeOptions("last", normalize=True, max_length=64,
                                                                        batch_size=2)).encode(texts, progress=False),
                           atol=1e-4)  # the adapters learned something


def test_bf16_fine_tuning_of_a_decoder_llm_exports_a_model_eval_reads(init, tmp_path):
    """`train.precision=bf16` (DeepSpeed's bf16 on CPU here; the GPU's precision) with last-token pooling and the
    prompts: the run trains in bf16 with a finite loss, and its export encodes to finite, distinct vectors."""
    from omegaconf import OmegaConf

    from pretrieve.eval.encode import DenseEncoder
    from pretrieve.eval.model_config import resolve_encoding

    _finetune(init, tmp_path / "run", "train.precision=bf16", "train.log_every=1")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").train.precision == "bf16"
    assert [r["step"] for r in records if np.isfinite(r.get("loss", np.nan))] == [1, 2], records
    export = tmp_path / "run" / "export"
    encoding = resolve_encoding(export, announce=False)
    vectors = DenseEncoder(export, encoding.encode_options(batch_size=2)).encode(
        ["What causes tides?", "The moon's gravity pulls the oceans."], progress=False, queries=True)
    assert np.isfinite(vectors).all() and not np.allclose(vectors[0], vectors[1])
