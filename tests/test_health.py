"""Health alarms (engine/health.py): each fault injected into a real tiny DeepSpeed run on CPU (tests/inject_fault.py)
and each alarm's message, exit code and MLflow tag (a sqlite store in the test's folder); a NaN writes no
checkpoint of its state and keeps the last good one; `warn` goes on; `train.health` is checked by key."""

import json
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
from mlflow import MlflowClient
from support import pretrain_env

from pretrieve.config import load_config
from pretrieve.pretrain_config import experiment
from pretrieve.utils.options import ConfigError
from pretrieve.utils.run_dir import latest_checkpoint

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "pretrain" / "tiny-mlm.yaml"
INJECT = Path(__file__).resolve().parent / "inject_fault.py"


def _run(run_dir: Path, manifest: Path, fault: str, step: int, *overrides: str) -> subprocess.CompletedProcess:
    """tiny-mlm (ZeRO 0: a NaN reaches the weights) with fault `fault` from step `step` on (or at it)."""
    command = [sys.executable, str(INJECT), "-m", "pretrieve", "pretrain", str(CONFIG), f"run_dir={run_dir}",
               f"data.manifests=[{manifest}]", "data.weights=null", "method.max_len=64", "train.micro_batch_size=4",
               "tracking.system_metrics_every=null", *overrides]
    return subprocess.run(command, env=pretrain_env(FAULT_AT=fault, FAULT_STEP=str(step)), capture_output=True,
                          text=True, timeout=600, check=False)


def _mlflow_run(run_dir: Path):
    tracked = json.loads((run_dir / "run.json").read_text())
    return MlflowClient(tracked["tracking_uri"]).get_run(tracked["run_id"])


def _logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tags(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step*") if p.is_dir())


def _batch_of_step(manifest: Path, step: int, batch_size: int = 4) -> list[tuple[str, int]]:
    """(shard file, index) of each sample of step `step`'s batch: the stream read on its own, one slot as the
    run's loader without workers reads it."""
    from pretrieve.data.stream import ShardStream

    samples = islice(iter(ShardStream([manifest], seed=42)), (step - 1) * batch_size, step * batch_size)
    return [(sample["shard_file"], sample["index"]) for sample in samples]


def test_a_nan_loss_stops_naming_its_step_and_samples_and_keeps_the_last_good_checkpoint(tmp_path, wiki_shards):
    """Step 4's loss is NaN; step 4 is a save step that does not log (log_every 3): the save reads the window
    first, and the run ends there, exit 87, with no checkpoint of step 4 and `latest` on step 2."""
    manifest, run_dir = wiki_shards / "manifest.json", tmp_path / "runs" / "nan"
    done = _run(run_dir, manifest, "nan", 4, "train.max_steps=6", "train.log_every=3", "checkpoint.every=2")
    assert done.returncode == 87, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("pretrieve pretrain: alarm")]
    assert line.startswith("pretrieve pretrain: alarm nonfinite at step 4: the loss is not finite (NaN or inf) at "
                           "step 4 (and so is the gradient norm), fed by rank 0's micro-batch: shard ")
    named = {}
    for shard, index in _batch_of_step(manifest, 4):
        named.setdefault(shard, []).append(str(index))
    for shard, indexes in named.items():  # the batch's own samples, shard by shard
        assert f"shard {shard} sample{'s' * (len(indexes) > 1)} {', '.join(indexes)}" in line, line
    assert "no checkpoint of this state is saved, `latest` stays step00000002; exit 87" in line
    assert "(train.health.nonfinite: stop)" in line
    assert latest_checkpoint(run_dir) == "step00000002" and _tags(run_dir) == ["step00000002"]
    assert _logged_steps(run_dir) == [3]
    assert "alarm nonfinite" in done.stderr.split(line)[0].splitlines()[-1]  # the progress line, just before
    run = _mlflow_run(run_dir)
    assert run.info.status == "FAILED"
    assert run.data.tags["pretrieve.health.nonfinite"].startswith("stop: alarm nonfinite at step 4: the loss is not")
    assert run.data.params["train.health.nonfinite"] == "stop" and run.data.params["train.health.collapse"] == "warn"


