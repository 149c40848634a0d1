"""Evaluation: metrics against hand-computed cases (trec_eval semantics), BEIR and MS MARCO readers and their
errors, exact and approximate dense search, BM25, and `pretrieve eval` end to end on the bundled SciFact
sample with a tiny random encoder."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SAMPLES
from transformers import BertConfig, BertModel

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import RetrievalDataError, load_beir, load_msmarco, write_msmarco
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.eval.evaluate import EvalOptions, run_eval
from pretrieve.eval.metrics import METRICS, evaluate, trec_run_lines
from pretrieve.eval.search import bm25_search, dense_search

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def test_metrics_hand_computed_with_ties_and_missing_queries():
    qrels = {"q1": {"a": 1, "b": 0, "c": 2}, "q2": {"x": 1}, "q3": {"z": 0}, "q4": {"w": 1}}
    run = {"q1": {"a": 0.5, "b": 0.5, "c": 0.1, "d": 0.9}, "q2": {"y": 1.0, "x": 1.0}, "q3": {"z": 3.0}}
    means, per_query = evaluate(qrels, run)
    # q1 in trec_eval's order: d (0.9), then the tie a/b by doc id descending: b, a; then c
    dcg, ideal = 1 / np.log2(4) + 2 / np.log2(5), 2 + 1 / np.log2(3)
    assert per_query["q1"]["ndcg@10"] == pytest.approx(dcg / ideal)
    assert per_query["q1"]["mrr@10"] == pytest.approx(1 / 3)
    assert per_query["q1"]["map"] == pytest.approx((1 / 3 + 2 / 4) / 2)
    assert per_query["q1"]["recall@100"] == 1.0
    assert per_query["q2"]["mrr@10"] == 0.5  # y and x tie; y sorts first
    assert per_query["q3"] == dict.fromkeys(METRICS, 0.0)  # nothing relevant to find
    assert per_query["q4"] == dict.fromkeys(METRICS, 0.0)  # missing from the run: counted as 0 (trec_eval -c)
    assert means["mrr@10"] == pytest.approx((1 / 3 + 0.5) / 4)
    # MRR@k cuts the run at k in the same order: the first relevant document at rank 3 is outside MRR@2
    assert evaluate({"q": {"a": 1}}, {"q": {"c": 3.0, "b": 2.0, "a": 1.0}}, ("mrr@2", "mrr@3"))[0] == \
        {"mrr@2": 0.0, "mrr@3": pytest.approx(1 / 3)}
    assert trec_run_lines({"q2": run["q2"]}, "t") == ["q2 Q0 y 1 1.000000 t", "q2 Q0 x 2 1.000000 t"]
    with pytest.raises(ValueError, match="unknown metric 'p@5'"):
        evaluate(qrels, run, ("p@5",))


def test_beir_and_msmarco_readers_agree(tmp_path):
    beir = load_beir(SCIFACT, "test")
    assert (len(beir.corpus), len(beir.queries)) == (500, 100) and sum(map(len, beir.qrels.values())) == 116
    marco = load_msmarco(write_msmarco(beir, tmp_path / "marco", "dev"), "dev")
    assert marco.qrels == beir.qrels and marco.queries == beir.queries
    assert all(marco.doc_text(d) == " ".join(beir.doc_text(d).split()) for d in beir.corpus)
    # the same BM25 run and metrics from either format
    runs = [bm25_search({d: s.doc_text(d) for d in s.corpus}, s.queries, k=100) for s in (beir, marco)]
    assert runs[0] == runs[1]
    assert evaluate(beir.qrels, runs[0])[0] == evaluate(marco.qrels, runs[1])[0]

    docs = tmp_path / "docs"  # MS MARCO documents: docid, url, title, body
    docs.mkdir()
    (docs / "msmarco-docs.tsv").write_text("D1\thttp://a\tTitle one\tBody one\nD2\thttp://b\t\tBody two\n")
    (docs / "queries.dev.tsv").write_text("7\twhat is one\n8\tunjudged\n")
    (docs / "qrels.dev.tsv").write_text("7 0 D1 1\n")
    loaded = load_msmarco(docs)
    assert loaded.doc_text("D1") == "Title one Body one" and loaded.queries == {"7": "what is one"}


def test_bad_retrieval_inputs_are_named(tmp_path):
    folder = tmp_path / "beir"
    shutil.copytree(SCIFACT, folder)
    qrels = folder / "qrels" / "test.tsv"
    lines = qrels.read_text().splitlines()
    qrels.write_text("\n".join(lines[:3] + ["1\tNO-SUCH-DOC\t1", "NO-SUCH-QUERY\t" + lines[1].split("\t")[1] + "\t1"]
                               + lines[3:]) + "\n")
    with pytest.raises(RetrievalDataError, match=rf"{qrels}:4: document not in corpus \(1 -> NO-SUCH-DOC\)"):
        load_beir(folder)
    skipped = load_beir(folder, on_missing="skip")
    assert skipped.skipped == {"document not in corpus": 1, "query not in queries": 1}
    assert sum(map(len, skipped.qrels.values())) == 116
    qrels.write_text("query-id\tcorpus-id\tscore\n1\t31715818\n")
    with pytest.raises(RetrievalDataError, match=rf"{qrels}:2: expected query id, document id and an integer"):
        load_beir(folder)
    (folder / "queries.jsonl").write_text('{"_id": "1", "text": "x"}\n{"_id": 2,\n')
    with pytest.raises(RetrievalDataError, match=r"queries.jsonl:2: not JSON"):
        load_beir(folder)
    with pytest.raises(RetrievalDataError, match=r"qrels/dev.tsv: not found"):
        load_beir(folder, "dev")
    (tmp_path / "marco").mkdir()
    (tmp_path / "marco" / "collection.tsv").write_text("1\tok\n2\ttoo\tmany\n")
    (tmp_path / "marco" / "queries.dev.tsv").write_text("1\tq\n")
    (tmp_path / "marco" / "qrels.dev.tsv").write_text("1 0 1 1\n")
    with pytest.raises(RetrievalDataError, match=r"collection.tsv:2: expected 2 tab-separated columns, got 3"):
        load_msmarco(tmp_path / "marco")


def test_dense_search_flat_is_exact_and_approximate_indexes_recall():
    rng = np.random.default_rng(0)
    docs, queries = rng.standard_normal((2000, 32)).astype(np.float32), rng.standard_normal((20, 32)).astype(np.float32)
    doc_ids, query_ids = [f"d{i}" for i in range(2000)], [f"q{i}" for i in range(20)]
    exact = dense_search(docs, doc_ids, queries, query_ids, k=10)
    brute = queries @ docs.T
    for i, qid in enumerate(query_ids):
        top = np.argsort(-brute[i])[:10]
        assert list(exact[qid]) == [doc_ids[j] for j in top]
        assert list(exact[qid].values()) == pytest.approx(brute[i, top].tolist(), rel=1e-5)
    for index, floor in (("hnsw", 0.9), ("ivfpq", 0.3)):
        found = dense_search(docs, doc_ids, queries, query_ids, k=10, index=index)
        recall = np.mean([len(set(found[q]) & set(exact[q])) / 10 for q in query_ids])
        assert recall >= floor, (index, recall)
    with pytest.raises(ValueError, match="index: 'ivf'"):
        dense_search(docs, doc_ids, queries, query_ids, index="ivf")


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory) -> Path:
    """A random 2-layer BERT (hidden 64) with the bundled tokenizer, as `pretrieve export` lays it out."""
    out = tmp_path_factory.mktemp("tiny-encoder")
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)) \
        .save_pretrained(out)
    for file in Path(DEFAULT_TOKENIZER).iterdir():
        shutil.copy(file, out / file.name)
    return out


def test_pretrieve_eval_writes_metrics_run_and_per_query(tmp_path, tiny_encoder, capsys):
    out = tmp_path / "eval"
    assert cli(["eval", "--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
                "--max-length", "64", "--depth", "50", "--bm25", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(METRICS) <= set(metrics) and metrics["retriever"] == "dense" and printed["ndcg@10"] == metrics["ndcg@10"]
    assert metrics["documents"] == 500 and metrics["queries"] == 100 and metrics["pooling"] == "mean"
    run = [line.split() for line in (out / "run.trec").read_text().splitlines()]
    assert len(run) == 100 * 50 and all(len(r) == 6 and r[1] == "Q0" for r in run)
    per_query = [json.loads(line) for line in (out / "per_query.jsonl").read_text().splitlines()]
    assert len(per_query) == 100
    assert np.mean([q["ndcg@10"] for q in per_query]) == pytest.approx(metrics["ndcg@10"], abs=1e-6)
    bm25 = json.loads((out / "bm25" / "metrics.json").read_text())
    assert bm25["retriever"] == "bm25" and "pooling" not in bm25
    assert bm25["ndcg@10"] > metrics["ndcg@10"] + 0.3  # a random encoder against BM25 on SciFact

    # the same set in MS MARCO files gives the same metrics
    marco = write_msmarco(load_beir(SCIFACT), tmp_path / "marco", "dev")
    again = run_eval(EvalOptions(out=str(tmp_path / "eval-marco"), model=str(tiny_encoder), msmarco=str(marco),
                                 split="dev", pooling="mean", normalize=True, max_length=64, depth=50,
                                 progress=False))
    assert {k: again[k] for k in METRICS} == {k: metrics[k] for k in METRICS}

    assert cli(["eval", "--beir", str(SCIFACT), "--out", str(tmp_path / "none")]) == 1
    assert "give --model DIR, or --bm25" in capsys.readouterr().err
