"""Evaluation: metrics against hand-computed cases (trec_eval semantics), BEIR and MS MARCO readers and their
errors, exact and approximate dense search, BM25, and `pretrieve eval` end to end on the bundled SciFact
sample with a tiny random encoder."""

import json
import shutil

import numpy as np
import pytest
import torch
from support import SAMPLES, write_beir

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import RetrievalDataError, load_beir, load_msmarco, write_msmarco
from pretrieve.eval.bm25 import bm25_search
from pretrieve.eval.evaluate import TABLE_METRICS, EvalOptions, run_eval
from pretrieve.eval.metrics import METRICS, evaluate, trec_run_lines
from pretrieve.eval.search import dense_search, index_recall

pytestmark = pytest.mark.system

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def _encode_owners():
    from pretrieve.eval.options import EncodeOptions
    from pretrieve.eval.vectors import encode_corpus_shards

    return EncodeOptions, encode_corpus_shards


def _mine_owners():
    from pretrieve.finetune.mine import MineOptions

    return (MineOptions,)


def _teacher_owners():
    from pretrieve.finetune.mine import TeacherOptions

    return (TeacherOptions,)


def _prepare_owners():
    from pretrieve.data.prepare_options import PrepareOptions

    return (PrepareOptions,)


@pytest.mark.parametrize("argv,owners,resolved_later", [
    (["eval", "--beir", "B", "--out", "O"], lambda: (EvalOptions,), {"split"}),
    (["encode", "--model", "M", "--beir", "B", "--out", "O"], _encode_owners, {"pooling", "normalize", "max_length"}),
    (["mine", "--model", "M", "--data", "D", "--out", "O"], _mine_owners, set()),
    (["teacher-scores", "--model", "M", "--data", "D", "--out", "O"], _teacher_owners, set()),
    (["prepare", "--out", "O"], _prepare_owners, {"tokenizer", "workers"}),
])
def test_command_line_defaults_are_the_options_own(argv, owners, resolved_later, monkeypatch):
    """A flag named after a field of the options its command builds (or a parameter of the function it calls)
    defaults to that field's default, written once there. `resolved_later`: flags whose None means "not given"
    (the model's own setting, all cores, the bundled tokenizer, the set's usual split), resolved when it runs."""
    import inspect

    import pretrieve.cli
    from pretrieve.utils.options import default_of

    parsed = {}
    monkeypatch.setattr(pretrieve.cli, "_run_command", lambda args, own_process: parsed.update(vars(args)) or 0)
    assert cli(argv) == 0
    given = {arg[2:].replace("-", "_") for arg in argv if arg.startswith("--")}
    compared = []
    for owner in owners():
        for name in inspect.signature(owner).parameters.keys() & parsed.keys() - resolved_later - given:
            try:
                default = default_of(owner, name)
            except TypeError:  # a required field: the flag is required too
                continue
            assert parsed[name] == default, f"--{name}: {parsed[name]!r}, {owner.__name__}: {default!r}"
            compared.append(name)
    assert len(compared) >= 2, compared


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
    with pytest.raises(RetrievalDataError, match=rf"{qrels}:2: expected 3 columns with query id, document id"):
        load_beir(folder)
    qrels.write_text("query-id\tcorpus-id\tscore\n1\t31715818\t1\tQ0\n")  # a TREC-style extra column
    with pytest.raises(RetrievalDataError,
                       match=rf"{qrels}:2: expected 3 columns .* got \['1', '31715818', '1', 'Q0'\]"):
        load_beir(folder)
    qrels.write_text("query-id\tcorpus-id\tscore\n1\t31715818\t-2\n")  # TREC's spam grade: not relevant
    negative = load_beir(folder)
    assert negative.qrels == {"1": {"31715818": 0}} and negative.skipped == {"negative grade read as 0": 1}
    (folder / "queries.jsonl").write_text('{"_id": "1", "text": "x"}\n{"_id": 2,\n')
    with pytest.raises(RetrievalDataError, match=r"queries.jsonl:2: not JSON"):
        load_beir(folder)
    for queries, message in (('{"_id": "1", "text": "x"}\n{"_id": "1", "text": "y"}\n',
                              "queries.jsonl:2: id '1' again, with other text than at line 1"),
                             ('{"_id": "1", "text": null}\n', "queries.jsonl:1: 'text' is None, not a string"),
                             ('{"_id": "1"}\n', "queries.jsonl:1: no 'text' field")):
        (folder / "queries.jsonl").write_text(queries)
        with pytest.raises(RetrievalDataError, match=message):
            load_beir(folder)
    (folder / "queries.jsonl").write_text('{"_id": 1, "text": "x"}\n{"_id": "1", "text": "x"}\n')  # same twice: once
    (folder / "corpus.jsonl").write_text('{"_id": "31715818", "title": null, "text": "t"}\n'
                                         '{"_id": "2", "text": [1, 2]}\n')
    with pytest.raises(RetrievalDataError, match=r"corpus.jsonl:2: 'text' is \[1, 2\], not a string"):
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
    for index, floor in (("hnsw", 0.9), ("ivf", 0.5), ("ivfpq", 0.3)):
        found = dense_search(docs, doc_ids, queries, query_ids, k=10, index=index)
        recall = np.mean([len(set(found[q]) & set(exact[q])) / 10 for q in query_ids])
        assert recall >= floor, (index, recall)
        assert index_recall(found, exact) == pytest.approx(recall)
    with pytest.raises(ValueError, match="index: 'lsh'"):
        dense_search(docs, doc_ids, queries, query_ids, index="lsh")