def test_a_nan_loss_with_warn_goes_on_and_saves_no_checkpoint_of_a_nan_window(tmp_path, wiki_shards):
    """The same NaN with nonfinite: warn: one warning, the progress line's figure, and every later window (the
    weights are NaN from step 4 on, at ZeRO 0) is not saved; the run finishes, exit 0, `latest` on step 2."""
    manifest, run_dir = wiki_shards / "manifest.json", tmp_path / "runs" / "nan-warn"
    done = _run(run_dir, manifest, "nan", 4, "train.max_steps=6", "train.log_every=3", "checkpoint.every=2",
                "train.health.nonfinite=warn")
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "alarm nonfinite" in line and "warning" in line]
    assert len(warnings) == 1 and "training goes on (train.health.nonfinite: warn" in warnings[0], done.stderr[-3000:]
    assert "step 4: checkpoint not saved, its window holds a non-finite step; `latest` stays step00000002" \
        in done.stderr
    assert "step 6: checkpoint not saved" in done.stderr
    assert "pretrain mlm: 6/6 step (100%)" in done.stderr and "alarm nonfinite" in done.stderr.split("6/6 step")[1]
    assert latest_checkpoint(run_dir) == "step00000002" and _tags(run_dir) == ["step00000002"]
    assert _logged_steps(run_dir) == [3, 6]
    run = _mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    assert run.data.tags["pretrieve.health.nonfinite"].startswith("warn: alarm nonfinite at step 4")


def test_a_model_that_sees_its_targets_collapses_the_loss_and_stops(tmp_path, wiki_shards):
    """The masked tokens left in the input (a decoder shown what it predicts): the loss falls under half its
    first window's (collapse_fraction 0.5: the tiny model would take thousands of steps to reach the default
    0.02) and the run stops, exit 88 (measured: at step 75). Without the leak the same run's 300 steps stay above
    0.7 of the first window's loss (measured)."""
    manifest, run_dir = wiki_shards / "manifest.json", tmp_path / "runs" / "leak"
    done = _run(run_dir, manifest, "leak", 1, "train.max_steps=300", "train.log_every=5", "checkpoint.every=1000",
                "train.lr=1e-2", "train.warmup_ratio=0", "model.dropout=0", "train.health.collapse=stop",
                "train.health.collapse_fraction=0.5")
    assert done.returncode == 88, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.startswith("pretrieve pretrain: alarm")]
    assert line.startswith("pretrieve pretrain: alarm collapse at step ") and "below 0.5 of its first logged value" \
        in line and "(step 5)" in line and "a model that sees its own targets" in line, line
    stopped = int(line.split("at step ")[1].split(":")[0])
    assert _logged_steps(run_dir)[-1] == stopped < 300 and not _tags(run_dir)
    assert "alarm collapse" in done.stderr.split(line)[0].splitlines()[-1]
    assert _mlflow_run(run_dir).data.tags["pretrieve.health.collapse"].startswith(f"stop: alarm collapse at step "
                                                                                  f"{stopped}")


def _stopped(run_dir: Path, manifest: Path, fault: str, step: int, code: int, every: int) -> str:
    """An 8-step run logging every 2 steps and saving every `every`, with `fault` from step `step` on: ended by an
    alarm with exit `code`. Its stderr."""
    done = _run(run_dir, manifest, fault, step, "train.max_steps=8", "train.log_every=2", f"checkpoint.every={every}")
    assert done.returncode == code, done.stderr[-3000:]
    return done.stderr


