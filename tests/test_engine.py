"""The training engine slice that exists: config validation, DeepSpeed config filling, and exact resume on CPU."""

import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import free_port, old_parameter_name, pretrain_env, result_line
from pretrieve.config import LR_SCHEDULES, ConfigError, load_config
from pretrieve.engine.ds_config import DS_CONFIG_DIR, deepspeed_config
from pretrieve.engine.lr_schedule import LRSchedule
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def _config(wiki_shards, *overrides):
    return load_config(CONFIGS / "tiny-retromae.yaml", [f"data.manifests=[{wiki_shards / 'manifest.json'}]",
                                                        "data.weights=null", *overrides])


@pytest.mark.parametrize("override,message", [
    ("bogus=1", "bogus: unknown top-level key"),
    ("train.lr_max=1", "train.lr_max: unknown key"),
    ("data.manifests=[/nope/manifest.json]", r"data.manifests\[0\]: /nope/manifest.json not found"),
    ("train.global_batch_size=64", "train.global_batch_size: 64 != micro_batch_size 8 x grad_accum 1 x world size 1"),
    ("train.precision=fp8", "train.precision: 'fp8'"),
    ("train.zero_stage=4", "train.zero_stage: 4"),
    ("resume=sometimes", "resume: 'sometimes': the only value is auto"),
    ("data.weights=[1,2]", "data.weights: 2 weights for 1 manifests"),
    ("train.offload_optimizer=true", "train.offload_optimizer: needs train.zero_stage 1, 2 or 3"),
    ("train.offload_params=true train.zero_stage=2", "train.offload_params: needs train.zero_stage 3"),
    # wrong types and values fail here, not after DeepSpeed has started
    ("train.micro_batch_size=abc", "train.micro_batch_size: expected int, got 'abc'"),
    ("train.lr=fast", "train.lr: expected float, got 'fast'"),
    ("train.lr=-1", "need lr > 0"),
    ("train.warmup_ratio=2", "0 <= warmup_ratio <= 1"),
    ("model.hidden_size=big", "model.hidden_size: expected int, got 'big'"),
    ("method.mlm_ratio=abc", "method.mlm_ratio: expected float, got 'abc'"),
    ("method.max_len=1024", "method.max_len: 1024 positions, but model.max_position_embeddings is 512"),
    ("data.manifests=/a/manifest.json", "data.manifests: expected list.str., got '/a/manifest.json'"),
    ("data.num_workers=-1", "data.num_workers must be >= 0"),
    ("train.lr_schedule=step", "train.lr_schedule: 'step' is not one of linear, cosine, constant, wsd"),
    ("train.lr_schedule=wsd train.decay_ratio=0.95", "train.decay_ratio: 0.95 must be > 0 and leave room"),
    ("init_checkpoint=/nope:step00000002", "init_checkpoint: /nope:step00000002: no checkpoint step00000002"),
    ("data.weights=[0]", r"data.weights: \[0\]: each must be finite and >= 0, and one > 0"),
    ("model.vocab_size=1000", r"model.vocab_size: 1000, but data.manifests\[0\] .* vocabulary of 30522"),
    ("resume_changes=always", "resume_changes: 'always': the only value is allow"),
    ("data.tokenizer=/nope", "data.tokenizer: /nope is not a directory"),
])
def test_config_errors_name_the_key(wiki_shards, override, message):
    with pytest.raises(ConfigError, match=message):
        experiment(_config(wiki_shards, *override.split()))