def test_pretrieve_eval_writes_metrics_run_and_per_query_and_shows_bm25_beside_the_model(tmp_path, tiny_encoder,
                                                                                         capsys):
    out = tmp_path / "eval"
    assert cli(["eval", "--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
                "--max-length", "64", "--depth", "50", "--bm25", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)  # stdout stays the model's one result line
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
    assert metrics["model"] == str(tiny_encoder.resolve())  # the model as an absolute path: `pretrieve track`
    # both systems at the end, aligned under the header, each with the metrics.json its numbers come from
    header, *rows = captured.err.rstrip().splitlines()[-3:]
    assert header.split() == ["system", "ndcg@10", "mrr@10", "recall@100", "path"]
    for row, system, source, path in ((rows[0], "model (dense)", metrics, out / "metrics.json"),
                                      (rows[1], "bm25", bm25, out / "bm25" / "metrics.json")):
        cells = {"system": system, "path": str(path), **{k: f"{source[k]:.4f}" for k in TABLE_METRICS}}
        assert all(row[header.index(column):].startswith(cell + " " * (column != "path"))
                   for column, cell in cells.items()), (header, row)

    # the same set in MS MARCO files gives the same metrics
    marco = write_msmarco(load_beir(SCIFACT), tmp_path / "marco", "dev")
    again = run_eval(EvalOptions(out=str(tmp_path / "eval-marco"), model=str(tiny_encoder), msmarco=str(marco),
                                 split="dev", pooling="mean", normalize=True, max_length=64, depth=50,
                                 progress=False))
    assert {k: again[k] for k in METRICS} == {k: metrics[k] for k in METRICS}

    assert cli(["eval", "--beir", str(SCIFACT), "--out", str(tmp_path / "none")]) == 1
    assert "give --model DIR, or --bm25" in capsys.readouterr().err


def test_sharded_encoding_over_two_workers_resumes_and_feeds_eval(tmp_path, tiny_encoder, capsys):
    vectors = tmp_path / "vectors"
    common = ["encode", "--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
              "--max-length", "64", "--shard-size", "128", "--workers", "2", "--out", str(vectors)]
    for worker in ("0", "1"):  # 500 documents: shards 0 and 2 to worker 0, 1 and 3 to worker 1
        assert cli([*common, "--worker", worker]) == 0
    assert sorted(p.name for p in vectors.glob("corpus-*")) == [f"corpus-{i:05d}.{x}" for i in range(4)
                                                                 for x in ("ids", "npy")]
    kept = (vectors / "corpus-00000.npy").stat().st_mtime_ns
    (vectors / "corpus-00002.ids").unlink()  # shard 2 as a killed worker left it: vectors, no ids
    assert cli([*common, "--worker", "0"]) == 0
    assert (vectors / "corpus-00002.ids").is_file() and (vectors / "corpus-00000.npy").stat().st_mtime_ns == kept
    capsys.readouterr()

    settings = ["--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
                "--max-length", "64", "--depth", "50"]
    assert cli(["eval", *settings, "--out", str(tmp_path / "direct")]) == 0
    assert cli(["eval", *settings, "--embeddings", str(vectors), "--out", str(tmp_path / "from-shards")]) == 0
    assert (tmp_path / "direct" / "run.trec").read_text() == (tmp_path / "from-shards" / "run.trec").read_text()
    capsys.readouterr()
    assert cli(["eval", *settings[:6], "--embeddings", str(vectors), "--out", str(tmp_path / "other")]) == 1
    assert "vectors made with" in capsys.readouterr().err  # other settings (no --normalize): refused


def test_farm_runs_jobs_in_parallel_logs_mlflow_and_reruns_only_what_is_missing(tmp_path, tiny_encoder,
                                                                                monkeypatch):
    from mlflow.tracking import MlflowClient

    from pretrieve.config import TrackingOptions
    from pretrieve.engine.tracking import Tracker
    from pretrieve.orchestrate.farm import run_farm
    from pretrieve.eval.report import write_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    pretrain_run = tmp_path / "runs" / "a"  # a pre-training run in the same store: job runs nest under it
    pretrain_run.mkdir(parents=True)
    parent = Tracker(TrackingOptions(uri=uri, system_metrics_every=None), pretrain_run, {}, {})
    parent.finish()
    marco = write_msmarco(load_beir(SCIFACT), tmp_path / "marco", "dev")
    second = tmp_path / "second"  # not there yet: its jobs fail, the others go on
    farm = tmp_path / "farm.yaml"
    monkeypatch.chdir(tmp_path)  # the farm names the store relative to here, the run absolutely: still one store
    farm.write_text(json.dumps({
        "out": str(tmp_path / "farm"), "workers": 2, "tracking": {"uri": "sqlite:///mlflow.db"},
        "eval": {"max_length": 32, "depth": 20},
        "checkpoints": [{"name": "a", "model": str(tiny_encoder), "pooling": "mean", "normalize": True,
                         "run_dir": str(pretrain_run)},
                        {"name": "b", "model": str(second)}],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}, {"name": "marco", "msmarco": str(marco),
                                                                  "split": "dev"}]}))
    first = run_farm(farm, progress=False)
    assert first["jobs"] == 4 and first["ran"] == 2 and sorted(first["failed"]) == ["b/marco/zero-shot",
                                                                                    "b/scifact/zero-shot"]
    assert "second: not found; give a model directory" in first["failed"]["b/scifact/zero-shot"]
    assert sorted(first["logged"]) == ["a/marco/zero-shot", "a/scifact/zero-shot"]

    jobs = tmp_path / "jobs.txt"  # what is left, as a job list for launchers/slurm/eval_farm.sbatch
    assert run_farm(farm, slurm_jobs=str(jobs), progress=False)["pending_for_slurm"] == 2
    assert [line.split()[:3] for line in jobs.read_text().splitlines()] == [["eval", "--model", str(second)]] * 2

    shutil.copytree(tiny_encoder, second)
    again = run_farm(farm, progress=False)
    assert again["ran"] == 2 and not again["failed"] and sorted(again["logged"]) == ["b/marco/zero-shot",
                                                                                    "b/scifact/zero-shot"]
    assert run_farm(farm, progress=False) == {"jobs": 4, "ran": 0, "failed": {}, "pending_for_slurm": 0, "logged": []}

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string="tags.`pretrieve.farm` = 'eval'")
    assert len(runs) == 4
    by_name = {(r.data.tags["checkpoint"], r.data.tags["dataset"]): r for r in runs}
    scifact_a = json.loads((tmp_path / "farm" / "a" / "scifact" / "zero-shot" / "metrics.json").read_text())
    assert by_name["a", "scifact"].data.metrics["ndcg_at_10"] == pytest.approx(scifact_a["ndcg@10"])
    assert by_name["a", "scifact"].data.tags["mlflow.parentRunId"] == parent.run_id
    assert "mlflow.parentRunId" not in by_name["b", "scifact"].data.tags
    # the same encoder on the same set in two formats; b is a copy of a but pools CLS without normalizing
    assert by_name["a", "marco"].data.metrics["ndcg_at_10"] == by_name["a", "scifact"].data.metrics["ndcg_at_10"]
    artifacts = {f.path for f in client.list_artifacts(by_name["a", "scifact"].info.run_id)}
    assert artifacts == {"metrics.json", "run.trec", "per_query.jsonl"}

    markdown = write_report(uri, tmp_path / "report")
    assert "| checkpoint | marco | scifact | mean |" in markdown
    rows = (tmp_path / "report" / "ndcg@10.csv").read_text().splitlines()
    assert rows[0] == "checkpoint,marco,scifact,mean" and [r.split(",")[0] for r in rows[1:]] == ["a", "b"]
    assert float(rows[1].split(",")[2]) == pytest.approx(scifact_a["ndcg@10"])
    assert (tmp_path / "report" / "ndcg@10.png").stat().st_size > 1000


