"""Matryoshka representation learning (models/matryoshka.py): the contrastive method's and the fine-tuned dual
encoder's loss is the weighted sum of each prefix's loss, computed here by hand from the vectors; GradCache gives
the loss and gradients of the whole batch with it on; the export records the dimensions, sentence-transformers'
`truncate_dim` gives the vectors of `pretrieve encode --dim`, and `eval --dim` scores them."""

import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import SAMPLES, beir_subset

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import load_beir
from pretrieve.models.matryoshka import matryoshka_of
from pretrieve.models.st_config import read_st_config, write_st_config

DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 0.25]


def _pairs(n: int = 6) -> list[dict]:
    rng = np.random.default_rng(0)
    ids = lambda: rng.integers(2000, 9000, size=int(rng.integers(4, 12)))  # noqa: E731
    return [{"query": ids(), "pos": ids(), "negs": [], "source": "t", "doc": f"d{i}", "index": i} for i in range(n)]


def _head(vocab, **extra):
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    method = get_method("contrastive")
    options = method.options_from({"max_len": 16, "query_max_len": 16, "temperature": 0.1, **extra})
    head = method.build(options, ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                              dropout=0.0, pad_token_id=0), seed=0)
    return head, method.collator.from_options(options, vocab)


def test_contrastive_loss_is_the_weighted_sum_of_each_prefixes_infonce(vocab):
    head, collate = _head(vocab, matryoshka_dims=DIMS, matryoshka_weights=WEIGHTS)
    batch = collate(_pairs())
    out = head(batch)
    with torch.no_grad():  # by hand: unnormalised pooled vectors, cut, normalised, InfoNCE q->d over the batch
        q = head.pool(head.encoder(batch["q_input_ids"], batch["q_attention_mask"]), batch["q_attention_mask"])
        d = head.pool(head.encoder(batch["p_input_ids"], batch["p_attention_mask"]), batch["p_attention_mask"])
        by_dim = {m: F.cross_entropy(F.normalize(q[:, :m], dim=-1) @ F.normalize(d[:, :m], dim=-1).T / 0.1,
                                     torch.arange(len(q))) for m in DIMS}
    for m in DIMS:
        assert out[f"loss@{m}"].item() == pytest.approx(by_dim[m].item(), rel=1e-5)
    assert out["loss"].item() == pytest.approx(sum(w * by_dim[m].item() for m, w in zip(DIMS, WEIGHTS)), rel=1e-5)
    assert len({round(v.item(), 4) for v in by_dim.values()}) == 3  # the prefixes really score differently
    plain, _ = _head(vocab)
    assert plain(batch)["loss"].item() == pytest.approx(by_dim[32].item(), rel=1e-5)  # the full width alone


