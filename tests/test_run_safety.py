"""What keeps a run directory whole when things go wrong: one trainer per run directory (a lock naming its
holder), a resume checked against the checkpoint's config before anything is written, no step logged twice
after an attempt that died before its first checkpoint, a `latest` that names no checkpoint, tags a kill left
unpruned, a full disk while saving, and method options out of range."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import pretrain_env
from pretrieve.config import ConfigError, load_config
from pretrieve.engine.checkpoint import prune_tags
from pretrieve.models.heads import get_method
from pretrieve.models.heads.registry import METHODS, option_range
from pretrieve.pretrain_config import experiment
from pretrieve.utils.run_dir import latest_checkpoint
from pretrieve.utils.run_lock import DirectoryLock

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _pretrain(run_dir, wiki_shards, *overrides, config="tiny-retromae.yaml", check=True):
    cmd = [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / config), f"run_dir={run_dir}",
           f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
           "train.micro_batch_size=4", "train.log_every=1", "checkpoint.every=2", "tracking.enabled=false", *overrides]
    done = subprocess.run(cmd, env=pretrain_env(), capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


_HOLD = """
import sys, time
from pretrieve.utils.run_lock import DirectoryLock
with DirectoryLock(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)  # killed by the test
"""

_HOLD_AND_FORK = """
import os, sys, time
from pretrieve.utils.run_lock import DirectoryLock
lock = DirectoryLock(sys.argv[1], "trainer").__enter__()
child = os.fork()
if child == 0:
    time.sleep(600)  # killed by the test
    os._exit(0)
print(child, flush=True)
time.sleep(600)  # killed by the test
"""


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path, wiki_shards):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path / "run"), "trainer"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = _pretrain(tmp_path / "run", wiki_shards, "train.max_steps=2", check=False)
        assert done.returncode != 0
        assert f"in use by another trainer (pid {holder.pid} on " in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "run" / "config.yaml").exists()  # refused before anything was written
    finally:
        holder.kill()
        holder.wait()
    # its holder is gone (killed: no clean release): the lock is stale, taken over with a note
    with DirectoryLock(tmp_path / "run", "trainer"):
        assert json.loads((tmp_path / "run" / ".lock").read_text())["pid"] == os.getpid()
    assert (tmp_path / "run" / ".lock").read_text() == ""  # released cleanly: no holder to report


def test_a_lock_is_not_inherited_by_forked_children(tmp_path):
    """A DataLoader worker or tokenizer pool forked by the holder, outliving it, does not keep the directory."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_AND_FORK, str(tmp_path / "run")], stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    holder.kill()
    holder.wait()
    try:
        os.kill(child, 0)  # the child still runs
        with DirectoryLock(tmp_path / "run", "trainer"):
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_second_prepare_into_one_folder_is_refused(tmp_path):
    from support import SAMPLES

    out = tmp_path / "shards"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out), "prepare"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        done = subprocess.run([sys.executable, "-m", "pretrieve", "prepare", "--source", "wikipedia", "--input",
                               str(SAMPLES / "wikipedia"), "--out", str(out), "--workers", "0"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and f"in use by another prepare (pid {holder.pid} on " in done.stderr
        assert not list(out.glob("*.tar")) and not (out / "manifest.json").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, wiki_shards):
    """A retromae run stopped at step 2 of 4 (checkpoint.every 2)."""
    run_dir = tmp_path_factory.mktemp("safety") / "run"
    _pretrain(run_dir, wiki_shards, "train.max_steps=4", "train.stop_at=2")
    return run_dir


def test_a_resume_with_another_config_is_refused_before_anything_is_written(stopped_run, wiki_shards, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(stopped_run), str(run_dir)], check=True)
    before = {name: (run_dir / name).read_text() for name in ("config.yaml", "encoder_config.json", "metrics.jsonl")}
    done = _pretrain(run_dir, wiki_shards, "train.max_steps=4", "resume=auto", "train.micro_batch_size=2",
                     "method.mlm_ratio=0.2", check=False)
    assert done.returncode != 0
    assert "resume: this config differs from the checkpoint's" in done.stderr
    assert "method.mlm_ratio: 0.3 -> 0.2" in done.stderr and "train.micro_batch_size: 4 -> 2" in done.stderr
    assert {name: (run_dir / name).read_text() for name in before} == before
    # cadence and length may change: recorded, and the run goes on
    done = _pretrain(run_dir, wiki_shards, "train.max_steps=5", "resume=auto", "checkpoint.every=5")
    assert _steps(run_dir) == [1, 2, 3, 4, 5]
    # 2 steps of 4 samples: where the run goes on, said once (rank 0)
    assert done.stderr.count("resuming from step00000002 (data position: epoch 0, 8 of its 648 samples read)") == 1
    [record] = [json.loads(line) for line in (run_dir / "resume_changes.jsonl").read_text().splitlines()]
    assert record["checkpoint"] == "step00000002"
    assert record["changes"].pop("run_dir") == [str(stopped_run), str(run_dir)]  # copied: allowed
    assert record["changes"] == {"checkpoint.every": [2, 5], "train.max_steps": [4, 5], "train.stop_at": [2, None]}


