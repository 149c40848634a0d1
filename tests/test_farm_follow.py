"""`pretrieve farm --follow RUN_DIR` (orchestrate/follow.py, follow_plan.py): the follower's decisions on run
directories laid out as the engine writes them (complete tags, one being written, one a crashed save left, `latest`,
pruned tags), its checks, a stop signal ending a follow of a run that never ends, the report's metric against step;
and, as integration, a real tiny pre-training run followed while it writes checkpoints, the follower killed and
resumed, its MLflow runs and the report's plot read back."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from support import SAMPLES, ctrl_c_when, json_lines, pretrain_env

from pretrieve.cli import main as cli
from pretrieve.orchestrate.farm import jobs_of, load_farm
from pretrieve.orchestrate.follow import FollowState, follow_settings
from pretrieve.orchestrate.follow_plan import Next, look, next_steps, wanted

pytestmark = pytest.mark.system

SCIFACT = SAMPLES / "beir" / "scifact-sample"
CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
DELETED = "deleted by the run (checkpoint.keep: 2) before being exported"


def run_dir_with(folder: Path, complete: list[int], latest: int | None, writing: list[int] = (),
                 max_steps: int = 10, first_step: int | None = 1) -> Path:
    """A run directory as the engine leaves it: config.yaml (checkpoint every 2, keep 2), tags with their own
    config.yaml written last (`complete`), tags without it (`writing`: a save under way), `latest`, metrics.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    config = f"train:\n  max_steps: {max_steps}\ncheckpoint:\n  every: 2\n  keep: 2\n"
    (folder / "config.yaml").write_text(config)
    for step in [*complete, *writing]:
        tag = folder / "checkpoints" / f"step{step:08d}"
        tag.mkdir(parents=True, exist_ok=True)
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
        if step in complete:
            (tag / "config.yaml").write_text(config)
    if latest is not None:
        (folder / "checkpoints" / "latest").write_text(f"step{latest:08d}")
    if first_step is not None:
        (folder / "metrics.jsonl").write_text(json.dumps({"step": first_step, "loss": 10.0}) + "\n")
    return folder


def test_a_look_takes_only_complete_checkpoints_up_to_latest(tmp_path):
    """step 6 is being written (no config.yaml yet), step 8 is complete but `latest` has not reached it (the save
    has not finished, or crashed before moving it): neither is evaluated; the run has not ended (max_steps 10)."""
    view = look(run_dir_with(tmp_path / "run", complete=[2, 4, 8], latest=4, writing=[6]))
    assert view.complete == (2, 4) and view.present == {2, 4, 6, 8} and view.latest == 4
    assert (view.every, view.keep, view.max_steps, view.first_step) == (2, 2, 10, 1) and not view.ended
    assert look(run_dir_with(tmp_path / "run", complete=[2, 4, 8, 10], latest=10)).ended
    # a run to come: no config.yaml, nothing else (the defaults of checkpoint: and train:)
    (tmp_path / "empty").mkdir()
    empty = look(tmp_path / "empty")
    assert empty.complete == () and empty.latest is None and not empty.ended and empty.max_steps == 1000


def test_new_checkpoints_are_exported_deleted_ones_skipped_and_handled_ones_left(tmp_path):
    """The run (checkpoint every 2, keep 2) is at step 8 with tags 6 and 8: 6 and 8 are new; 2 was evaluated; 4
    was deleted before the follower got to it (a regular checkpoint between the run's first step and its latest),
    skipped with the reason."""
    view = look(run_dir_with(tmp_path / "run", complete=[6, 8], latest=8))
    decided = next_steps(view, every=1, handled={2}, seen=set())
    assert decided.export == (6, 8) and decided.skip == {4: DELETED}
    assert next_steps(view, every=1, handled={2, 4, 6, 8}, seen={6, 8}) == Next((), {})  # all handled
    # a checkpoint a stop wrote between the regular ones (step 5): seen once, gone by the next look
    gone = look(run_dir_with(tmp_path / "stop", complete=[8], latest=8))
    assert next_steps(gone, every=1, handled={2, 4, 6}, seen={5}).skip == {5: DELETED}
    # a branch's run starts at step 101: nothing before it was ever a checkpoint of this run
    branch = look(run_dir_with(tmp_path / "branch", complete=[104], latest=104, max_steps=200, first_step=101))
    assert next_steps(branch, every=1, handled=set(), seen=set()) == Next((104,), {102: DELETED})