def test_contrastive_grad_cache_with_matryoshka_equals_the_batch(vocab):
    """One backward through GradCache (3 texts at a time), symmetric, with the pairs' own negatives: the loss and
    every gradient of the whole batch encoded at once."""
    runs = []
    for chunk in (None, 3):
        head, collate = _head(vocab, matryoshka_dims=DIMS, symmetric=True, negatives=1,
                              **({"grad_cache": {"chunk": chunk}} if chunk else {}))
        pairs = [{**p, "negs": [p["pos"][::-1]]} for p in _pairs()]
        out = head(collate(pairs))
        out["loss"].backward()
        runs.append((out["loss"].item(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-6)
    assert runs[0][1].keys() == runs[1][1].keys() and len(runs[0][1]) > 30
    for name in runs[0][1]:
        torch.testing.assert_close(runs[1][1][name], runs[0][1][name], rtol=1e-4, atol=1e-6, msg=name)


def _dual_batch():
    torch.manual_seed(0)
    q, p = torch.randint(2000, 9000, (4, 8)), torch.randint(2000, 9000, (8, 10))
    return {"query_input_ids": q, "query_attention_mask": torch.ones_like(q), "passage_input_ids": p,
            "passage_attention_mask": torch.ones_like(p)}


def _encoder():
    from transformers import BertConfig

    from pretrieve.models.encoder import Encoder

    torch.manual_seed(0)
    return Encoder(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_fine_tuning_loss_by_hand_and_grad_cache_with_matryoshka():
    from pretrieve.finetune.models import DualEncoder, contrastive_loss

    encoder, batch = _encoder(), _dual_batch()
    matryoshka = matryoshka_of(DIMS, WEIGHTS, "finetune")
    runs = []
    for chunk in (None, 3):
        encoder.zero_grad()
        dual = DualEncoder(encoder, pooling="mean", normalize=True, temperature=0.05, grad_cache=chunk,
                           matryoshka=matryoshka)
        out = dual(batch)
        out["loss"].backward()
        runs.append((out, {n: t.grad.clone() for n, t in encoder.named_parameters() if t.grad is not None}))
    with torch.no_grad():  # by hand: eq. 13-14 on the prefixes (each query's group: its positive and one negative)
        dual = DualEncoder(encoder, pooling="mean", normalize=False)
        q = dual.embed(batch["query_input_ids"], batch["query_attention_mask"], queries=True)
        p = dual.embed(batch["passage_input_ids"], batch["passage_attention_mask"], queries=False)
        by_dim = {m: contrastive_loss(F.normalize(q[:, :m], dim=-1), F.normalize(p[:, :m], dim=-1), 0.05)[0]
                  for m in DIMS}
    expected = sum(w * by_dim[m].item() for m, w in zip(DIMS, WEIGHTS))
    for out, _ in runs:
        assert out["loss"].item() == pytest.approx(expected, rel=1e-5)
        assert out["loss@8"].item() == pytest.approx(by_dim[8].item(), rel=1e-5)
    assert runs[0][1].keys() == runs[1][1].keys() and len(runs[0][1]) > 30
    for name in runs[0][1]:
        torch.testing.assert_close(runs[1][1][name], runs[0][1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_bad_dimensions_are_refused_naming_the_key(vocab, tiny_encoder):
    from omegaconf import OmegaConf

    from pretrieve.finetune.config import finetune_experiment
    from pretrieve.finetune.models import DualEncoder
    from pretrieve.utils.options import ConfigError

    for dims, weights, message in (([32, 0], None, "method.matryoshka_dims: expected a list of dimensions >= 1"),
                                   ([16, 16], None, "names a dimension twice"),
                                   ([32, 16], [1.0], "method.matryoshka_weights: one weight per dimension"),
                                   (None, [1.0], "method.matryoshka_weights: given without")):
        with pytest.raises(ValueError, match=message):
            _head(vocab, matryoshka_dims=dims, matryoshka_weights=weights)
    with pytest.raises(ValueError, match=r"method.matryoshka_dims: 64 is wider than the representation \(32"):
        _head(vocab, matryoshka_dims=[64, 16])
    with pytest.raises(ValueError, match=r"finetune.matryoshka_dims: 64 is wider .* \(32 coordinates"):
        DualEncoder(_encoder(), matryoshka=matryoshka_of([64], None, "finetune"))
    config = {"init_from": str(tiny_encoder), "data": [str(SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl")],
              "matryoshka_dims": [64, 16], "pooling": "dupmae"}
    with pytest.raises(ConfigError) as error:
        finetune_experiment(OmegaConf.create({"finetune": config}))
    assert any(p.startswith("finetune.matryoshka_dims: pooling dupmae") for p in error.value.problems)


def test_a_pretraining_export_records_its_dimensions(tmp_path, vocab):
    from pretrieve.models.export import describe_export, export

    head, _ = _head(vocab, matryoshka_dims=[8, 32], pooling="mean")
    export(head, tmp_path / "out")
    st = read_st_config(tmp_path / "out")
    assert (st.pooling, st.normalize, st.matryoshka_dims) == ("mean", True, (32, 8))
    assert "Matryoshka dimensions: 32, 8" in describe_export(tmp_path / "out")


@pytest.fixture(scope="module")
def mini_beir(tmp_path_factory):
    return beir_subset(tmp_path_factory.mktemp("beir") / "scifact-mini", queries=4, other_docs=12)


def test_export_records_the_dims_and_truncate_dim_equals_encode_dim(tmp_path, tiny_encoder, mini_beir):
    """sentence-transformers' truncate_dim, scored by cosine (its vectors normalised again), gives the vectors of
    `pretrieve encode --dim 16` on a normalised mean-pooling model."""
    from sentence_transformers import SentenceTransformer

    from pretrieve.eval.model_card import _usage

    model = tmp_path / "model"
    shutil.copytree(tiny_encoder, model)
    write_st_config(model, "mean", True, max_length=48, matryoshka_dims=[16, 64, 32])
    assert json.loads((model / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [64, 32, 16]
    assert read_st_config(model).matryoshka_dims == (64, 32, 16)
    assert cli(["encode", "--model", str(model), "--beir", str(mini_beir), "--dim", "16", "--out",
                str(tmp_path / "v")]) == 0
    ours = np.load(tmp_path / "v" / "corpus-00000.npy")
    data = load_beir(mini_beir)
    texts = [data.doc_text(d) for d in (tmp_path / "v" / "corpus-00000.ids").read_text().splitlines()]
    theirs = SentenceTransformer(str(model), device="cpu", truncate_dim=16).encode(texts, normalize_embeddings=True)
    assert ours.shape == theirs.shape == (len(texts), 16)
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    # without normalize_embeddings, the cut vectors are not unit length: the card says so beside truncate_dim
    plain = SentenceTransformer(str(model), device="cpu", truncate_dim=16).encode(texts)
    assert np.linalg.norm(plain, axis=1).max() < 0.99
    usage = " ".join(_usage(model, model, read_st_config(model)))
    assert "Trained at the Matryoshka dimensions 64, 32, 16" in usage and "truncate_dim=N)" in usage
    assert "the cut vectors are not unit length: pass `normalize_embeddings=True`" in usage
    from pretrieve.eval.evaluate import run_eval
    from pretrieve.eval.options import EvalOptions

    cut = run_eval(EvalOptions(out=str(tmp_path / "e16"), model=str(model), beir=str(mini_beir), dim=16,
                               embeddings=str(tmp_path / "v"), progress=False))
    assert cut["dim"] == 16
    with pytest.raises(ValueError, match="vectors made with .* but this run encodes with"):  # full-width queries
        run_eval(EvalOptions(out=str(tmp_path / "e"), model=str(model), beir=str(mini_beir),
                             embeddings=str(tmp_path / "v"), progress=False))


def test_eval_dim_scores_the_cut_vectors_and_refuses_a_wider_one(tmp_path, tiny_encoder, mini_beir):
    from pretrieve.eval.evaluate import run_eval
    from pretrieve.eval.options import EvalOptions

    model = tmp_path / "model"
    shutil.copytree(tiny_encoder, model)
    write_st_config(model, "mean", True, max_length=48)
    full = run_eval(EvalOptions(out=str(tmp_path / "full"), model=str(model), beir=str(mini_beir), progress=False))
    same = run_eval(EvalOptions(out=str(tmp_path / "64"), model=str(model), beir=str(mini_beir), dim=64,
                                progress=False))
    cut = run_eval(EvalOptions(out=str(tmp_path / "8"), model=str(model), beir=str(mini_beir), dim=8,
                               progress=False))
    assert full["dim"] is None and same["dim"] == 64 and cut["dim"] == 8
    assert same["ndcg@10"] == full["ndcg@10"]  # every coordinate kept: the model's own vectors
    assert (tmp_path / "8" / "run.trec").read_text() != (tmp_path / "full" / "run.trec").read_text()
    from pretrieve.eval.report import collect
    from pretrieve.eval.track import track

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # tracked, the cut evaluation is a row of its own in reports
    track([str(tmp_path / "8"), str(tmp_path / "full")], uri)
    assert sorted(r["checkpoint"] for r in collect(uri)) == ["8 (dim 8)", "full"]
    with pytest.raises(ValueError, match="--dim 65: .* vectors have 64 coordinates"):
        run_eval(EvalOptions(out=str(tmp_path / "65"), model=str(model), beir=str(mini_beir), dim=65,
                             progress=False))
    with pytest.raises(ValueError, match="--dim 8: .* give --model"):
        run_eval(EvalOptions(out=str(tmp_path / "bm25"), beir=str(mini_beir), bm25=True, dim=8, progress=False))


def test_farm_evaluates_each_dimension_and_writes_ndcg_against_dimension(tmp_path, tiny_encoder, mini_beir):
    from pretrieve.eval.report import collect
    from pretrieve.orchestrate.farm import load_farm, run_farm

    model = tmp_path / "model"
    shutil.copytree(tiny_encoder, model)
    write_st_config(model, "mean", True, max_length=48, matryoshka_dims=[64, 16])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "out"), "tracking": {"uri": uri}, "workers": 2,
                                "checkpoints": [{"name": "m", "model": str(model), "dims": [16, 64]}],
                                "datasets": [{"name": "mini", "beir": str(mini_beir)}]}))
    result = run_farm(farm, progress=False)
    assert not result["failed"] and sorted(result["logged"]) == ["m/mini/zero-shot/dim16", "m/mini/zero-shot/dim64"]
    ndcg = {d: json.loads((tmp_path / "out" / "m" / "mini" / "zero-shot" / f"dim{d}" / "metrics.json").read_text())
            for d in (64, 16)}
    assert ndcg[16]["dim"] == 16 and ndcg[64]["dim"] == 64
    table = (tmp_path / "out" / "dims.md").read_text().splitlines()
    assert table[0] == "| checkpoint | dataset | stage | 64 | 16 |"
    share = 100 * ndcg[16]["ndcg@10"] / ndcg[64]["ndcg@10"]
    assert table[2] == (f"| m | mini | zero-shot | {ndcg[64]['ndcg@10']:.4f} | {ndcg[16]['ndcg@10']:.4f} "
                        f"({share:.0f} %) |")
    assert (tmp_path / "out" / "dims.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(r["checkpoint"] for r in collect(uri)) == ["m (dim 16)", "m (dim 64)"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"checkpoints": [{"name": "m", "model": "x", "dims": [64, 0]}],
                               "datasets": [{"name": "d", "beir": "x"}]}))
    with pytest.raises(ValueError, match=r"checkpoints\[0\].dims: expected distinct dimensions >= 1"):
        load_farm(bad)