def test_an_interrupted_farm_leaves_its_jobs_not_done_and_the_next_run_does_them(tmp_path, tiny_encoder,
                                                                                 sigint_at_default):
    """Ctrl-C to the farm's process group, as a terminal sends it, while its first job runs: the farm passes it
    on to the job (in a session of its own), which ends saying so in its log and writes no metrics.json; the
    second job does not start; the farm says so in one line and ends by SIGINT. The next run does both."""
    import subprocess
    import sys
    from pathlib import Path

    import psutil
    from support import ctrl_c_when

    from pretrieve.orchestrate.farm import run_farm

    farm, out = tmp_path / "farm.yaml", tmp_path / "farm"
    farm.write_text(json.dumps({
        "out": str(out), "workers": 1, "tracking": {"enabled": False}, "eval": {"max_length": 32, "depth": 20},
        "checkpoints": [{"name": name, "model": str(tiny_encoder), "pooling": "mean"} for name in ("a", "b")],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    proc = subprocess.Popen([sys.executable, "-m", "pretrieve", "farm", str(farm)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)

    def first_job_running() -> bool:
        """Its process is loading torch: inside its command, well before its end. Its own command line, not the
        farm's: between fork and exec a child still maps what the farm has loaded (torch, to count the GPUs)."""
        try:
            return any("eval" in job.cmdline() and "libtorch" in Path(f"/proc/{job.pid}/maps").read_text()
                       for job in psutil.Process(proc.pid).children())
        except (OSError, psutil.NoSuchProcess):
            return False

    assert ctrl_c_when(proc, first_job_running) == (
        "pretrieve farm: interrupted: 2 of 2 jobs stopped or not started (none of them is done); run the same "
        "command again to finish them")
    first, second = out / "a" / "scifact" / "zero-shot", out / "b" / "scifact" / "zero-shot"
    log = (first / "eval.log").read_text()
    assert log.splitlines()[-1] == "pretrieve eval: interrupted" and "Traceback" not in log, log[-3000:]
    assert not (first / "metrics.json").exists() and not second.exists()

    again = run_farm(farm, progress=False)
    assert again["ran"] == 2 and not again["failed"]
    assert (first / "metrics.json").is_file() and (second / "metrics.json").is_file()


def _synthetic_sparse(rng, rows, vocab, nonzero):
    weights = np.zeros((rows, vocab), dtype=np.float32)
    for row in weights:
        row[rng.choice(vocab, nonzero, replace=False)] = rng.random(nonzero).astype(np.float32)
    return weights


def test_sparse_and_hybrid_search_exact_and_candidate_union_recall():
    from pretrieve.eval.search import hybrid_search, sparse_matrix, sparse_search
    from pretrieve.models.representation import JointVectors, joint_scores

    rng = np.random.default_rng(0)
    docs_dense, queries_dense = rng.standard_normal((3000, 16)).astype(np.float32), \
        rng.standard_normal((30, 16)).astype(np.float32)
    docs_sparse, queries_sparse = _synthetic_sparse(rng, 3000, 500, 20), _synthetic_sparse(rng, 30, 500, 8)
    doc_ids, query_ids = [f"d{i}" for i in range(3000)], [f"q{i}" for i in range(30)]
    D, Q = sparse_matrix(docs_sparse), sparse_matrix(queries_sparse)

    sparse_run = sparse_search(D, doc_ids, Q, query_ids, k=10)
    brute = queries_sparse @ docs_sparse.T
    for i, qid in enumerate(query_ids):
        assert list(sparse_run[qid].values()) == pytest.approx(np.sort(brute[i])[::-1][:10].tolist(), rel=1e-5)

    exact = hybrid_search(docs_dense, queries_dense, D, Q, doc_ids, query_ids, k=10, sparse_weight=0.5)
    full = queries_dense @ docs_dense.T + 0.5 * brute
    for i, qid in enumerate(query_ids):
        assert set(exact[qid]) == {doc_ids[j] for j in np.argsort(-full[i])[:10]}
    union = hybrid_search(docs_dense, queries_dense, D, Q, doc_ids, query_ids, k=10, sparse_weight=0.5,
                          candidates=100)
    recall = np.mean([len(set(union[q]) & set(exact[q])) / 10 for q in query_ids])
    assert recall >= 0.95, recall  # a hybrid top 10 is almost always in the dense or the sparse top 100
    for qid in query_ids:  # what the union returns is scored exactly
        assert all(union[qid][d] == pytest.approx(exact[qid][d], rel=1e-5) for d in set(union[qid]) & set(exact[qid]))

    # DupMAE eq. (12): the document keeps its top-k OT entries, the query its full mu; h^ . h^ + mu_q . mu_d[I_d]
    mu_docs, mu_queries = torch.from_numpy(docs_sparse), torch.from_numpy(queries_sparse)
    values, indices = mu_docs.topk(5, dim=-1)
    joint = joint_scores(JointVectors(torch.from_numpy(queries_dense), None, None, mu_queries),
                         JointVectors(torch.from_numpy(docs_dense), values, indices, mu_docs))
    ours = hybrid_search(docs_dense, queries_dense, sparse_matrix(docs_sparse, top_k=5), Q, doc_ids, query_ids, k=5)
    for i, qid in enumerate(query_ids):
        top = torch.topk(joint[i], 5)
        assert list(ours[qid]) == [doc_ids[j] for j in top.indices.tolist()]
        assert list(ours[qid].values()) == pytest.approx(top.values.tolist(), rel=1e-5)


def test_vocabulary_poolings_of_a_dupmae_export(tmp_path):
    """`--pooling dupmae` ranks as eq. (12) computed directly by JointRepresentation + joint_scores; sparse and
    hybrid run on the same export."""
    from pretrieve.eval.encode import EncodeOptions, VocabEncoder
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export, load_export
    from pretrieve.models.heads import get_method
    from pretrieve.models.representation import JointRepresentation, joint_scores

    method = get_method("dupmae")
    head = method.build(method.options_from({"max_len": 64}), ModelOptions(hidden_size=64, num_layers=2,
                                                                             num_heads=2, intermediate_size=256))
    model = export(head, tmp_path / "dupmae")
    data = load_beir(SCIFACT)  # a fifth of the sample: every text projects onto all 30,522 words
    query_ids = list(data.queries)[:20]
    doc_ids = sorted({d for q in query_ids for d in data.qrels[q]} | set(list(data.corpus)[:80]))
    mini = write_beir(tmp_path / "mini", data, query_ids, doc_ids)
    results = {}
    for pooling in ("dupmae", "sparse", "hybrid"):
        results[pooling] = run_eval(EvalOptions(out=str(tmp_path / "eval" / pooling), model=str(model), beir=str(mini),
                                                pooling=pooling, max_length=48, depth=10, vocab_top_k=32,
                                                progress=False))
        assert set(METRICS) <= set(results[pooling]) and results[pooling]["retriever"] == pooling
    run = {}
    for line in (tmp_path / "eval" / "dupmae" / "run.trec").read_text().splitlines():
        qid, _, doc, rank, score, _ = line.split()
        run.setdefault(qid, []).append((doc, float(score)))

    encoder = VocabEncoder(model, EncodeOptions("dupmae", max_length=48), top_k=32)
    assert encoder.top_k == 32 and VocabEncoder(model, EncodeOptions("dupmae")).top_k == 384  # eq. 11's default k
    head = load_export(model)
    joint = JointRepresentation(64, cls_dim=64)

    def represent(texts, top_k):
        batch = encoder.tokenizer(texts, truncation=True, max_length=48, padding=True, return_tensors="pt")
        with torch.no_grad():
            joint.ot_topk = top_k
            return joint(head.encoder(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"],
                         head.lpu_logits)

    doc_ids, query_ids = doc_ids[:60], query_ids[:5]
    with torch.no_grad():
        scores = joint_scores(represent([data.queries[q] for q in query_ids], 32),
                              represent([data.doc_text(d) for d in doc_ids], 32))
    for i, qid in enumerate(query_ids):  # documents beyond the first 60 may rank higher: compare within them
        ours = [(d, s) for d, s in run[qid] if d in set(doc_ids)]
        expected = sorted(zip(doc_ids, scores[i].tolist()), key=lambda x: -x[1])[:len(ours)]
        assert [d for d, _ in ours] == [d for d, _ in expected]
        assert [s for _, s in ours] == pytest.approx([s for _, s in expected], rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("kind", ["query", "passage"])
@pytest.mark.parametrize("mteb", [False, True])
def test_a_prompt_that_fills_the_max_length_is_refused_naming_it(tmp_path, tiny_encoder, capsys, kind, mteb):
    """--max-length counts the prompt (as sentence-transformers' max_seq_length): a 300-word prompt at 32 tokens
    would leave every text only its prompt, one vector for all; it is refused by flag before any text is read."""
    if mteb:
        pytest.importorskip("mteb")
    prompt = " ".join(["find the passages that answer this question"] * 43)[:-len(" question")]  # 300 words
    assert cli(["eval", "--model", str(tiny_encoder), "--mteb" if mteb else "--beir", str(SCIFACT), "--max-length",
                "32", f"--{kind}-prompt", prompt, "--out", str(tmp_path / "out")]) == 1
    assert (f"max length 32 leaves a {kind} none of its own tokens: its prompt takes 300 tokens and the encoding "
            f"adds 2, and the max length counts them all (as sentence-transformers' max_seq_length does); give a "
            f"--max-length above 302, or shorten the {kind} prompt (--{kind}-prompt, else the model's "
            f"sentence-transformers prompt '{kind}')") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    if not mteb:  # a prompt that leaves room runs
        assert cli(["eval", "--model", str(tiny_encoder), "--beir", str(SCIFACT), "--max-length", "32", "--depth",
                    "10", f"--{kind}-prompt", "find: ", "--out", str(tmp_path / "fits")]) == 0