def test_a_config_with_several_errors_reports_each(wiki_shards):
    """One run names every bad key (each message as when it is the only one), across sections."""
    overrides = ["bogus=1", "model.hidden_size=big", "method.mlm_ratio=1.5", "method.decoder_pool_size=0",
                 "data.weights=[1,2]", "train.lr=-1", "train.zero_stage=4", "checkpoint.every=0", "resume=sometimes"]
    with pytest.raises(ConfigError) as raised:
        experiment(_config(wiki_shards, *overrides))
    messages = ["bogus: unknown top-level key", "model.hidden_size: expected int, got 'big'",
                "method.mlm_ratio: must be in (0, 1]", "method.decoder_pool_size: must be >= 1", "train: need lr > 0",
                "train.zero_stage: 4 is not 0, 1, 2 or 3", "checkpoint.every and checkpoint.keep must be >= 1",
                "resume: 'sometimes': the only value is auto", "data.weights: 2 weights for 1 manifests"]
    assert len(raised.value.problems) == len(messages)
    for message, problem in zip(messages, raised.value.problems, strict=True):
        assert problem.startswith(message) and f"\n  {problem}" in str(raised.value)
    assert str(raised.value).startswith("9 errors in the config:\n")


def test_an_unknown_key_does_not_hide_the_errors_beside_it(wiki_shards):
    """An unknown key in a section, and the same section's values out of range, all reported; a key whose value
    was refused is reported once (no second message about the default that stood in for it)."""
    overrides = ["train.micro_batch_size=0", "train.bogus=1", "method.bogus=1", "method.mlm_ratio=1.5",
                 "data.bogus=1", "data.num_workers=-1", "data.manifests=/a/manifest.json", "checkpoint.bogus=1",
                 "checkpoint.every=0"]
    with pytest.raises(ConfigError) as raised:
        experiment(_config(wiki_shards, *overrides))
    problems = raised.value.problems
    for start in ("train.micro_batch_size: must be >= 1, got 0", "train.bogus: unknown key", "method.bogus: unknown",
                  "method.mlm_ratio: must be in (0, 1]", "data.bogus: unknown key", "data.num_workers must be >= 0",
                  "data.manifests: expected list", "checkpoint.bogus: unknown key",
                  "checkpoint.every and checkpoint.keep must be >= 1"):
        assert [p for p in problems if p.startswith(start)], (start, problems)
    assert len(problems) == 9, problems


def test_the_corpus_names_are_those_of_the_manifests(wiki_shards, books_shards, tmp_path):
    """The model card (from config.yaml) and MLflow's corpus_mix name what the manifests hold: each manifest's
    `source`, or the names data.corpora gives, one per manifest; a count that does not match is refused."""
    from omegaconf import OmegaConf

    from pretrieve.engine.tracking import run_tags

    exp = experiment(_config(wiki_shards))
    assert exp.data.corpora == ["wikipedia"] and OmegaConf.select(exp.raw, "data.corpora") == ["wikipedia"]
    assert run_tags(exp.method.name, exp.data.corpora, exp.model.hf_config())["corpus_mix"] == "wikipedia"
    both = f"data.manifests=[{wiki_shards / 'manifest.json'},{books_shards / 'manifest.json'}]"
    assert experiment(_config(wiki_shards, both)).data.corpora == ["wikipedia", "books"]
    assert experiment(_config(wiki_shards, both, "data.corpora=[wiki,pg19]")).data.corpora == ["wiki", "pg19"]
    with pytest.raises(ConfigError, match=r"data.corpora: 2 names \(wikipedia, books\) for 1 manifests"):
        experiment(_config(wiki_shards, "data.corpora=[wikipedia,books]"))

    damaged = tmp_path / "manifest.json"  # a copy cut short: an error naming the file, not a bare JSON error
    damaged.write_text((wiki_shards / "manifest.json").read_text()[:100])
    with pytest.raises(ConfigError, match=rf"data.manifests\[0\]: {damaged}: not a readable manifest \(.*\); re-run "):
        experiment(_config(wiki_shards, f"data.manifests=[{damaged}]"))


