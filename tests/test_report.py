import base64
import json

import pytest
from support import SAMPLES

from pretrieve.cli import main as cli
from pretrieve.orchestrate.farm import jobs_of, load_farm, run_farm

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def test_a_bm25_checkpoint_is_evaluated_zero_shot_only(tmp_path):
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({
        "out": str(tmp_path / "out"), "eval": {"max_length": 32, "depth": 50, "contrastive_entropy": 8},
        "checkpoints": [{"name": "bm25", "bm25": True}, {"name": "m", "model": "some/export"}],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}], "stages": ["zero-shot", "stage1"],
        "finetune": {"config": "configs/finetune/stage1.yaml", "beir": str(SCIFACT)}}))
    jobs = jobs_of(load_farm(farm))
    assert [job.name for job in jobs] == ["bm25/scifact/zero-shot", "m/scifact/zero-shot", "m/scifact/stage1"]
    assert jobs[0].model is None
    # BM25 encodes nothing: no model, pooling or contrastive entropy; the depth still applies
    assert jobs[0].eval_args(load_farm(farm)["eval"]) == [
        "eval", "--bm25", "--out", str(tmp_path / "out" / "bm25" / "scifact" / "zero-shot"), "--overwrite",
        "--beir", str(SCIFACT), "--depth", "50"]
    farm.write_text(json.dumps({"checkpoints": [{"name": "m"}], "datasets": [{"name": "d", "beir": "x"}]}))
    with pytest.raises(ValueError, match=r"checkpoints\[0\]: no 'model'"):
        load_farm(farm)


