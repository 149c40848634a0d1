"""Exports are sentence-transformers models and carry a model card: `SentenceTransformer(export).encode` equals
`pretrieve encode` (1e-5) for cls, mean and normalised models, pre-trained and fine-tuned; the card's YAML
parses and names the method, steps and tokens; a farm evaluation of the export lands in its card (the farm
writes it again; so does `pretrieve card`). The real sentence-transformers library (the `dev` extra) loads them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import SAMPLES, beir_subset, pretrain_env, result_line

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import load_beir
from pretrieve.eval.model_config import declared_encoding
from pretrieve.models.st_config import read_st_config, write_st_config

pytestmark = pytest.mark.system

pytest.importorskip("sentence_transformers")
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"


@pytest.fixture(scope="module")
def mini_beir(tmp_path_factory) -> Path:
    """Real SciFact text, some of it longer than the models' maximum lengths (truncation must agree too)."""
    return beir_subset(tmp_path_factory.mktemp("beir") / "scifact-mini", queries=4, other_docs=12)


def _assert_encode_equals_sentence_transformers(model: Path, beir: Path, out: Path) -> np.ndarray:
    """`pretrieve encode --model MODEL` (no flags: the model's own config) against SentenceTransformer(MODEL)."""
    from sentence_transformers import SentenceTransformer

    assert cli(["encode", "--model", str(model), "--beir", str(beir), "--out", str(out)]) == 0
    ours = np.load(out / "corpus-00000.npy")
    data = load_beir(beir)
    ids = (out / "corpus-00000.ids").read_text().splitlines()
    theirs = SentenceTransformer(str(model), device="cpu").encode([data.doc_text(d) for d in ids], batch_size=8,
                                                                  convert_to_numpy=True)
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    return ours


@pytest.mark.parametrize("pooling, normalize", [("cls", False), ("mean", False), ("mean", True)])
def test_written_config_round_trips(tmp_path, tiny_encoder, mini_beir, capsys, pooling, normalize):
    model = tmp_path / "model"
    shutil.copytree(tiny_encoder, model)
    write_st_config(model, pooling, normalize, max_length=48)
    st = read_st_config(model)
    assert (st.pooling, st.normalize, st.max_length, st.dense, st.unsupported) == (pooling, normalize, 48, False, ())
    assert (model / "2_Normalize").is_dir() == normalize
    written = json.loads((model / "config_sentence_transformers.json").read_text())
    assert written["similarity_fn_name"] == ("cosine" if normalize else "dot")
    import sentence_transformers  # the release that reads the files here, as its own save records it

    assert written["__version__"]["sentence_transformers"] == sentence_transformers.__version__
    vectors = _assert_encode_equals_sentence_transformers(model, mini_beir, tmp_path / "vectors")
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0) == normalize
    assert f"pooling {pooling}, {'normalized' if normalize else 'not normalized'}, max length 48" in \
        capsys.readouterr().err


def _front_matter(card: str) -> tuple[dict, str]:
    assert card.startswith("---\n")
    meta, body = card[4:].split("\n---\n", 1)
    return yaml.safe_load(meta), body


def _run_card_snippet(card: str, expect_dim: int) -> None:
    """The card's Python snippet, run as a user would paste it: it loads the model and encodes without error."""
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    check = "\nimport numpy\nfor name, value in dict(locals()).items():\n    if isinstance(value, numpy.ndarray):\n" \
            f"        assert value.shape[-1] == {expect_dim}, (name, value.shape)\nprint('snippet ok')\n"
    done = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "snippet ok" in done.stdout, code + done.stderr[-2000:]


def test_finetuned_export_is_a_sentence_transformers_model_with_a_card(tmp_path, tiny_encoder, mini_beir):
    run_dir = tmp_path / "ft"
    done = subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(CONFIGS / "finetune" / "tiny.yaml"),
                           f"finetune.init_from={tiny_encoder}", f"finetune.data=[{FLAG}]", "finetune.pooling=mean",
                           "finetune.normalize=true", "finetune.temperature=0.05", "train.micro_batch_size=4",
                           "train.max_steps=2", "checkpoint.every=2", f"run_dir={run_dir}"],
                          check=True, env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True)
    result = result_line(done.stdout)
    export = run_dir / "export"
    declared = declared_encoding(export)
    assert (declared.pooling, declared.normalize, declared.max_length) == ("mean", True, 96)  # tiny.yaml's length
    assert (export / "2_Normalize").is_dir()
    _assert_encode_equals_sentence_transformers(export, mini_beir, tmp_path / "vectors")

    meta, body = _front_matter((export / "README.md").read_text())
    assert meta["library_name"] == "sentence-transformers" and meta["pipeline_tag"] == "sentence-similarity"
    assert meta["base_model"] == str(tiny_encoder) and meta["datasets"] == [FLAG.name]
    assert "finetune-dual" in meta["tags"] and "model-index" not in meta  # nothing evaluated yet
    assert "| method | fine-tuning, contrastive loss from" in body and "| steps | 2 of 2 (checkpoint step00000002) |" \
        in body
    assert f"| tokens seen | {result['tokens']:,} (non-padding) |" in body
    assert "mean pooling, normalised (cosine)" in body and "No evaluation logged yet" in body
    assert 'queries = model.encode(["a query"])' in body and "querys" not in body
    _run_card_snippet(body, expect_dim=64)