def test_pretrain_help_lists_the_config_sections_and_the_docs(capsys, monkeypatch, wiki_shards):
    """Each section with its keys, as the schema in pretrain_config.py has them: every key listed is one a config may set."""
    from pretrieve.cli import main
    from pretrieve.pretrain_config import PLAIN_KEYS, SECTIONS

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["pretrain", "--help"])
    help_text = capsys.readouterr().out
    assert "docs/training.md" in help_text and "docs/methods.md" in help_text
    listed = {}
    for line in help_text.split("config sections and their keys")[1].splitlines()[2:]:
        if line.startswith("  ") and not line.startswith("   "):
            section, line = line.split(maxsplit=1)
            listed[section] = []
        if line.startswith("plain keys: "):
            assert line.removeprefix("plain keys: ").split(", ") == list(PLAIN_KEYS)
        else:
            listed[section] += [key for key in line.strip().rstrip(",").split(", ") if key]
    assert list(listed) == list(SECTIONS) and "retromae" in listed["method"][0]
    for section in set(SECTIONS) - {"method"}:
        for key in listed[section]:  # accepted as a key (a wrong value is fine): no "unknown key"
            try:
                experiment(_config(wiki_shards, f"{section}.{key}=null"))
            except ConfigError as e:
                assert "unknown" not in str(e), (section, key, str(e))