def test_report_writes_an_html_page_with_tables_and_plots_and_logs_it_to_mlflow(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "farm"), "tracking": {"uri": uri}, "eval": {"depth": 100},
                                "checkpoints": [{"name": "bm25", "bm25": True}],
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    result = run_farm(farm, progress=False)
    assert result["logged"] == ["bm25/scifact/zero-shot"] and not result["failed"]
    bm25 = json.loads((tmp_path / "farm" / "bm25" / "scifact" / "zero-shot" / "metrics.json").read_text())
    assert bm25["retriever"] == "bm25"

    client = MlflowClient(tracking_uri=uri)  # a second checkpoint, as the farm logs one
    experiment = client.get_experiment_by_name("pretrieve-eval").experiment_id
    other = client.create_run(experiment, tags={"pretrieve.farm": "eval", "checkpoint": "dense <b>",
                                                "dataset": "scifact", "stage": "zero-shot"}).info.run_id
    for key, value in (("ndcg_at_10", 0.25), ("mrr_at_10", 0.2), ("recall_at_100", 0.5)):
        client.log_metric(other, key, value)

    assert cli(["report", "--uri", uri, "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr()
    assert "| bm25 | " + f"{bm25['ndcg@10']:.4f}" in out.out and "report.html" in out.err
    page = (tmp_path / "report" / "report.html").read_text()
    for metric in ("ndcg@10", "mrr@10", "recall@100"):
        assert f"<h2>{metric}</h2>" in page
    assert f'<td>bm25</td><td class="num">{bm25["ndcg@10"]:.4f}</td>' in page
    assert "<td>dense &lt;b&gt;</td>" in page  # names are escaped
    images = page.split('src="data:image/png;base64,')[1:]
    assert len(images) == 3  # the plots are embedded: the page is whole on its own
    assert base64.b64decode(images[0].split('"')[0]) == (tmp_path / "report" / "ndcg@10.png").read_bytes()

    run_id = json.loads((tmp_path / "report" / "mlflow.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "report" and run.data.tags["pretrieve.report"] == "1"
    assert run.info.experiment_id == experiment and run.info.status == "FINISHED"
    artifacts = {f.path for f in client.list_artifacts(run_id)}
    assert {"report.html", "ndcg@10.png", "mrr@10.png", "recall@100.png", "ndcg@10.csv"} <= artifacts

    # the report run is not an evaluation: a second report has the same rows, and --no-mlflow logs nothing
    assert cli(["report", "--uri", uri, "--out", str(tmp_path / "again"), "--no-mlflow"]) == 0
    assert (tmp_path / "again" / "ndcg@10.csv").read_text() == (tmp_path / "report" / "ndcg@10.csv").read_text()
    assert not (tmp_path / "again" / "mlflow.json").exists()
    assert len(client.search_runs([experiment], "tags.`pretrieve.report` = '1'")) == 1


def test_track_logs_eval_folders_once_beside_farm_runs_in_the_report(tmp_path, tiny_encoder, capsys):
    """`pretrieve eval` folders made outside the farm, logged by `pretrieve track`, are rows of the report's tables
    beside a farm run; logging them again adds nothing, a folder evaluated again adds its new run."""
    import hashlib

    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "farm"), "tracking": {"uri": uri}, "eval": {"depth": 100},
                                "checkpoints": [{"name": "bm25-farm", "bm25": True}],
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}]}))
    assert run_farm(farm, progress=False)["logged"] == ["bm25-farm/scifact/zero-shot"]
    tiny = tmp_path / "evals" / "tiny"  # the model and, in tiny/bm25, its BM25 baseline
    assert cli(["eval", "--model", str(tiny_encoder), "--pooling", "mean", "--max-length", "32", "--depth", "100",
                "--bm25", "--beir", str(SCIFACT), "--out", str(tiny)]) == 0
    capsys.readouterr()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("pretrieve-eval").experiment_id
    evaluations = "tags.`pretrieve.farm` = 'eval'"
    (tmp_path / "evals" / "unfinished").mkdir()  # checked before anything is logged: no run for tiny either
    assert cli(["track", str(tiny), str(tmp_path / "evals" / "unfinished"), "--uri", uri]) == 1
    assert f"{tmp_path / 'evals' / 'unfinished'}: no metrics.json" in capsys.readouterr().err
    assert len(client.search_runs([experiment], evaluations)) == 1

    track = ["track", str(tiny), "--uri", uri, "--dataset", "scifact"]
    assert cli(track) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["checkpoint"], r["eval_dir"], r["logged"]) for r in records] == [
        ("tiny", str(tiny), True), ("bm25", str(tiny / "bm25"), True)]
    run = client.get_run(records[0]["run_id"])
    metrics = json.loads((tiny / "metrics.json").read_text())
    assert {k: run.data.tags[k] for k in ("pretrieve.farm", "checkpoint", "dataset", "stage", "eval_dir")} == {
        "pretrieve.farm": "eval", "checkpoint": "tiny", "dataset": "scifact", "stage": "zero-shot",
        "eval_dir": str(tiny)}
    assert run.data.tags["model_dir"] == run.data.params["model"] == str(tiny_encoder.resolve())
    assert run.data.tags["run_trec_sha256"] == hashlib.sha256((tiny / "run.trec").read_bytes()).hexdigest()
    assert run.data.params["pooling"] == "mean" and run.data.params["max_length"] == "32"
    assert run.data.metrics["ndcg_at_10"] == metrics["ndcg@10"] and run.info.status == "FINISHED"
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == {"metrics.json", "run.trec", "per_query.jsonl"}

    assert cli(track) == 0  # the same folders again: the same runs, none added
    assert [(r["run_id"], r["logged"]) for r in json.loads(capsys.readouterr().out)] == [
        (r["run_id"], False) for r in records]
    assert len(client.search_runs([experiment], evaluations)) == 3
    farm_job = tmp_path / "farm" / "bm25-farm" / "scifact" / "zero-shot"  # the farm logs in the same format
    assert cli(["track", str(farm_job), "--checkpoint", "bm25-farm", "--uri", uri]) == 0
    farm_run = json.loads((farm_job / "mlflow.json").read_text())["run_id"]
    assert [(r["run_id"], r["logged"]) for r in json.loads(capsys.readouterr().out)] == [(farm_run, False)]

    # BM25 evaluated again into tiny/bm25, to depth 10: another run.trec, so a new run, and the report counts it
    assert cli(["eval", "--bm25", "--depth", "10", "--beir", str(SCIFACT), "--out", str(tiny / "bm25"),
                "--overwrite"]) == 0
    capsys.readouterr()
    assert cli(track) == 0
    assert [r["logged"] for r in json.loads(capsys.readouterr().out)] == [False, True]
    assert len(client.search_runs([experiment], evaluations)) == 4

    assert cli(["report", "--uri", uri, "--out", str(tmp_path / "report"), "--no-mlflow"]) == 0
    farm_bm25 = json.loads((tmp_path / "farm" / "bm25-farm" / "scifact" / "zero-shot" / "metrics.json").read_text())
    shallow_bm25 = json.loads((tiny / "bm25" / "metrics.json").read_text())
    for metric in ("ndcg@10", "recall@100"):
        rows = (tmp_path / "report" / f"{metric}.csv").read_text().splitlines()
        assert rows[0] == "checkpoint,scifact,mean"
        values = {row.split(",")[0]: float(row.split(",")[1]) for row in rows[1:]}
        assert values == pytest.approx({"bm25": shallow_bm25[metric], "bm25-farm": farm_bm25[metric],
                                        "tiny": metrics[metric]}, abs=1e-6)
    assert shallow_bm25["recall@100"] < farm_bm25["recall@100"]  # the depth-10 run is the one shown

    assert cli(["track", str(tiny), str(tmp_path / "farm"), "--checkpoint", "x", "--uri", uri]) == 1
    assert "--checkpoint names one folder" in capsys.readouterr().err