def test_every_kth_checkpoint_and_the_last(tmp_path):
    """every: 2 with checkpoint.every 2: steps 4 and 8, and the run's last (10) though 10 is no multiple of 4."""
    view = look(run_dir_with(tmp_path / "run", complete=[2, 4, 6, 8, 10], latest=10))
    assert [s for s in range(1, 11) if wanted(s, view, 2)] == [4, 8, 10]
    decided = next_steps(view, every=2, handled={4}, seen=set())
    assert decided.export == (8, 10) and decided.skip == {}
    assert next_steps(look(run_dir_with(tmp_path / "pruned", complete=[10], latest=10)), 2, set(), set()).skip == \
        {4: DELETED, 8: DELETED}


def farm_file(tmp_path: Path, **follow) -> Path:
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "farm"), "gpus": 0, "eval": {"max_length": 32, "depth": 20},
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}],
                                "stages": ["zero-shot", "stage1"], "finetune": {"config": "c.yaml", "beir": "x"},
                                **({"follow": follow} if follow else {})}))
    return farm


def test_the_follow_block_is_checked_naming_the_key(tmp_path, capsys):
    run = run_dir_with(tmp_path / "runs" / "tiny", complete=[], latest=None)
    farm = farm_file(tmp_path)
    with pytest.raises(ValueError, match="checkpoints: list at least one"):  # neither checkpoints nor a follow
        load_farm(farm)
    loaded = load_farm(farm, follow=str(run))  # --follow: checkpoints may be left out
    follow = follow_settings(loaded, farm)
    assert (follow.run_dir, follow.name, follow.every, follow.poll, follow.keep_exports) == (run, "tiny", 1, 60.0,
                                                                                          False)
    for block, error in (({"run_dir": str(run), "evry": 2}, r"follow\.evry: unknown"),
                         ({"run_dir": str(run), "every": 0}, r"follow\.every: expected a number >= 1, got 0"),
                         ({"run_dir": str(run), "poll": "1s"}, r"follow\.poll: expected a number"),
                         ({"run_dir": str(run), "keep_exports": "no"}, r"follow\.keep_exports: expected true or "),
                         ({"run_dir": str(tmp_path)}, r"follow\.run_dir \(--follow\): .*: not a run directory"),
                         ({"run_dir": str(run), "name": "a/b"}, r"follow\.name: 'a/b' is a checkpoint's name or")):
        with pytest.raises(ValueError, match=error):
            follow_settings(load_farm(farm_file(tmp_path, **block)), farm)
    # a run directory that does not exist: a clear error from the command, nothing waits
    assert cli(["farm", str(farm), "--follow", str(tmp_path / "runs" / "typo")]) == 1
    assert f"{tmp_path / 'runs' / 'typo'}: no such run directory" in capsys.readouterr().err
    assert cli(["farm", str(farm), "--follow", str(run), "--slurm", str(tmp_path / "jobs")]) == 1
    assert "a follower runs as long as its run" in capsys.readouterr().err


def test_a_followed_checkpoint_is_a_farm_checkpoint_of_its_own_folder(tmp_path):
    """A followed step's jobs and its fine-tuning chain live under <out>/<name>/<tag>/; the state refuses
    another run."""
    farm = load_farm(farm_file(tmp_path), follow=str(run_dir_with(tmp_path / "tiny", [], None)))
    out = tmp_path / "farm"
    step = {"name": "tiny/step00000004", "model": str(out / "tiny" / "exports" / "step00000004"), "step": 4,
            "follow": "tiny"}
    zero_shot, stage1 = jobs_of({**farm, "checkpoints": [step]})
    assert zero_shot.out == out / "tiny" / "step00000004" / "scifact" / "zero-shot"
    assert zero_shot.model == out / "tiny" / "exports" / "step00000004"
    assert stage1.model == out / "tiny" / "step00000004" / "finetune" / "stage1" / "export"
    state = FollowState(out / "tiny" / "follow.json", str(tmp_path / "tiny"), {2}, {4: DELETED})
    state.save()
    assert FollowState.load(state.path, tmp_path / "tiny") == state
    with pytest.raises(ValueError, match=r"follow\.json: these evaluations follow .*/tiny, not .*/other"):
        FollowState.load(state.path, tmp_path / "other")