def test_a_resume_compares_paths_as_files_and_resume_is_no_change(tmp_path, monkeypatch):
    """The manifest written relative at the start and absolute at the resume is one file: no change; and
    `resume=auto`, which every resume says, is not recorded as one."""
    from pretrieve.engine.resume_check import check_resume
    from pretrieve.pretrain_config import DataOptions

    monkeypatch.chdir(tmp_path)
    classes = lambda config: {"data": DataOptions}  # noqa: E731
    saved = {"run_dir": "run", "data": {"manifests": ["shards/manifest.json"]}}
    now = {"run_dir": "run", "resume": "auto", "data": {"manifests": [str(tmp_path / "shards" / "manifest.json")]}}
    assert check_resume(saved, tmp_path / "config.yaml", now, classes) == {}
    moved = {**now, "data": {"manifests": [str(tmp_path / "other" / "manifest.json")]}}
    with pytest.raises(ConfigError, match="data.manifests"):
        check_resume(saved, tmp_path / "config.yaml", moved, classes)


def test_resume_changes_allow_continues_and_is_recorded(stopped_run, wiki_shards, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(stopped_run), str(run_dir)], check=True)
    _pretrain(run_dir, wiki_shards, "train.max_steps=4", "resume=auto", "train.micro_batch_size=2",
              "resume_changes=allow")
    assert _steps(run_dir) == [1, 2, 3, 4]
    [record] = [json.loads(line) for line in (run_dir / "resume_changes.jsonl").read_text().splitlines()]
    assert record["changes"]["train.micro_batch_size"] == [4, 2] and record["changes"]["resume_changes"] == [None,
                                                                                                              "allow"]