def test_no_gradient_reaching_the_weights_stops_at_the_first_window_without_one(tmp_path, wiki_shards):
    """From step 4 on the loss is cut off from the graph: the window of steps 3-4 still had a gradient, the one of
    steps 5-6 has none, and the run stops at step 6, exit 89."""
    run_dir = tmp_path / "runs" / "frozen"
    stderr = _stopped(run_dir, wiki_shards / "manifest.json", "frozen", 4, 89, every=4)
    assert "pretrieve pretrain: alarm zero_grad_norm at step 6: the gradient norm was 0 at every step of the window " \
           "(steps 5-6); likely no gradient reaches the trained weights" in stderr, stderr[-3000:]
    assert "`latest` stays step00000004; exit 89 (train.health.zero_grad_norm: stop)" in stderr
    assert _logged_steps(run_dir) == [2, 4, 6] and _tags(run_dir) == ["step00000004"]
    assert _mlflow_run(run_dir).data.tags["pretrieve.health.zero_grad_norm"].startswith("stop: alarm zero_grad_norm")


def test_a_schedule_that_ends_before_max_steps_stops_at_its_first_zero_lr(tmp_path, wiki_shards):
    """The schedule's lr is 0 from step 5 of 8 (the warm-up is step 1): the run stops at step 6, exit 90."""
    run_dir = tmp_path / "runs" / "lr"
    stderr = _stopped(run_dir, wiki_shards / "manifest.json", "lr", 5, 90, every=8)
    assert "pretrieve pretrain: alarm zero_lr at step 6: the learning rate is 0 at step 5, after the warm-up's 1 " \
           "step; likely a schedule that ends before train.max_steps" in stderr, stderr[-3000:]
    assert "no checkpoint was saved yet; exit 90 (train.health.zero_lr: stop)" in stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6] and records[-1]["lr"] == 0 and records[1]["lr"] > 0
    assert _mlflow_run(run_dir).data.tags["pretrieve.health.zero_lr"].startswith("stop: alarm zero_lr at step 6")


def _config(wiki_shards, *overrides: str):
    return load_config(CONFIG, [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                                *overrides])


def test_an_optimizer_lr_of_0_is_refused_when_the_config_is_read_or_warned_about(tmp_path, wiki_shards, capsys):
    ds_config = tmp_path / "zero0_lr0.json"
    shutil.copy(ROOT / "ds_configs" / "zero0.json", ds_config)
    ds_config.write_text(ds_config.read_text().replace('"lr": "auto"', '"lr": 0'))
    with pytest.raises(ConfigError, match=rf"train.ds_config: {ds_config} sets the optimizer's lr to 0: every step "
                                          "would train at lr 0"):
        experiment(_config(wiki_shards, f"train.ds_config={ds_config}"))
    experiment(_config(wiki_shards, f"train.ds_config={ds_config}", "train.health.zero_lr=warn"))
    assert "pretrieve: warning: train.ds_config:" in capsys.readouterr().err
    experiment(_config(wiki_shards, f"train.ds_config={ds_config}", "train.health.zero_lr=off"))
    assert "warning" not in capsys.readouterr().err
    experiment(_config(wiki_shards))  # the shipped ds_configs' lr is "auto": train.lr


@pytest.mark.parametrize("override,message", [
    ("train.health.collapse=loud", "train.health.collapse: 'loud' is not one of warn, stop, off"),
    ("train.health.collapse_fraction=1.5", "train.health.collapse_fraction: must be > 0 and < 1, got 1.5"),
    ("train.health.colapse=stop", "train.health.colapse: unknown key"),
    ("train.health=stop", ("train.health: expected a mapping of nonfinite, collapse, collapse_fraction, "
                           "zero_grad_norm, zero_lr; got 'stop'")),
])
def test_train_health_is_checked_by_key(wiki_shards, override, message):
    with pytest.raises(ConfigError, match=message):
        experiment(_config(wiki_shards, override))