def start_follower(farm: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pretrieve", "farm", str(farm), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, env=pretrain_env())


def test_a_stop_signal_ends_the_follow_of_a_run_that_never_ends(tmp_path, sigint_at_default):
    """The run (max_steps 10) stopped at step 4 and never resumes: the follower waits for it; SIGTERM ends it
    with the preemption exit and one line, Ctrl-C by SIGINT; nothing is left half-done."""
    run = run_dir_with(tmp_path / "runs" / "stuck", complete=[], latest=None)
    farm = farm_file(tmp_path, run_dir=str(run), poll=0.2)
    marked = tmp_path / "farm" / ".pretrieve-farm"  # written once the follower holds the stop signals

    def following() -> bool:
        return marked.is_file()

    follower = start_follower(farm)
    while follower.poll() is None and not following():
        time.sleep(0.05)
    follower.send_signal(signal.SIGTERM)
    _, err = follower.communicate(timeout=300)
    assert follower.returncode == 85, err[-3000:]
    assert err.splitlines()[-1] == (f"pretrieve farm: preempted: following {run}: 0 checkpoints evaluated; 0 jobs cut "
                                    "off (not done); exit 85 (run the same command again to go on)")
    marked.unlink()
    assert ctrl_c_when(start_follower(farm), following) == (
        f"pretrieve farm: interrupted: following {run}: 0 checkpoints evaluated; 0 jobs cut off (not done); run the "
        "same command again to go on")


def test_the_report_plots_a_followed_runs_metric_against_step_beside_its_loss(tmp_path, capsys):
    """Evaluations of a run's steps 2 and 4 nested under it (as the follower logs them), beside a checkpoint of
    the farm's own: the step runs make steps.md/.csv/.png with the training loss at each step, not rows of the
    checkpoint tables; the page shows them; the report run holds the plot; a model card leaves them out."""
    from mlflow.tracking import MlflowClient

    from pretrieve.config import TrackingOptions
    from pretrieve.engine.tracking import Tracker
    from pretrieve.eval.report import evaluations_of

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)
    training = Tracker(TrackingOptions(uri=uri, system_metrics_every=None), run_dir, {}, {})
    for step, loss in ((1, 10.5), (2, 10.0), (3, 9.0), (4, 8.5)):
        training.log_metrics(step, {"loss": loss})
    training.finish()
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_run(training.run_id).info.experiment_id
    for name, tags, ndcg in (("tiny/step00000002", {"step": "2", "follow": "tiny"}, 0.1),
                             ("tiny/step00000004", {"step": "4", "follow": "tiny"}, 0.2), ("bm25", {}, 0.3)):
        run = client.create_run(experiment, tags={"pretrieve.farm": "eval", "checkpoint": name, "dataset": "scifact",
                                                  "stage": "zero-shot", "model_dir": str(tmp_path / name), **tags,
                                                  **({"mlflow.parentRunId": training.run_id} if tags else {})})
        client.log_metric(run.info.run_id, "ndcg_at_10", ndcg, step=int(tags.get("step", 0)))
        client.set_terminated(run.info.run_id)

    assert cli(["report", "--uri", uri, "--out", str(tmp_path / "report")]) == 0
    assert "| tiny | scifact | zero-shot | 4 | 0.2000 | – | – | 8.5000 |" in capsys.readouterr().out
    report = tmp_path / "report"
    assert (report / "ndcg@10.csv").read_text().splitlines() == ["checkpoint,scifact,mean", "bm25,0.3,0.3"]
    assert (report / "steps.csv").read_text().splitlines() == [
        "run,dataset,stage,step,ndcg@10,mrr@10,recall@100,loss", "tiny,scifact,zero-shot,2,0.1,,,10.0",
        "tiny,scifact,zero-shot,4,0.2,,,8.5"]
    page = (report / "report.html").read_text()
    assert "<h2>ndcg@10 against step</h2>" in page and page.count('src="data:image/png;base64,') == 4
    run_id = json.loads((report / "mlflow.json").read_text())["run_id"]
    assert {"steps.png", "steps.csv", "report.html"} <= {f.path for f in client.list_artifacts(run_id)}
    assert evaluations_of(uri, tmp_path / "tiny", training.run_id) == []  # the steps are not the model exported


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a process and every process under it, as a lost node or the OOM killer ends them."""
    tree = [proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    proc.communicate()


@pytest.mark.integration
def test_a_follower_evaluates_a_running_pretraining_and_resumes_after_a_kill(tmp_path, wiki_shards):
    """A tiny mlm run (checkpoint every 2 steps, keep 2, 10 steps) starts beside its follower and stops at step 4
    (train.stop_at); the follower exports and evaluates its checkpoints as they come. Once step 2 is evaluated it
    is killed with what it runs (the export or the evaluation of step 4); the run goes on to its end
    meanwhile, writing and deleting step 6 unseen. A new follower evaluates what is left, skips what the run
    deleted with a word, repeats nothing, and ends with the run. Every evaluation is one MLflow run nested under
    the pre-training run at its step; the report plots NDCG@10 against step beside the loss."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "tiny"
    run_dir.mkdir(parents=True)  # the run is to start: the follower waits for its checkpoints
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"out": str(tmp_path / "farm"), "gpus": 0, "eval": {"max_length": 32, "depth": 20},
                                "datasets": [{"name": "scifact", "beir": str(SCIFACT)}],
                                "follow": {"run_dir": str(run_dir), "poll": 0.5}}))
    pretrain = [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-mlm.yaml"), f"run_dir={run_dir}",
                f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
                "train.log_every=1", "checkpoint.every=2", "checkpoint.keep=2", "train.max_steps=10",
                "tracking.system_metrics_every=null"]
    home = tmp_path / "farm" / "tiny"
    step2 = home / "step00000002" / "scifact" / "zero-shot"
    follower = start_follower(farm)
    try:
        first = subprocess.run([*pretrain, "train.stop_at=4"], env=pretrain_env(), capture_output=True, text=True,
                               timeout=900, check=False)
        assert first.returncode == 0, first.stderr[-3000:]

        def on_step_4() -> bool:
            """Exporting or evaluating step 4 (the follower waits on that process: it is not between an evaluation
            and its MLflow record), or done with it."""
            for child in psutil.Process(follower.pid).children():
                try:
                    if child.status() != psutil.STATUS_ZOMBIE and "step00000004" in " ".join(child.cmdline()):
                        return True
                except psutil.NoSuchProcess:
                    continue
            state = json.loads((home / "follow.json").read_text()) if (home / "follow.json").is_file() else {}
            return 4 in state.get("evaluated", [])

        while follower.poll() is None and not ((step2 / "metrics.json").is_file() and on_step_4()):
            time.sleep(0.1)
        assert follower.poll() is None, follower.communicate()[1][-3000:]  # the run stopped, not ended: it waits
        evaluated_at = (step2 / "metrics.json").stat().st_mtime_ns
    finally:
        kill_tree(follower)

    second = subprocess.run([*pretrain, "resume=auto"], env=pretrain_env(), capture_output=True, text=True,
                            timeout=900, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step00000008", "step00000010"]
    resumed = start_follower(farm)
    out, err = resumed.communicate(timeout=1200)
    assert resumed.returncode == 0, err[-3000:]
    result = json_lines(out)[-1]
    evaluated, skipped = set(result["evaluated"]), {int(s): why for s, why in result["skipped"].items()}
    assert evaluated | set(skipped) == {2, 4, 6, 8, 10} and not evaluated & set(skipped)
    assert {2, 8, 10} <= evaluated and skipped[6] == DELETED and "skipped: " + DELETED in err
    assert (step2 / "metrics.json").stat().st_mtime_ns == evaluated_at  # not evaluated again
    assert not any((home / "exports").iterdir())  # each export removed once its evaluations were logged

    record = json.loads((run_dir / "run.json").read_text())
    client = MlflowClient(tracking_uri=record["tracking_uri"])
    runs = client.search_runs([client.get_run(record["run_id"]).info.experiment_id], "tags.follow = 'tiny'")
    assert sorted(int(r.data.tags["step"]) for r in runs) == sorted(evaluated)  # one run each, none twice
    for run in runs:
        step = int(run.data.tags["step"])
        metrics = json.loads((home / f"step{step:08d}" / "scifact" / "zero-shot" / "metrics.json").read_text())
        assert run.data.tags["mlflow.parentRunId"] == record["run_id"] and run.info.status == "FINISHED"
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "ndcg_at_10")] == \
            [(step, pytest.approx(metrics["ndcg@10"]))]

    report = tmp_path / "report"
    assert cli(["report", "--uri", record["tracking_uri"], "--out", str(report)]) == 0
    rows = [line.split(",") for line in (report / "steps.csv").read_text().splitlines()[1:]]
    assert [int(row[3]) for row in rows] == sorted(evaluated) and all(float(row[-1]) > 0 for row in rows)  # loss
    assert (report / "steps.png").stat().st_size > 1000
    report_run = json.loads((report / "mlflow.json").read_text())["run_id"]
    assert "steps.png" in {f.path for f in client.list_artifacts(report_run)}
