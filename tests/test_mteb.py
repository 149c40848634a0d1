"""`pretrieve eval --mteb`: the mteb package's evaluation of an export, offline. A task built from local files (a
BEIR folder cut from the bundled SciFact sample, as an MTEB custom task) scores what pretrieve's own BEIR
evaluation scores; a named task whose data is not cached fails at once naming it; a farm dataset can be an MTEB
task, logged to MLflow and shown on the model card as MTEB's."""

import json
import os
import subprocess
import sys
import time

import pytest
from support import beir_subset

from pretrieve.cli import main as cli

pytest.importorskip("mteb")

ENCODING = ["--pooling", "mean", "--normalize", "--max-length", "64"]


@pytest.fixture(scope="module")
def local_task(tmp_path_factory):
    return beir_subset(tmp_path_factory.mktemp("mteb") / "scifact-mini", queries=30, other_docs=60)


def _read(folder):
    metrics = json.loads((folder / "metrics.json").read_text())
    per_query = {r["query_id"]: r for r in map(json.loads, (folder / "per_query.jsonl").read_text().splitlines())}
    return metrics, per_query


def test_mteb_on_a_local_task_scores_what_the_beir_evaluation_scores(tmp_path, tiny_encoder, local_task):
    """MTEB's NDCG@10 (its own result file, 5 decimals) is pretrieve's to 1e-4; its ranking is pretrieve's, so each
    query's metrics are the same."""
    assert cli(["eval", "--model", str(tiny_encoder), "--beir", str(local_task), *ENCODING,
                "--out", str(tmp_path / "beir")]) == 0
    assert cli(["eval", "--model", str(tiny_encoder), "--mteb", str(local_task), *ENCODING,
                "--out", str(tmp_path / "mteb")]) == 0
    ours, ours_per_query = _read(tmp_path / "beir")
    theirs, theirs_per_query = _read(tmp_path / "mteb")
    result = tmp_path / "mteb" / "mteb" / "results" / f"pretrieve__{tiny_encoder.name}" / "local" / "scifact-mini.json"
    scores = json.loads(result.read_text())["scores"]["test"][0]  # MTEB's own result format
    assert scores["ndcg_at_10"] == theirs["ndcg@10"] == theirs["mteb_main_score"]
    for metric in ("ndcg@10", "mrr@10", "recall@100", "map"):
        assert abs(theirs[metric] - ours[metric]) <= 1e-4, metric
    assert 0 < ours["ndcg@10"] < 1 and theirs["queries"] == ours["queries"] == 30
    assert theirs_per_query.keys() == ours_per_query.keys()
    for query, metrics in ours_per_query.items():
        assert theirs_per_query[query]["ndcg@10"] == pytest.approx(metrics["ndcg@10"], abs=1e-6), query
    assert theirs["retriever"] == "mteb" and theirs["dataset"] == "scifact-mini" and theirs["normalize"] is True