def test_a_fresh_start_drops_what_an_attempt_without_checkpoint_logged(tmp_path, wiki_shards):
    """An attempt that died before its first checkpoint left steps 1-3 in metrics.jsonl: the rerun starts at
    step 1 and does not log them twice."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (1, 2, 3)))
    _pretrain(run_dir, wiki_shards, "train.max_steps=2")
    assert _steps(run_dir) == [1, 2]
    assert all(r["loss"] != 9.0 for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))


def test_latest_naming_no_checkpoint_falls_back_or_is_refused(stopped_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-r", str(stopped_run), str(run_dir)], check=True)
    latest = run_dir / "checkpoints" / "latest"
    for text in ("step00000099", ""):
        latest.write_text(text)
        assert latest_checkpoint(run_dir) == "step00000002"
        assert "using the newest complete one, step00000002" in capsys.readouterr().err
    subprocess.run(["rm", "-r", str(run_dir / "checkpoints" / "step00000002")], check=True)
    with pytest.raises(FileNotFoundError, match=r"latest: is empty, and no complete checkpoint"):
        latest_checkpoint(run_dir)


def test_prune_keeps_latest_and_the_tags_before_it(tmp_path):
    """A kill between moving `latest` and pruning left step 1 behind (keep 2); step 5, a save that did not
    finish, stays until that step is saved again."""
    for step in range(1, 6):
        (tmp_path / f"step{step:08d}").mkdir()
    prune_tags(tmp_path, "step00000004", keep=2, every=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000003", "step00000004", "step00000005"]


def test_a_stop_save_does_not_push_out_a_regular_checkpoint(tmp_path):
    """Every 200 steps, keep 5: a stop at step 871 saved a tag off that schedule; once step 1000 is saved it
    goes, and steps 200-600 (a study evaluates each) stay: four regular tags before the newest."""
    for step in (200, 400, 600, 871, 1000):
        (tmp_path / f"step{step:08d}").mkdir()
    prune_tags(tmp_path, "step00001000", keep=5, every=200)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step{s:08d}" for s in (200, 400, 600, 1000)]
    prune_tags(tmp_path, "step00001000", keep=2, every=200)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000600", "step00001000"]


def test_a_full_disk_names_the_checkpoint_and_leaves_latest(tmp_path, wiki_shards):
    """A 12 MB tmpfs: the tiny run's first checkpoint (weights and Adam states, ~20 MB) does not fit."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        done = _pretrain(mount / "run", wiki_shards, "train.max_steps=4", check=False)
        assert done.returncode != 0
        assert f"{mount / 'run' / 'checkpoints' / 'step00000002'}: saving the checkpoint failed: no space left on " \
               "device: " in done.stderr, done.stderr[-3000:]
        assert "`latest` still names nothing: free space" in done.stderr
        assert not (mount / "run" / "checkpoints" / "step00000002").exists()  # its space is free again
        assert latest_checkpoint(mount / "run") is None
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("method,option,value,rule", [
    ("retromae", "mlm_ratio", 1.5, "in \\(0, 1\\]"), ("mlm", "mlm_ratio", -0.2, "in \\(0, 1\\]"),
    ("retromae", "decoder_hide_ratio", 2.0, "in \\[0, 1\\]"), ("retromae", "decoder_pool_size", 0, ">= 1"),
    ("dupmae", "bow_weight", -1, ">= 0"), ("retromae", "max_len", 0, ">= 3"), ("costa", "temperature", 0, "> 0"),
    ("seed", "decoder_window", 0, ">= 1"),
])
def test_method_options_out_of_range_are_refused_by_key(wiki_shards, method, option, value, rule):
    config = load_config(CONFIGS / f"tiny-{method}.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                           "data.weights=null", f"method.{option}={value}"])
    with pytest.raises(ConfigError, match=f"method.{option}: must be {rule}.*, got {value}"):
        experiment(config)


@pytest.mark.parametrize("method,overrides,message,bound", [
    # the decoder's mask covers the encoder's: below the encoder's ratio it would be the encoder's mask
    ("lexmae", ["method.decoder_mask_ratio=0.1"], r"method.decoder_mask_ratio: 0.1 is below method.mlm_ratio 0.3, "
                                                  r"but the decoder's mask covers the encoder's, so it would mask 0.3",
     {"decoder_mask_ratio": 0.3}),
    # a span is cut to max_len - 2 tokens
    ("cocondenser", ["method.span_len=200"], r"method.span_len: 200 tokens do not fit method.max_len 64 with \[CLS\] "
                                             r"and \[SEP\] \(62 at most\)", {"max_len": 64, "span_len": 62}),
    ("contrastive", ["model.vocab_loss=plain"], "model.vocab_loss: plain, but method contrastive computes no "
                                                "vocabulary loss", {}),
])
def test_options_that_contradict_or_do_nothing_are_refused_by_key(wiki_shards, method, overrides, message, bound):
    config = load_config(CONFIGS / f"tiny-{method}.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                           "data.weights=null", *overrides])
    with pytest.raises(ConfigError, match=message):
        experiment(config)
    get_method(method).options_from(bound)  # at the bound, the option does what it says


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_the_fused_kernel_without_cuda_is_refused_by_key_unless_interpreted(wiki_shards, monkeypatch):
    """Triton without a GPU ends the first step in "0 active drivers": refused before, as model.vocab_loss liger
    is. Under Triton's interpreter (TRITON_INTERPRET=1, how the tests run the kernel on CPU) it runs."""
    pytest.importorskip("triton")
    config = load_config(CONFIGS / "tiny-retromae.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                          "data.weights=null", "method.attention_impl=fused",
                                                          "method.decoder_attention_dropout=0"])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert experiment(config).options.attention_impl == "fused"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="method.attention_impl: fused runs a Triton kernel, which needs a CUDA "
                                          "device; use auto, sdpa or eager on CPU"):
        experiment(config)