def test_a_fine_tuning_batch_is_named_by_its_examples():
    """Fine-tuning's loader keeps the rows of the batch it yielded last: their queries are the batch's, and an
    alarm names them by file:line."""
    from support import SAMPLES
    from transformers import AutoTokenizer

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
    from pretrieve.finetune.batches import GroupLoader
    from pretrieve.finetune.examples import read_examples

    examples = read_examples(SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)
    loader = GroupLoader(examples, tokenizer, 2, 1, 64, 16, seed=7)
    batches = iter(loader)
    next(batches)
    batch = next(batches)
    epoch, rows = loader.last_batch
    decoded = [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch["query_input_ids"]]
    assert decoded == [tokenizer.decode(tokenizer(examples[row].query)["input_ids"], skip_special_tokens=True)
                       for row in rows]
    assert loader.describe_batch(loader.last_batch) == \
        f"examples {', '.join(examples[row].where for row in rows)} (epoch {epoch})"
    assert all(examples[row].where.startswith(f"{SAMPLES}/finetune/embedder_retrieval_msmarco.jsonl:") for row in rows)


def test_a_run_resumed_with_more_steps_trains_on_at_its_new_schedule(tmp_path, wiki_shards):
    """A finished 2-step run (linear: its lr is 0 after step 2) resumed with train.max_steps=4 trains step 3 at
    the new schedule's lr, not the old schedule's 0: no zero_lr alarm, the lr of each step its formula's."""
    from pretrieve.engine.lr_schedule import LRSchedule

    run_dir, manifest = tmp_path / "runs" / "longer", wiki_shards / "manifest.json"
    for steps, resume in ((2, []), (4, ["resume=auto"])):
        done = _run(run_dir, manifest, "", 0, f"train.max_steps={steps}", "train.log_every=1",
                    "checkpoint.every=2", "train.warmup_ratio=0", "tracking.enabled=false", *resume)
        assert done.returncode == 0, done.stderr[-3000:]
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    longer = LRSchedule("linear", total_steps=4, warmup_steps=0)
    assert lrs == pytest.approx([1e-4, 0.5e-4, 1e-4 * longer.factor(2), 1e-4 * longer.factor(3)], rel=1e-12)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stream_names_the_samples_of_each_batch_it_yielded(wiki_shards, workers):
    """What a NaN's line names: `last_batch` read again gives each batch's own samples, worker by worker."""
    from pretrieve.data.stream import ShardStream, StreamLoader

    stream = ShardStream([wiki_shards / "manifest.json"], seed=3, shuffle_buffer=16)
    for batch in islice(StreamLoader(stream, batch_size=5, num_workers=workers), 9):
        shards = {}
        for sample in batch:
            shards.setdefault(sample["shard_file"], []).append(str(sample["index"]))
        assert stream.describe_batch(stream.last_batch) == "; ".join(
            f"shard {shard} sample{'s' * (len(found) > 1)} {', '.join(found)}" for shard, found in shards.items()) \
            + " (epoch 0)"


@pytest.mark.integration
def test_a_nan_on_one_of_two_ranks_stops_both_at_its_step(tmp_path, wiki_shards):
    """Two CPU ranks under the deepspeed launcher (ZeRO 2, a log line a step), rank 1's loss NaN at step 4: both
    ranks stop there with exit 87 (the window's verdict is reduced over ranks), rank 1 names its own batch, rank 0
    says another rank's fed it, and `latest` stays on step 2."""
    from fault_runs import two_ranks
    from inject_fault import python_with_fault
    from test_launchers import _env

    run_dir = tmp_path / "run"
    done = subprocess.run(two_ranks(run_dir, wiki_shards / "manifest.json"), capture_output=True, text=True,
                          timeout=600, check=False, env=_env(PRETRIEVE_PYTHON=str(python_with_fault(tmp_path)),
                                                             FAULT_AT="nan", FAULT_STEP="4", FAULT_RANK="1"))
    output = done.stdout + done.stderr
    assert done.returncode == 87, output[-3000:]
    assert "pretrieve: rank 1: the non-finite loss of step 4 came from shard " in output, output[-3000:]
    assert output.count("pretrieve pretrain: alarm nonfinite at step 4: the loss is not finite (NaN or inf) at step "
                        "4") == 1
    assert "fed by another rank's micro-batch (that rank's line names it)" in output
    assert latest_checkpoint(run_dir) == "step00000002" and _tags(run_dir) == ["step00000002"]