def test_pretraining_export_card_and_its_farm_evaluation(tmp_path, wiki_shards, books_shards, mini_beir):
    """A DupMAE pre-training run with validation, tracked in a sqlite MLflow store: its export is a [CLS]
    sentence-transformers model whose card says what was trained; the farm's evaluation of the export (nested
    under the run) then appears in the card, as a table and as model-index results."""
    from pretrieve.orchestrate.farm import run_farm

    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain",
                           str(CONFIGS / "pretrain" / "tiny-dupmae.yaml"), f"run_dir={run_dir}",
                           f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                           "data.corpora=[wikipedia]", f"data.validation=[{books_shards / 'manifest.json'}]",
                           "data.validation_batches=1", "train.eval_every=2", "method.max_len=64",
                           "train.micro_batch_size=4", "train.max_steps=2", "train.log_every=1", "checkpoint.every=2",
                           f"tracking.uri={uri}", "tracking.system_metrics_every=null"],
                          check=True, env=pretrain_env(), capture_output=True, text=True)
    result = result_line(done.stdout)
    export = run_dir / "export"
    assert declared_encoding(export).pooling == "cls" and read_st_config(export).max_length == 64
    _assert_encode_equals_sentence_transformers(export, mini_beir, tmp_path / "vectors")

    meta, body = _front_matter((export / "README.md").read_text())
    assert meta["library_name"] == "sentence-transformers" and "dupmae" in meta["tags"]
    assert meta["datasets"] == ["wikipedia"] and "base_model" not in meta
    assert "pre-trained with **dupmae**" in body and "dense part only" in body
    assert "[CLS] vector is the text's representation, not normalised" in body
    _run_card_snippet(body, expect_dim=64)
    assert "| steps | 2 of 2 (checkpoint step00000002) |" in body
    assert f"| tokens seen | {result['tokens']:,} (non-padding) |" in body
    validation = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if "val_loss" in line][-1]
    assert f"| validation loss | {validation['val_loss']:.4f} (" in body
    assert "| precision | fp32, ZeRO stage 0 |" in body
    assert f"`{result['mlflow_run_id']}` in {uri}" in body

    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "farm"), "tracking": {"uri": uri}, "eval": {"depth": 10},
                                "checkpoints": [{"name": "tiny", "model": str(export), "run_dir": str(run_dir)}],
                                "datasets": [{"name": "scifact-mini", "beir": str(mini_beir)}]}))
    assert run_farm(farm, progress=False)["logged"] == ["tiny/scifact-mini/zero-shot"]
    evaluated = json.loads((tmp_path / "farm" / "tiny" / "scifact-mini" / "zero-shot" / "metrics.json").read_text())
    assert evaluated["pooling"] == "cls" and "modules.json" in evaluated["encoding_from"]
    meta, body = _front_matter((export / "README.md").read_text())  # written again by the farm
    results = meta["model-index"][0]["results"]
    assert [r["dataset"]["name"] for r in results] == ["scifact-mini"]
    assert {m["type"]: m["value"] for m in results[0]["metrics"]}["ndcg_at_10"] == \
        pytest.approx(evaluated["ndcg@10"], abs=1e-6)
    assert f"| scifact-mini | test | zero-shot | {evaluated['ndcg@10']:.4f} |" in body

    (export / "README.md").unlink()  # `pretrieve card RUN` writes it from the run and its own store (run.json)
    assert cli(["card", str(run_dir)]) == 0
    assert _front_matter((export / "README.md").read_text())[0]["model-index"] == meta["model-index"]


LONG_PROMPT = "Instruct: " + " ".join(["given a scientific claim retrieve the research passages that support"]
                                      * 12) + "\nQuery: "  # 120 words and more tokens than passage_max_len 96


def test_a_long_query_prompt_leaves_each_query_its_own_tokens_in_the_export(tmp_path, tiny_encoder, mini_beir):
    """Fine-tuned with a 120-word query prompt (query_max_len 24 after it, passage_max_len 96): the export's
    max_seq_length makes room for the prompt and the query's own 24 tokens, so sentence-transformers'
    `prompt_name="query"` and `pretrieve eval`'s encoder give different queries different vectors, and the same
    ones. At max_seq_length 96 every query was cut inside the prompt: one vector for all."""
    from sentence_transformers import SentenceTransformer

    from pretrieve.eval.encode import DenseEncoder
    from pretrieve.eval.model_config import resolve_encoding

    run_dir = tmp_path / "ft"
    subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(CONFIGS / "finetune" / "tiny.yaml"),
                    f"finetune.init_from={tiny_encoder}", f"finetune.data=[{FLAG}]", "finetune.pooling=mean",
                    "finetune.normalize=true", f"finetune.query_prompt={json.dumps(LONG_PROMPT)}",
                    "train.micro_batch_size=4", "train.max_steps=1", "checkpoint.every=1", f"run_dir={run_dir}"],
                   check=True, env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True, text=True)
    export = run_dir / "export"
    prompt_tokens = len(SentenceTransformer(str(export), device="cpu").tokenizer(
        LONG_PROMPT, add_special_tokens=False)["input_ids"])
    queries = list(load_beir(mini_beir).queries.values())
    theirs = SentenceTransformer(str(export), device="cpu").encode(queries, prompt_name="query", batch_size=8,
                                                                   convert_to_numpy=True)
    encoding = resolve_encoding(export, announce=False)
    assert encoding.query_prompt == LONG_PROMPT
    ours = DenseEncoder(export, encoding.encode_options(8)).encode(queries, queries=True)
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    differences = np.abs(ours[:, None, :] - ours[None, :, :]).max(axis=-1)
    assert differences[~np.eye(len(queries), dtype=bool)].min() > 1e-3
    assert prompt_tokens > 96 and read_st_config(export).max_length == 24 + prompt_tokens
