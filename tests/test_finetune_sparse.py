"""Fine-tuning with pooling `sparse` (LexMAE's and SPLADE's): the loss is the contrastive loss over SPLADE vectors
plus the FLOPS regulariser (Paria et al. 2020), each against its formula written out over the full MLM logits;
refusals name their key; a LexMAE export fine-tuned by `pretrieve finetune` exports a model that `eval` and
`mine` read as sparse, scoring with the fine-tuned weights."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient
from omegaconf import OmegaConf
from support import SAMPLES, pretrain_env, write_beir
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertConfig, BertForMaskedLM

from pretrieve.config import ConfigError
from pretrieve.data.retrieval import load_beir
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.finetune.batches import GroupLoader
from pretrieve.finetune.examples import read_examples
from pretrieve.finetune.models import DualEncoder
from pretrieve.models.encoder import Encoder
from pretrieve.models.representation import keep_top_k, sparse_representation

pytestmark = pytest.mark.system

FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
CONFIGS = Path(__file__).parent.parent / "configs" / "finetune"


def _tiny_encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64)).eval()


def _flops(vectors: torch.Tensor) -> torch.Tensor:
    """Sum over the vocabulary of (the mean absolute weight over the batch)^2, written out."""
    return sum(vectors[:, j].abs().mean() ** 2 for j in range(vectors.shape[1]))


def test_sparse_pooling_loss_is_contrastive_over_splade_vectors_plus_flops():
    """By default the vectors pool the text's tokens without [CLS] and [SEP], as LexMAE's released fine-tuning
    (`keep_special_tokens` off: positions whose id is not [CLS]'s or [SEP]'s); `sparse_special_tokens` pools
    those too."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    batch = next(iter(GroupLoader(read_examples(FLAG), tokenizer, 3, 2, 16, 24, seed=0)))
    encoder = _tiny_encoder()
    model = DualEncoder(encoder, pooling="sparse", flops=(0.3, 0.7))

    def splade(kind, special_tokens=False):  # eq. 4 over the whole [B, L, vocab] logits of the MLM head
        ids, mask = batch[f"{kind}_input_ids"], batch[f"{kind}_attention_mask"]
        pooled = mask if special_tokens else mask * (ids != tokenizer.cls_token_id) * (ids != tokenizer.sep_token_id)
        return sparse_representation(encoder.mlm_logits(encoder(ids, mask)), pooled)

    with torch.no_grad():
        q, p = splade("query"), splade("passage")
        ranking = F.cross_entropy(q @ p.T, torch.tensor([0, 3, 6]))
        expected = ranking + 0.3 * _flops(q) + 0.7 * _flops(p)
    out = model(batch)
    torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["ranking_loss"], ranking, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["flops_passage"], _flops(p), rtol=1e-5, atol=1e-7)
    assert out["query_terms"] == (q > 0).sum(dim=1).float().mean()
    out["loss"].backward()  # the MLM head and the encoder learn through each entry's winning position
    assert encoder.mlm_transform.dense.weight.grad.abs().sum() > 0 and encoder.mlm_bias.grad.abs().sum() > 0
    assert encoder.model.encoder.layer[0].output.dense.weight.grad.abs().sum() > 0

    unregularised = DualEncoder(encoder, pooling="sparse")(batch)
    torch.testing.assert_close(unregularised["loss"], ranking, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        q, p = splade("query", special_tokens=True), splade("passage", special_tokens=True)
        with_specials = F.cross_entropy(q @ p.T, torch.tensor([0, 3, 6]))
    assert abs(with_specials - ranking) > 1e-3
    out = DualEncoder(encoder, pooling="sparse", sparse_special_tokens=True)(batch)
    torch.testing.assert_close(out["loss"], with_specials, rtol=1e-5, atol=1e-6)


def test_eval_pools_special_tokens_as_the_fine_tuning_recorded(tmp_path):
    """A model's sparse vectors leave out [CLS] and [SEP] unless its pretrieve_finetune.json says its fine-tuning
    pooled them (or is a sparse fine-tuning recorded before the option, which pooled them)."""
    from pretrieve.eval.encode import EncodeOptions, VocabEncoder
    from pretrieve.models.representation import sparse_special_tokens

    export = _tiny_lexmae_export(tmp_path / "pretrained")
    assert not sparse_special_tokens(export)
    meta = export / "pretrieve_finetune.json"
    for record, pooled in (({"pooling": "sparse", "sparse_special_tokens": False}, False),
                           ({"pooling": "sparse", "sparse_special_tokens": True}, True),
                           ({"pooling": "sparse"}, True), ({"pooling": "cls"}, False)):
        meta.write_text(json.dumps(record))
        assert sparse_special_tokens(export) is pooled
    meta.write_text(json.dumps({"pooling": "sparse", "sparse_special_tokens": False}))
    texts = ["the cat sat on the mat", "a dog"]
    _, got = VocabEncoder(export, EncodeOptions("sparse", 32)).encode(texts, documents=False, progress=False)
    encoder = VocabEncoder(export, EncodeOptions("sparse", 32)).encoder
    tokens = AutoTokenizer.from_pretrained(export)(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = DualEncoder(encoder, pooling="sparse").embed(tokens["input_ids"], tokens["attention_mask"],
                                                                queries=True)
    torch.testing.assert_close(torch.from_numpy(got.toarray()), expected)


def test_a_sparse_model_is_encoded_with_the_prompts_it_was_fine_tuned_with(tmp_path):
    """A sparse export has no sentence-transformers files: its pretrieve_finetune.json gives the prompts its
    fine-tuning put before each text and the length it read them at, and eval's encoder puts the prompts there
    too (before, it read neither: a model fine-tuned with an instruction was scored without it, silently)."""
    from pretrieve.eval.encode import VocabEncoder
    from pretrieve.eval.model_config import resolve_encoding

    export = _tiny_lexmae_export(tmp_path / "pretrained")
    prompts = {"query_prompt": "search query: ", "passage_prompt": "passage: "}
    (export / "pretrieve_finetune.json").write_text(json.dumps(
        {"pooling": "sparse", "sparse_special_tokens": False, "max_length": 40,
         "options": {**prompts, "passage_max_len": 32}}))
    encoding = resolve_encoding(export, announce=False)
    assert (encoding.query_prompt, encoding.passage_prompt, encoding.max_length) == (*prompts.values(), 40)
    encoder = VocabEncoder(export, encoding.encode_options(8))
    model, tokens = DualEncoder(encoder.encoder, pooling="sparse"), AutoTokenizer.from_pretrained(export)
    texts = ["the cat sat on the mat", "a dog"]
    for queries, prompt in ((True, prompts["query_prompt"]), (False, prompts["passage_prompt"])):
        _, got = encoder.encode(texts, documents=not queries, progress=False)
        batch = tokens([prompt + text for text in texts], padding=True, return_tensors="pt")
        with torch.no_grad():
            expected = model.embed(batch["input_ids"], batch["attention_mask"], queries=queries)
        expected = expected if queries else keep_top_k(expected, encoder.top_k)
        torch.testing.assert_close(torch.from_numpy(got.toarray()), expected)


def test_sparse_pooling_refusals_name_their_key(tmp_path):
    encoder = _tiny_encoder()
    with pytest.raises(ValueError, match="finetune.normalize: pooling sparse"):
        DualEncoder(encoder, pooling="sparse", normalize=True)
    with pytest.raises(ValueError, match="finetune.flops"):
        DualEncoder(encoder, pooling="cls", flops=(0.1, 0.1))
    encoder.load_report = ["MLM head: not in init_from (initialised)"]
    with pytest.raises(ValueError, match="sparse scores through the model's MLM head"):
        DualEncoder(encoder, pooling="sparse")
    with pytest.raises(ValueError, match="(?s)^finetune.pooling: sparse scores through .*\nfinetune.normalize"):
        DualEncoder(encoder, pooling="sparse", normalize=True)  # every problem, the missing head first

    from pretrieve.finetune.config import finetune_experiment, flops_weights

    model, backbone = tmp_path / "bert-mlm", tmp_path / "bert"  # with its MLM head, and the backbone alone
    torch.manual_seed(0)
    BertForMaskedLM(_tiny_encoder().config).save_pretrained(str(model))
    _tiny_encoder().model.save_pretrained(str(backbone))
    for folder in (model, backbone):
        AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER).save_pretrained(str(folder))
    config = OmegaConf.load(CONFIGS / "tiny.yaml")
    for overrides, message in ((["finetune.flops_query=0.1"], "finetune.flops_query: weighs pooling sparse"),
                               (["finetune.pooling=sparse", "finetune.flops_passage=-1"],
                                "finetune.flops_passage: must be >= 0"),
                               (["finetune.pooling=sparse", "finetune.normalize=true"],
                                "finetune.normalize: pooling sparse"),
                               (["finetune.pooling=sparse", "finetune.matryoshka_dims=[16]"],
                                "finetune.matryoshka_dims: pooling sparse"),
                               (["finetune.sparse_special_tokens=true"], "finetune.sparse_special_tokens: pools")):
        merged = OmegaConf.merge(config, OmegaConf.from_dotlist([f"finetune.init_from={model}",
                                                                 f"finetune.data=[{FLAG}]", *overrides]))
        with pytest.raises(ConfigError, match=message):
            finetune_experiment(merged)

    # a model with no MLM head (a sentence-transformers MiniLM, say) asked to normalize: both problems at once, the
    # missing head first
    with pytest.raises(ConfigError) as refused:
        finetune_experiment(OmegaConf.merge(config, OmegaConf.from_dotlist([
            f"finetune.init_from={backbone}", f"finetune.data=[{FLAG}]", "finetune.pooling=sparse",
            "finetune.normalize=true"])))
    assert [p.split(":")[0] for p in refused.value.problems] == ["finetune.pooling", "finetune.normalize"]
    assert "sparse scores through the model's MLM head, and init_from has none" in refused.value.problems[0]

    recipe = OmegaConf.merge(OmegaConf.load(CONFIGS / "sparse.yaml"), OmegaConf.from_dotlist(  # LexMAE's stage 1
        [f"finetune.init_from={model}", "finetune.msmarco=null", "finetune.hard_negatives=null",
         f"finetune.data=[{FLAG}]"]))
    options = finetune_experiment(recipe).options
    assert options.pooling == "sparse" and flops_weights(options) == (0.0015, 0.002) and options.negatives == 15
    assert flops_weights(replace(options, flops_query=None, flops_passage=0.01)) == (0.0015, 0.01)


def _tiny_lexmae_export(out: Path) -> Path:
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method

    torch.manual_seed(0)
    method = get_method("lexmae")
    return export(method.build(method.options_from({"max_len": 64}),
                               ModelOptions(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)), out)


def test_a_lexmae_export_fine_tuned_sparse_is_evaluated_and_mined_sparse(tmp_path):
    """`pretrieve finetune` with pooling sparse lowers its loss; the export records the pooling and the FLOPS
    weights and writes no sentence-transformers files; `pretrieve eval` then scores with pooling sparse by
    default, its scores the fine-tuned model's SPLADE inner products; `pretrieve mine` searches sparse."""
    from test_finetune import _epoch_losses

    from pretrieve.eval.evaluate import EvalOptions, run_eval
    from pretrieve.finetune.mine import MineOptions, mine
    from pretrieve.models.encoder import load_encoder

    pretrained = _tiny_lexmae_export(tmp_path / "pretrained")
    run_dir = tmp_path / "stage1"
    subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(CONFIGS / "tiny.yaml"),
                    f"finetune.init_from={pretrained}", f"finetune.data=[{FLAG}]", "finetune.pooling=sparse",
                    "finetune.flops_query=0.001", "finetune.passage_max_len=48", "train.micro_batch_size=4",
                    "train.max_steps=6", "checkpoint.every=6", f"run_dir={run_dir}", "tracking.enabled=true",
                    f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", "tracking.system_metrics_every=null"],
                   check=True, env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True)
    loss = _epoch_losses(run_dir)
    assert loss["after"] < loss["before"], loss
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all({"flops_query", "flops_passage", "passage_terms", "ranking_loss"} <= r.keys()
               for r in records if "loss" in r)

    export = run_dir / "export"
    meta = json.loads((export / "pretrieve_finetune.json").read_text())
    assert meta["pooling"] == "sparse" and meta["flops"] == {"query": 0.001, "passage": 0.002}
    assert meta["sparse_special_tokens"] is False  # eval and mine pool as the fine-tuning did: without them
    assert meta["max_length"] == 48  # what eval reads texts at: passage_max_len, above query_max_len's 32
    assert not (export / "modules.json").exists()
    card = (export / "README.md").read_text()  # the model card says what it is and how to use it
    assert "A learned sparse retriever" in card and "pipeline_tag: feature-extraction" in card
    # the weights the run trained with, everywhere: the card's options, the export's and MLflow's params
    assert "(queries 0.001, passages 0.002)" in card and "flops_passage: 0.002" in card
    assert (meta["options"]["flops_query"], meta["options"]["flops_passage"]) == (0.001, 0.002)
    run = json.loads((run_dir / "run.json").read_text())
    params = MlflowClient(tracking_uri=run["tracking_uri"]).get_run(run["run_id"]).data.params
    assert (params["finetune.flops_query"], params["finetune.flops_passage"]) == ("0.001", "0.002")
    assert params["finetune.pooling"] == "sparse" and params["train.grad_accum"] == "1"  # a default, resolved
    # the MLM head its SPLADE vectors come from loads in transformers' own class, nothing missing
    masked_lm, info = AutoModelForMaskedLM.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"], info
    ids = AutoTokenizer.from_pretrained(export)(["a political philosophy"], return_tensors="pt")
    tuned = load_encoder(export).eval()
    with torch.no_grad():
        torch.testing.assert_close(masked_lm.eval()(**ids).logits, tuned.mlm_logits(tuned(ids["input_ids"],
                                                                                          ids["attention_mask"])))
    assert f"pretrieve eval --model {export}" in card and "AutoModelForSequenceClassification" not in card

    data = load_beir(SAMPLES / "beir" / "scifact-sample")
    query_ids = list(data.queries)[:4]
    doc_ids = sorted({d for q in query_ids for d in data.qrels[q]} | set(list(data.corpus)[:30]))
    mini = write_beir(tmp_path / "mini", data, query_ids, doc_ids)
    result = run_eval(EvalOptions(out=str(tmp_path / "eval"), model=str(export), beir=str(mini), max_length=48,
                                  depth=30, progress=False))
    assert result["retriever"] == "sparse" and result["encoding_from"].endswith("pretrieve_finetune.json")

    model = DualEncoder(load_encoder(export).eval(), pooling="sparse")
    tokens = AutoTokenizer.from_pretrained(export)

    def vectors(texts: list[str], queries: bool) -> torch.Tensor:  # one padded batch, cut as eval cuts
        batch = tokens(texts, truncation=True, max_length=48, padding=True, return_tensors="pt")
        return model.embed(batch["input_ids"], batch["attention_mask"], queries=queries)

    with torch.no_grad():  # a document keeps the entries eval keeps (VocabEncoder's top k)
        documents = keep_top_k(vectors([data.doc_text(i) for i in doc_ids], False), result["vocab_top_k"])
        scores = vectors([data.queries[i] for i in query_ids], True) @ documents.T
    lines = [line.split() for line in (tmp_path / "eval" / "run.trec").read_text().splitlines()]
    got = {(qid, doc): float(score) for qid, _, doc, _, score, _ in lines}
    assert got, "no document shares a term with a query"
    top = {}
    for qid in query_ids:  # each query's best document by the fine-tuned model's own scores
        top[qid] = doc_ids[int(scores[query_ids.index(qid)].argmax())]
    for (qid, doc), score in got.items():
        assert score == pytest.approx(scores[query_ids.index(qid), doc_ids.index(doc)].item(), rel=1e-4, abs=1e-4)
    assert all(max(((s, d) for (q, d), s in got.items() if q == qid))[1] == top[qid] for qid in query_ids)

    hard = tmp_path / "hard.jsonl"
    mined = mine(MineOptions(model=str(export), out=str(hard), data=[str(FLAG)], depth=20, negatives=3,
                             max_length=48, progress=False))
    assert mined["pooling"] == "sparse"
    assert all(len(e.neg) == 3 and not set(e.neg) & set(e.pos) for e in read_examples(hard))