def test_a_task_whose_data_is_not_cached_fails_at_once_naming_it(tmp_path, tiny_encoder):
    """No HF_HUB_OFFLINE in the environment: pretrieve sets it, so an empty cache is an error naming the task and
    its dataset, not a wait on the network."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["HF_HOME"] = str(tmp_path / "hf")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pretrieve", "eval", "--model", str(tiny_encoder), "--mteb",
                           "SciFact,NFCorpus", *ENCODING, "--out", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    assert "not in the Hugging Face cache" in error and str(tmp_path / "hf") in error, error
    assert "SciFact: mteb/scifact (revision " in error and "NFCorpus: mteb/nfcorpus" in error, error
    assert "mteb.get_tasks(tasks=['SciFact', 'NFCorpus'])" in error, error
    assert time.monotonic() - started < 120 and not (tmp_path / "out" / "metrics.json").exists()


def test_mteb_scores_a_matryoshka_prefix_as_the_beir_evaluation_does(tmp_path, tiny_encoder, local_task):
    """`--mteb --dim N`: MTEB scores the vectors cut to their first N coordinates and re-normalised, as `eval --dim
    N` searches them: the same ranking, so each query's metrics are the same, and MTEB's model has N dimensions."""
    for kind in ("beir", "mteb"):
        assert cli(["eval", "--model", str(tiny_encoder), f"--{kind}", str(local_task), *ENCODING, "--dim", "8",
                    "--out", str(tmp_path / kind)]) == 0
    ours, ours_per_query = _read(tmp_path / "beir")
    theirs, theirs_per_query = _read(tmp_path / "mteb")
    assert theirs["dim"] == ours["dim"] == 8 and theirs["retriever"] == "mteb"
    assert theirs_per_query.keys() == ours_per_query.keys()
    for query, metrics in ours_per_query.items():
        assert theirs_per_query[query]["ndcg@10"] == pytest.approx(metrics["ndcg@10"], abs=1e-6), query
    [meta] = (tmp_path / "mteb" / "mteb" / "results").glob("*/local/model_meta.json")
    assert json.loads(meta.read_text())["embed_dim"] == 8


def test_a_stopped_mteb_run_leaves_nothing_half_written(tmp_path, tiny_encoder, local_task, monkeypatch,
                                                      sigint_at_default):
    """Ctrl-C (a real SIGINT) while the second task encodes, after MTEB saved the first task's result: no OUT/mteb/
    nor its temporary folder is left, nor the OUT the run made; into a folder that was there (a farm job's, with
    its log), the folder and the log stay."""
    import shutil
    import signal

    from pretrieve.eval.mteb_model import ExportEncoder

    second = tmp_path / "second"
    shutil.copytree(local_task, second)
    encode, calls = ExportEncoder.encode, []

    def interrupted_at_the_second_task(self, inputs, *, task_metadata, **kwargs):
        calls.append(task_metadata.name)
        if task_metadata.name == second.name:
            os.kill(os.getpid(), signal.SIGINT)
        return encode(self, inputs, task_metadata=task_metadata, **kwargs)

    monkeypatch.setattr(ExportEncoder, "encode", interrupted_at_the_second_task)
    args = ["eval", "--model", str(tiny_encoder), "--mteb", f"{local_task},{second}", *ENCODING]
    with pytest.raises(KeyboardInterrupt):
        cli([*args, "--out", str(tmp_path / "out")])
    assert calls[0] == local_task.name and not (tmp_path / "out").exists()
    (tmp_path / "farm").mkdir()
    (tmp_path / "farm" / "eval.log").write_text("log\n")
    with pytest.raises(KeyboardInterrupt):
        cli([*args, "--out", str(tmp_path / "farm")])
    assert sorted(p.name for p in (tmp_path / "farm").iterdir()) == ["eval.log"]


@pytest.mark.parametrize("flags,message", [
    (["--mteb", "Banking77Classification"], "a Classification task; pretrieve evaluates retrievers"),
    (["--mteb", "Scifact"], "no such MTEB task or benchmark (KeyError: 'Scifact' not found. Did you mean: 'SciFact'?)"),
    (["--mteb", "SciFact", "--bm25"], "drop --bm25"),
    (["--mteb", "SciFact", "--index", "hnsw"], "drop --index hnsw"),
])
def test_what_mteb_cannot_run_is_refused_naming_it(tmp_path, tiny_encoder, flags, message, capsys):
    assert cli(["eval", "--model", str(tiny_encoder), *flags, *ENCODING, "--out", str(tmp_path / "out")]) != 0
    assert message in capsys.readouterr().err


def test_a_benchmark_runs_its_retrieval_tasks_and_says_which_it_leaves_out(capsys):
    from pretrieve.eval.mteb_tasks import requested_tasks

    tasks = requested_tasks("MTEB(eng, v2),SciFact")
    names = [t.name for t in tasks]
    assert "ArguAna" in names and names[-1] == "SciFact" and "Banking77Classification" not in names
    assert "its 10 Retrieval tasks are evaluated" in capsys.readouterr().err
    cqadupstack = next(t for t in requested_tasks("BEIR") if t.name == "CQADupstackRetrieval")
    assert cqadupstack.aggregate is not None and len(cqadupstack.tasks) == 12  # its subtasks, combined after


@pytest.mark.integration  # a farm job's own process: about 35 s on 2 cores
def test_a_farm_dataset_can_be_an_mteb_task_logged_and_on_the_card(tmp_path, tiny_encoder, local_task):
    from pretrieve.eval.model_card import _evaluation_lines, _model_index_result
    from pretrieve.eval.report import evaluations_of
    from pretrieve.orchestrate.farm import load_farm, run_farm

    farm = tmp_path / "farm.yaml"
    spec = {"out": str(tmp_path / "farm"), "eval": {"max_length": 64},
            "checkpoints": [{"name": "tiny", "model": str(tiny_encoder), "pooling": "mean", "normalize": True}],
            "datasets": [{"name": "mini", "mteb": str(local_task)}]}
    farm.write_text(json.dumps(spec))
    result = run_farm(farm, progress=False)
    assert result["failed"] == {} and result["logged"] == ["tiny/mini/zero-shot"]
    metrics = json.loads((tmp_path / "farm" / "tiny" / "mini" / "zero-shot" / "metrics.json").read_text())
    assert metrics["retriever"] == "mteb"
    [evaluation] = evaluations_of(f"sqlite:///{tmp_path / 'farm' / 'mlflow.db'}", tiny_encoder)
    assert evaluation["mteb"] and evaluation["metrics"]["ndcg_at_10"] == metrics["ndcg@10"]
    assert evaluation["metrics"]["mteb_main_score"] == metrics["ndcg@10"]
    assert any(line.startswith("| mini (MTEB) | – | zero-shot | ") for line in _evaluation_lines([evaluation],
                                                                                                   tmp_path))
    assert _model_index_result(evaluation)["dataset"]["name"] == "mini (MTEB)"  # a BEIR folder: no MTEB task

    spec["checkpoints"].append({"name": "bm25", "bm25": True})
    farm.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="datasets mini: MTEB evaluates models, and checkpoints bm25 are BM25"):
        load_farm(farm)


def test_the_card_keeps_a_folders_beir_mteb_and_cut_evaluations_apart(tmp_path, tiny_encoder, local_task):
    """One BEIR folder evaluated by pretrieve, by MTEB (a local task), and at two dimensions (the model's width,
    as a farm's `dims:` lists it, and a prefix), logged by `pretrieve track` into a sqlite store: the card keeps
    every row, credits `pretrieve track`, names the MTEB row after the folder (no MTEB task of that name), and
    gives model-index the whole vectors."""
    from pretrieve.eval.model_card import _evaluation_lines, _model_index_result
    from pretrieve.eval.report import evaluations_of

    runs = {"beir": ["--beir", str(local_task)], "mteb": ["--mteb", str(local_task)],
            "dim64": ["--beir", str(local_task), "--dim", "64"], "dim16": ["--beir", str(local_task), "--dim", "16"]}
    for name, flags in runs.items():
        assert cli(["eval", "--model", str(tiny_encoder), *flags, *ENCODING, "--out", str(tmp_path / name)]) == 0
    assert json.loads((tmp_path / "mteb" / "metrics.json").read_text())["mteb_local"] is True
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert cli(["track", *(str(tmp_path / name) for name in runs), "--uri", uri]) == 0
    evaluations = evaluations_of(uri, tiny_encoder)
    # the width-64 run is the whole vector (hidden 64), the latest of the folder's own evaluation
    assert [(e["mteb"], e["dim"]) for e in evaluations] == [(False, None), (False, 16), (True, None)]
    lines = "\n".join(_evaluation_lines(evaluations, tmp_path))
    assert lines.startswith("Logged by `pretrieve track` (") and "pretrieve farm" not in lines.split("\n")[0]
    assert "| scifact-mini | test | zero-shot | " in lines and "| scifact-mini (MTEB) | " in lines
    assert "| zero-shot, dim 16 | " in lines
    names = [_model_index_result(e)["dataset"]["name"] for e in evaluations if e["dim"] is None]
    assert names == ["scifact-mini", "scifact-mini (MTEB)"]


def test_an_export_is_named_for_its_run_in_mteb(tmp_path):
    from pretrieve.eval.mteb_model import model_name

    assert model_name(tmp_path / "lexmae-base" / "export") == "pretrieve/lexmae-base"
    assert model_name(tmp_path / "my-model") == "pretrieve/my-model"


def test_a_farm_scores_a_matryoshka_checkpoint_on_an_mteb_task_at_each_dimension(tmp_path):
    from pretrieve.orchestrate.farm import jobs_of, load_farm

    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "out"), "datasets": [{"name": "s", "mteb": "SciFact"}],
                                "checkpoints": [{"name": "mrl", "model": "m", "dims": [64, 16]}]}))
    jobs = jobs_of(load_farm(farm))
    assert [job.name for job in jobs] == ["mrl/s/zero-shot/dim64", "mrl/s/zero-shot/dim16"]
    assert [job.eval_args({})[-4:] for job in jobs] == [["--mteb", "SciFact", "--dim", "64"],
                                                        ["--mteb", "SciFact", "--dim", "16"]]