def test_deepspeed_config_auto_fields(wiki_shards):
    exp = experiment(_config(wiki_shards, "train.zero_stage=2", "train.precision=bf16", "train.grad_accum=4",
                             "train.max_steps=200", "train.warmup_ratio=0.05"))
    ds = deepspeed_config(exp)
    assert ds["zero_optimization"]["stage"] == 2
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 4)
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False
    assert "scheduler" not in ds  # the engine's (train.lr_schedule)
    assert ds["optimizer"]["params"]["lr"] == 1e-4 and "auto" not in json.dumps(ds)
    assert "torch_autocast" not in ds
    # bf16-autocast: fp32 weights (no bf16 wrapper), the forward under DeepSpeed's torch autocast
    autocast = deepspeed_config(experiment(_config(wiki_shards, "train.precision=bf16-autocast")))
    assert autocast["bf16"]["enabled"] is False and autocast["fp16"]["enabled"] is False
    assert autocast["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}


def test_a_ds_configs_own_autocast_must_agree_with_the_precision(tmp_path, wiki_shards):
    own = json.loads((DS_CONFIG_DIR / "zero0.json").read_text())
    own["torch_autocast"] = {"enabled": True, "dtype": "float16"}
    (tmp_path / "mine.json").write_text(json.dumps(own))
    for precision in ("fp32", "bf16-autocast"):
        exp = experiment(_config(wiki_shards, f"train.ds_config={tmp_path / 'mine.json'}",
                                 f"train.precision={precision}"))
        with pytest.raises(ConfigError, match=r"mine.json: its \"torch_autocast\" section .* not " + precision):
            deepspeed_config(exp)


def test_a_deepspeed_scheduler_is_refused_by_name(tmp_path, wiki_shards):
    own = json.loads((DS_CONFIG_DIR / "zero0.json").read_text())
    own["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    (tmp_path / "mine.json").write_text(json.dumps(own))
    exp = experiment(_config(wiki_shards, f"train.ds_config={tmp_path / 'mine.json'}"))
    with pytest.raises(ConfigError, match=r"mine.json: has a \"scheduler\" section; the lr schedule comes from"):
        deepspeed_config(exp)


@pytest.mark.parametrize("kind", LR_SCHEDULES)
def test_lr_schedules_by_formula(kind):
    """Every step's factor against the formulas of engine/lr_schedule.py: T = 20, W = 4, wsd D = 5."""
    schedule = LRSchedule(kind, total_steps=20, warmup_steps=4, decay_steps=5 if kind == "wsd" else 0)
    after = {"linear": lambda k: (20 - k) / 16, "cosine": lambda k: (1 + math.cos(math.pi * (k - 4) / 16)) / 2,
             "constant": lambda k: 1.0, "wsd": lambda k: 1.0 if k < 15 else (20 - k) / 5}[kind]
    expected = [(k + 1) / 4 if k < 4 else after(k) for k in range(20)]
    assert [schedule.factor(k) for k in range(20)] == pytest.approx(expected, abs=1e-12)
    assert schedule.factor(0) > 0 and max(schedule.factor(k) for k in range(20)) == 1.0


def _common(wiki_shards):
    return [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
            "checkpoint.every=2", "train.log_every=1"]


def _pretrain(run_dir, wiki_shards, *overrides):
    cmd = [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-retromae.yaml"), f"run_dir={run_dir}",
           *_common(wiki_shards), *overrides]
    done = subprocess.run(cmd, env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


STAGES = (0, 1, 2, 3)
SCHEDULE = {0: "linear", 1: "cosine", 2: "constant", 3: "wsd"}  # one per stage: each resumes exactly
MID_INTERVAL = ["train.zero_stage=0", "train.max_steps=4", "train.lr_schedule=linear", "train.warmup_ratio=0.25",
                "train.decay_ratio=0.5", "tracking.enabled=false"]  # full0's settings


@pytest.fixture(scope="module")
def first_halves(tmp_path_factory, wiki_shards):
    """Per ZeRO stage, in one process: an uninterrupted 4-step run and a 4-step run stopped after step 2; and
    at ZeRO 0, logging every 3 steps, an uninterrupted run and one stopped after step 2, in the middle of its
    first interval."""
    base = tmp_path_factory.mktemp("resume")
    runs = [[f"run_dir={base / name}{stage}", f"train.zero_stage={stage}", "train.max_steps=4", *stop,
             f"train.lr_schedule={SCHEDULE[stage]}", "train.warmup_ratio=0.25", "train.decay_ratio=0.5",
             "tracking.enabled=false", *_common(wiki_shards)]
            for stage in STAGES for name, stop in (("full", []), ("split", ["train.stop_at=2"]))]
    runs += [[f"run_dir={base / name}", *MID_INTERVAL, *stop, *_common(wiki_shards), "train.log_every=3"]
             for name, stop in (("midfull", []), ("midinterval", ["train.stop_at=2"]))]
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"),
                           str(CONFIGS / "tiny-retromae.yaml"), json.dumps(runs)], env=pretrain_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return base


@pytest.mark.parametrize("stage", STAGES)
def test_resume_reproduces_the_uninterrupted_run(first_halves, wiki_shards, stage):
    """fp32 on CPU, world 1: a fresh process resumes the run stopped at step 2 and goes to step 4; every
    logged loss and lr, and the exported weights, equal the uninterrupted run's bit for bit (dropout on: the
    RNG states travel in the checkpoint). The lr of every step is its schedule's formula (one per stage)."""
    full_dir, split_dir = first_halves / f"full{stage}", first_halves / f"split{stage}"
    assert not (split_dir / "export").exists()  # stopped at train.stop_at: unfinished, nothing exported
    zero, schedule = f"train.zero_stage={stage}", f"train.lr_schedule={SCHEDULE[stage]}"
    full = [json.loads(line) for line in (full_dir / "metrics.jsonl").read_text().splitlines()]
    split = _pretrain(split_dir, wiki_shards, zero, schedule, "train.warmup_ratio=0.25", "train.decay_ratio=0.5",
                      "train.max_steps=4", "resume=auto", "tracking.enabled=false")
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    assert [(r["loss"], r["lr"]) for r in split] == [(r["loss"], r["lr"]) for r in full]
    formula = LRSchedule(SCHEDULE[stage], total_steps=4, warmup_steps=1, decay_steps=2)
    assert [r["lr"] for r in full] == pytest.approx([1e-4 * formula.factor(k) for k in range(4)], rel=1e-12)
    assert (split_dir / "checkpoints" / "latest").read_text() == "step00000004"
    kept = sorted(p.name for p in (split_dir / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step00000002", "step00000004"]  # checkpoint.keep = 2
    for name in ("model.safetensors", "pretrieve_head.safetensors"):  # consolidated from the final checkpoint
        ours, reference = load_file(split_dir / "export" / name), load_file(full_dir / "export" / name)
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    if stage == 1:  # `pretrieve export` on the command line (ZeRO 1 keeps the frozen pooler out of its partitions)
        out = first_halves / "exported"
        env = {k: v for k, v in pretrain_env().items() if k != "DS_ACCELERATOR"}  # as a user runs it
        done = subprocess.run([sys.executable, "-m", "pretrieve", "export", str(split_dir), str(out)], check=True,
                              capture_output=True, text=True, env=env)
        # no accelerator looked for (DeepSpeed's warning that it found none) and no progress bar
        assert "accelerator" not in done.stderr and "Writing model shards" not in done.stderr, done.stderr
        # what it wrote: from where, the format, each file, the pooling
        assert f"\n{out}: retromae from {split_dir}, checkpoint step00000004\n" in f"\n{done.stdout}", done.stdout
        assert "format: pretrieve-export/1" in done.stdout and "model.safetensors (" in done.stdout
        assert "pooling: cls, not normalised, texts cut at 64 tokens" in done.stdout
        ours, reference = load_file(out / "model.safetensors"), load_file(full_dir / "export" / "model.safetensors")
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    if stage == 0:  # a run directory with checkpoints is never overwritten by accident
        with pytest.raises(AssertionError, match="already holds checkpoints; pass resume=auto"):
            _pretrain(split_dir, wiki_shards, zero, "train.max_steps=6")


def test_a_resume_in_the_middle_of_a_logging_interval_logs_the_uninterrupted_records(first_halves, wiki_shards):
    """Logging every 3 steps, stopped after step 2 and resumed: the checkpoint carried the window's partial sums,
    so the records of steps 3 and 4 equal the uninterrupted run's (midfull), every field but the timings, bit for
    bit, but step 3's gradient norm and loss terms (one float32 rounding: 8e-8 and 3e-8). From equal weights, this
    fresh process's first step rounds some values otherwise in their last bit than the process that ran steps
    1-2: CPU float32 kernels round by the process's history (two identical first halves, run 3rd and 10th in one
    process, end step 2 with weights that differ in the last bit). Step 3's window is also the mean of full0's
    steps 1-3, up to those roundings (the steps differ by 1e-3)."""
    run_dir = first_halves / "midinterval"
    assert not (run_dir / "metrics.jsonl").exists()  # stop_at=2 is no log step: the window went into the checkpoint
    resumed = _pretrain(run_dir, wiki_shards, *MID_INTERVAL, "resume=auto", "train.log_every=3")
    uninterrupted = [json.loads(line) for line in (first_halves / "midfull" / "metrics.jsonl").read_text().splitlines()]
    timings = {"tokens_per_s", "samples_per_s", "tflops_per_device", "mfu"}
    assert [r["step"] for r in resumed] == [3, 4]
    rounded = {"grad_norm", "loss", "mlm", "dec"}  # step 3's: within one float32 rounding
    assert {k: v for k, v in resumed[0].items() if k not in timings | rounded} == {
        k: v for k, v in uninterrupted[0].items() if k not in timings | rounded}
    assert {k: v for k, v in resumed[1].items() if k not in timings} == {
        k: v for k, v in uninterrupted[1].items() if k not in timings}
    for key in rounded:
        assert resumed[0][key] == pytest.approx(uninterrupted[0][key], rel=1e-6), key
    every = [json.loads(line) for line in (first_halves / "full0" / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "mlm", "dec"):
        assert resumed[0][key] == pytest.approx((every[0][key] + every[1][key] + every[2][key]) / 3, rel=1e-6)


def test_validation_loss_changes_nothing_and_resumes(first_halves, tmp_path, wiki_shards, books_shards):
    """Held-out loss on the books shards every 2 steps: the training records equal the same run's without it
    (full0 of the resume fixture) bit for bit, and a run stopped at step 2 and resumed logs the same
    validation numbers as the uninterrupted one."""
    same_as_full0 = ["train.zero_stage=0", "train.max_steps=4", "train.lr_schedule=linear", "train.warmup_ratio=0.25",
                     "train.decay_ratio=0.5", "tracking.enabled=false", *_common(wiki_shards),
                     f"data.validation=[{books_shards / 'manifest.json'}]", "train.eval_every=2",
                     "data.validation_batches=2"]
    runs = [[f"run_dir={tmp_path / 'full'}", *same_as_full0],
            [f"run_dir={tmp_path / 'split'}", *same_as_full0, "train.stop_at=2"]]
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"),
                           str(CONFIGS / "tiny-retromae.yaml"), json.dumps(runs)], env=pretrain_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    full = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    without = [json.loads(line) for line in (first_halves / "full0" / "metrics.jsonl").read_text().splitlines()]
    timing = {"tokens_per_s", "samples_per_s", "tflops_per_device", "mfu"}  # all else must be equal
    strip = lambda records: [{k: v for k, v in r.items() if k not in timing} for r in records]  # noqa: E731
    assert strip(r for r in full if "loss" in r) == strip(without)
    validation = [r for r in full if "val_loss" in r]
    assert [r["step"] for r in validation] == [2, 4] and set(validation[0]) == {"step", "val_loss", "val_mlm",
                                                                                 "val_dec"}
    assert validation[0]["val_loss"] != validation[1]["val_loss"]
    resumed = _pretrain(tmp_path / "split", wiki_shards, *same_as_full0[1:], "resume=auto")
    assert [r for r in resumed if "val_loss" in r] == validation


def test_validation_batches_are_fixed(tiny_head_and_books):
    """Two evaluations of the same weights are equal and draw no random numbers (training is untouched)."""
    head, validation = tiny_head_and_books
    rng = torch.get_rng_state()
    first = validation.evaluate(head, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng) and head.training
    assert validation.evaluate(head, torch.device("cpu")) == first and set(first) == {"val_loss", "val_mlm", "val_dec"}


@pytest.fixture
def tiny_head_and_books(books_shards):
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.engine.validation import Validation
    from pretrieve.pretrain_config import method_options, model_options

    config = load_config(CONFIGS / "tiny-retromae.yaml", ["method.max_len=64"])
    spec, options = method_options(config)
    head = spec.build(options, model_options(config), seed=0)
    collate = spec.collator.from_options(options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))
    return head, Validation.build([str(books_shards / "manifest.json")], collate, batch_size=4, num_batches=2)


def test_wsd_branch_continues_exactly(tmp_path, wiki_shards):
    """OLMo's ladder practice: one stable wsd run S, checkpointed at step 3; a branch B (init_checkpoint=S:step3)
    with a longer schedule of its own trains steps 4-6 exactly as an uninterrupted run U with B's schedule does:
    weights, optimizer, stream and RNG come from S, the schedule from B's config, at S's step."""
    runs = {"S": ["train.max_steps=4", "train.decay_ratio=0.25", "checkpoint.every=3"],
            "U": ["train.max_steps=6", "train.decay_ratio=0.5"],
            "B": ["train.max_steps=6", "train.decay_ratio=0.5", f"init_checkpoint={tmp_path / 'S'}:step00000003"]}
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"),
                           str(CONFIGS / "tiny-retromae.yaml"),
                           json.dumps([[f"run_dir={tmp_path / name}", "tracking.enabled=false", *_common(wiki_shards),
                                        "train.lr_schedule=wsd", "train.warmup_ratio=0", *overrides]
                                       for name, overrides in runs.items()])],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    s, u, b = ([json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in runs)
    assert [(r["loss"], r["lr"]) for r in s[:3]] == [(r["loss"], r["lr"]) for r in u[:3]]  # stable: equal so far
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [(r["loss"], r["lr"]) for r in b] == [(r["loss"], r["lr"]) for r in u[3:]]
    assert [r["lr"] for r in b] == pytest.approx([1e-4, 2e-4 / 3, 1e-4 / 3], rel=1e-12)  # (6 - k) / 3, not S's 0


def test_resume_at_world_size_two_and_then_one(tmp_path, wiki_shards):
    """Two gloo ranks (torchrun), ZeRO 2: stop at step 2, resume to 4; the logged losses, averaged over both
    ranks, equal the uninterrupted run's. The step-2 checkpoint, converted by `pretrieve universal` and rewritten
    with the parameter names of a pretrieve from before the backbone interface, also resumes on one rank
    (grad_accum 2 keeps the global batch at 16): its folders are renamed, and the schedule, the optimizer's step
    count and the sample count continue."""
    def run(run_dir, *overrides, ranks=2):
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
        cmd = [sys.executable, *(launcher if ranks == 2 else []), "-m", "pretrieve", "pretrain",
               str(CONFIGS / "tiny-retromae.yaml"), f"run_dir={run_dir}",
               f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
               "checkpoint.every=2", "train.log_every=1", "train.zero_stage=2", "tracking.enabled=false",
               "train.global_batch_size=16", *overrides]
        done = subprocess.run(cmd, env=pretrain_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # one result line in all, whole: rank 0 prints it (two ranks' prints once interleaved as `{..}{..}`)
        assert len([line for line in done.stdout.splitlines() if line.startswith("{")]) == 1, done.stdout
        assert "built successfully" not in done.stdout  # DeepSpeed's notice of each load of its prebuilt CPU op
        return records, result_line(done.stdout), done.stderr

    full, result, _ = run(tmp_path / "full", "train.max_steps=4")
    assert (result["step"], result["samples"]) == (4, 64)
    run(tmp_path / "split", "train.max_steps=4", "train.stop_at=2")
    shutil.copytree(tmp_path / "split", tmp_path / "elastic")
    split, _, log = run(tmp_path / "split", "train.max_steps=4", "resume=auto")
    # said once, by rank 0: 2 steps of 16 samples in all
    assert log.count("resuming from step00000002 (data position: epoch 0, 32 of its 648 samples read)") == 1, log
    assert [(r["step"], r["loss"], r["lr"]) for r in split] == [(r["step"], r["loss"], r["lr"]) for r in full]

    subprocess.run([sys.executable, "-m", "pretrieve", "universal", str(tmp_path / "elastic")], env=pretrain_env(),
                   check=True, capture_output=True)
    assert (tmp_path / "elastic" / "checkpoints" / "latest").read_text() == "step00000002-universal"
    # written as pretrieve wrote universal checkpoints before the backbone interface: renamed on the way in
    renamed = _as_old_layout(tmp_path / "elastic" / "checkpoints" / "step00000002-universal", "retromae")
    assert "zero/encoder.bert.embeddings.word_embeddings.weight" in renamed and "zero/decoder.query.weight" in renamed
    elastic, result, log = run(tmp_path / "elastic", "train.max_steps=4", "train.grad_accum=2", "resume=auto",
                               ranks=1)
    assert f"step00000002-universal: renamed {len(renamed)} parameter folders of an older layout" in log
    assert "resuming from step00000002-universal (data position: epoch 0, 32 of its 648 samples read)" in log
    assert [r["step"] for r in elastic] == [1, 2, 3, 4] and (result["step"], result["samples"]) == (4, 64)
    assert [r["lr"] for r in elastic] == [r["lr"] for r in full]
    optim = torch.load(tmp_path / "elastic" / "checkpoints" / "step00000004" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       map_location="cpu", weights_only=False)["optimizer_state_dict"]
    assert int(optim["base_optimizer_state"]["state"][0]["step"]) == 4


def _as_old_layout(tag_dir: Path, method: str) -> list[str]:
    """Rewrites universal checkpoint `tag_dir` with the parameter names of a pretrieve from before the backbone
    interface (its zero/<name>/ folders and its model states); returns the new paths of the renamed folders."""
    renamed = []
    for folder in sorted(p for p in (tag_dir / "zero").iterdir() if p.is_dir()):
        old = old_parameter_name(folder.name, method)
        if old != folder.name:
            folder.rename(tag_dir / "zero" / old)
            renamed.append(f"zero/{old}")
    for states in tag_dir.glob("mp_rank_*_model_states.pt"):
        saved = torch.load(states, map_location="cpu", weights_only=False)
        saved["module"] = {old_parameter_name(key, method): value for key, value in saved["module"].items()}
        torch.save(saved, states)
    return renamed


def test_activation_checkpointing_recomputes_encoder_layers():
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    method = get_method("mlm")
    head = method.build(method.options_from({}), ModelOptions(hidden_size=64, num_layers=2, num_heads=2,
                                                              intermediate_size=256))
    with warnings.catch_warnings():  # the supported API: no deprecation (gradient_checkpointing_enable, gone in v6)
        warnings.simplefilter("error", FutureWarning)
        head.encoder.enable_activation_checkpointing()
    calls = []
    head.encoder.model.encoder.layer[0].intermediate.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(1000, 2000, (2, 16))
    labels = torch.full((2, 16), -100)
    labels[:, 3] = 5
    head.train()({"input_ids": ids, "attention_mask": torch.ones_like(ids), "mlm_labels": labels})["loss"].backward()
    assert len(calls) == 2  # forward, and again in backward


def test_activation_checkpointing_changes_memory_not_numbers(tmp_path, wiki_shards):
    plain = _pretrain(tmp_path / "plain", wiki_shards, "train.max_steps=3", "tracking.enabled=false")
    recomputed = _pretrain(tmp_path / "recomputed", wiki_shards, "train.max_steps=3", "tracking.enabled=false",
                           "train.activation_checkpointing=true")
    assert [r["loss"] for r in recomputed] == pytest.approx([r["loss"] for r in plain], rel=1e-6)
    assert [r["grad_norm"] for r in recomputed] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-5)


def test_fp16_on_cpu_is_refused_by_name(tmp_path, wiki_shards, capsys):
    from pretrieve.cli import main as cli

    assert cli(["pretrain", str(CONFIGS / "tiny-mlm.yaml"), f"run_dir={tmp_path / 'fp16'}",
                f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "train.precision=fp16"]) == 1
    assert "train.precision: fp16 needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "fp16").exists()  # refused before anything was written


def test_only_deepspeeds_own_cpu_adam_is_prebuilt_for_an_offloaded_optimizer():
    from pretrieve.engine.preemption import _jit_ops

    offload = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    # torch's AdamW (the ds_configs' "torch_adam": true) steps the CPU copy: no C++ op to compile (100+ s here)
    assert "CPUAdamBuilder" not in _jit_ops({**offload, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}})
    assert "CPUAdamBuilder" in _jit_ops({**offload, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    assert "CPUAdamBuilder" not in _jit_ops(offload)  # no section: a client optimizer steps (train.optimizer)
    assert "CPUAdamBuilder" not in _jit_ops({"optimizer": {"type": "AdamW", "params": {}}})


def test_cpu_optimizer_offload_gives_the_same_losses(tmp_path, wiki_shards):
    common = ["train.max_steps=3", "tracking.enabled=false", "train.zero_stage=2"]
    plain = _pretrain(tmp_path / "plain", wiki_shards, *common)
    offloaded = _pretrain(tmp_path / "offloaded", wiki_shards, *common, "train.offload_optimizer=true")
    assert [r["loss"] for r in offloaded] == pytest.approx([r["loss"] for r in plain], rel=1e-6)
    states = torch.load(tmp_path / "offloaded" / "checkpoints" / "step00000003" / "mp_rank_00_model_states.pt",
                        map_location="cpu", weights_only=False)
    assert states["ds_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}  # what DeepSpeed ran