@pytest.mark.parametrize("key", ["max_runtime", "startup_timeout"])
def test_time_limits_must_be_positive(wiki_shards, key):
    config = load_config(CONFIGS / "tiny-mlm.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                     "data.weights=null", f"train.{key}=0"])
    with pytest.raises(ConfigError, match=f"train.{key}: must be > 0 seconds \\(or null\\), got 0"):
        experiment(config)


def test_every_numeric_method_option_has_a_range():
    from dataclasses import fields

    get_method("mlm")  # registers the built-in methods
    # lists of numbers (matryoshka_dims) are checked whole by their own function, which names the key
    numeric = {(m.name, f.name): f for m in METHODS.values() for f in fields(m.options)
               if any(t in str(f.type) for t in ("int", "float"))
               and not any(t in str(f.type) for t in ("str", "list"))}
    assert "decoder_attention_dropout" in {name for _, name in numeric}  # float | None counts as numeric
    assert {key for key, f in numeric.items() if option_range(f) is None} == set()


@pytest.mark.parametrize("argv,message", [
    (["stream", "m.json", "--weights", "nan"], "argument --weights: a mixture weight must be finite and >= 0, got nan"),
    (["stream", "m.json", "--shuffle-buffer", "-5"], "argument --shuffle-buffer: must be >= 1, got -5"),
    (["eval", "--out", "x", "--bm25", "--depth", "0"], "argument --depth: must be >= 1, got 0"),
    (["encode", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["eval", "--max-length", "0"], "argument --max-length: must be >= 1, got 0"),  # ran at 128, "given"
    (["eval", "--max-length", "-5"], "argument --max-length: must be >= 1, got -5"),  # an OverflowError traceback
    (["encode", "--max-length", "0"], "argument --max-length: must be >= 1, got 0"),
    (["mine", "--max-length", "-5"], "argument --max-length: must be >= 1, got -5"),
    (["mine", "--query-max-length", "2"], "argument --query-max-length: must be >= 3, got 2"),
    (["teacher-scores", "--max-length", "0"], "argument --max-length: must be >= 1, got 0"),
])
def test_bad_command_line_values_are_refused_by_option(argv, message, capsys):
    from pretrieve.cli import main

    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and message in capsys.readouterr().err


def _damaged_copy(wiki_shards: Path, out: Path, shard: int = 3) -> Path:
    """The Wikipedia shards with shard `shard` cut to half its size, as an interrupted copy leaves it."""
    shutil.copytree(wiki_shards, out)
    manifest = json.loads((out / "manifest.json").read_text())
    damaged = out / manifest["shards"][shard]["file"]
    damaged.write_bytes(damaged.read_bytes()[:damaged.stat().st_size // 2])
    return damaged


def test_a_damaged_shard_is_refused_before_start_up_and_a_failed_start_leaves_nothing(tmp_path, wiki_shards):
    """A truncated shard is named before DeepSpeed starts, and the run directory it would have made is not left
    behind. Unchecked (data.check_shards=none), the stream finds it after start-up, before the first step: the
    directory goes too, and the MLflow run ends FAILED, not RUNNING."""
    from mlflow.tracking import MlflowClient

    damaged = _damaged_copy(wiki_shards, tmp_path / "shards")
    runs = tmp_path / "runs"
    done = _pretrain(runs / "checked", tmp_path / "shards", "train.max_steps=2", "tracking.enabled=true",
                     check=False)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"1 of 11 shards fail the size check (data.check_shards): {damaged}: truncated: " in done.stderr
    assert not (runs / "checked").exists() and not (runs / "mlflow.db").exists()  # refused before any of it

    done = _pretrain(runs / "unchecked", tmp_path / "shards", "train.max_steps=2", "tracking.enabled=true",
                     "data.check_shards=none", check=False)
    assert done.returncode == 1 and f"{damaged}: " in done.stderr, done.stderr[-3000:]
    assert not (runs / "unchecked").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.run_name == "unchecked" and run.info.status == "FAILED"


def test_the_shards_sha256_is_checked_when_asked(tmp_path, wiki_shards):
    """A shard changed in place keeps its size: `sha256` finds it, `size` does not."""
    from pretrieve.data.shard_check import check_shards
    from pretrieve.data.stream import StreamError

    shutil.copytree(wiki_shards, tmp_path / "shards")
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    changed = tmp_path / "shards" / manifest["shards"][5]["file"]
    data = bytearray(changed.read_bytes())
    data[-2000] ^= 1
    changed.write_bytes(bytes(data))
    assert check_shards([str(tmp_path / "shards" / "manifest.json")], how="size") == 11
    with pytest.raises(StreamError, match=rf"1 of 11 shards fail the sha256 check .*{changed}: sha256 differs"):
        check_shards([str(tmp_path / "shards" / "manifest.json")], how="sha256")


CONFIG_OF = {"pretrain": CONFIGS / "tiny-retromae.yaml", "finetune": CONFIGS.parent / "finetune" / "tiny.yaml"}


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_a_foreign_file_in_the_export_folder_is_refused_before_the_first_step(tmp_path, wiki_shards, tiny_encoder,
                                                                              command):
    """RUN/export is where a finished run writes its export: a user's file there is refused by the export's own
    check before start-up, with nothing written (no step, no checkpoint, no MLflow run), not after training."""
    from support import SAMPLES

    run_dir = tmp_path / "runs" / "run"
    (run_dir / "export").mkdir(parents=True)
    (run_dir / "export" / "notes.txt").write_text("mine\n")
    data = {"pretrain": [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                         "method.max_len=64"],
            "finetune": [f"finetune.init_from={tiny_encoder}",
                         f"finetune.data=[{SAMPLES / 'finetune' / 'embedder_retrieval_msmarco.jsonl'}]"]}[command]
    done = subprocess.run([sys.executable, "-m", "pretrieve", command, str(CONFIG_OF[command]), f"run_dir={run_dir}",
                           *data, "train.micro_batch_size=4", "train.max_steps=2", "tracking.enabled=true"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"{run_dir / 'export'}: holds 1 entries that are not a pretrieve export (notes.txt); nothing was " \
           "written" in done.stderr, done.stderr[-3000:]
    assert "step 1" not in done.stderr and sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == [
        Path("runs"), Path("runs/run"), Path("runs/run/export"), Path("runs/run/export/notes.txt")]