@pytest.mark.integration  # a fine-tuning chain and five evaluations (about a minute)
def test_a_lexmae_checkpoint_goes_through_the_farm_sparse_beside_bm25_and_dense(tmp_path):
    """The farm evaluates a LexMAE export with pooling sparse, zero-shot and fine-tuned (stage 1 with pooling
    sparse), beside the same export pooled by [CLS] and BM25, on part of the bundled SciFact sample; every job is
    logged to MLflow with its retriever."""
    from mlflow.tracking import MlflowClient
    from support import beir_subset

    from pretrieve.orchestrate.farm import run_farm

    pretrained = _tiny_lexmae_export(tmp_path / "lexmae")
    beir = beir_subset(tmp_path / "beir", queries=8, other_docs=24)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({
        "out": str(tmp_path / "farm"), "workers": 2, "tracking": {"uri": uri, "experiment": "sparse"},
        "eval": {"max_length": 48, "depth": 30},
        "checkpoints": [{"name": "sparse", "model": str(pretrained), "pooling": "sparse"},
                        {"name": "dense", "model": str(pretrained), "pooling": "cls"},
                        {"name": "bm25", "bm25": True}],
        "datasets": [{"name": "mini", "beir": str(beir)}],
        "stages": ["zero-shot", "stage1"],
        "finetune": {"config": str(CONFIGS / "tiny.yaml"), "beir": str(beir), "split": "test",
                     "overrides": ["train.max_steps=4", "train.micro_batch_size=4", "finetune.negatives=0",
                                   "finetune.passage_max_len=48"]}}))
    result = run_farm(farm, progress=False)
    assert not result["failed"] and len(result["logged"]) == 5, result

    retriever = {}
    for name, stage in (("sparse", "zero-shot"), ("sparse", "stage1"), ("dense", "zero-shot"), ("dense", "stage1"),
                        ("bm25", "zero-shot")):
        metrics = json.loads((tmp_path / "farm" / name / "mini" / stage / "metrics.json").read_text())
        assert metrics["queries"] == 8 and 0 <= metrics["ndcg@10"] <= 1
        retriever[name, stage] = metrics["retriever"]
    assert retriever == {("sparse", "zero-shot"): "sparse", ("sparse", "stage1"): "sparse",
                         ("dense", "zero-shot"): "dense", ("dense", "stage1"): "dense", ("bm25", "zero-shot"): "bm25"}
    meta = json.loads((tmp_path / "farm" / "sparse" / "finetune" / "stage1" / "export" / "pretrieve_finetune.json")
                      .read_text())
    assert meta["pooling"] == "sparse" and meta["flops"] == {"query": 0.0015, "passage": 0.002}

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("sparse").experiment_id])
    evals = sorted((r.data.tags["checkpoint"], r.data.tags["stage"]) for r in runs
                   if r.data.tags.get("pretrieve.farm") == "eval")
    assert evals == sorted(retriever)
