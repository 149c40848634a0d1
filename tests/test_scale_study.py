"""`pretrieve scale plan` and `scale run`: parameter counts and FLOPs of the real models, the grid, bad studies, a
study run end to end (pre-training, validation loss, evaluation, MLflow parent and child runs, resume, re-run)."""

import json
from itertools import islice
from pathlib import Path

import pytest
import yaml

from pretrieve.cli import main as cli
from pretrieve.config import load_config
from pretrieve.pretrain_config import experiment
from pretrieve.scale.plan import StudyError, plan

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def write_study(tmp_path, wiki_shards, **changes) -> Path:
    study = {"name": "grid", "methods": ["mlm", "retromae"], "config": str(CONFIGS / "tiny-{method}.yaml"),
             "sizes": {"h32": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 128},
                       "h64": {"hidden_size": 64, "num_layers": 1, "num_heads": 4, "intermediate_size": 256}},
             "budgets": {"tokens": [2048, 8192]}, "seeds": [0],
             "train": {"batch_size": 4, "seq_len": 64, "lr": 1e-3, "base_width": 64,
                       "overrides": ["tracking.enabled=false", "train.log_every=1"]},
             "data": {"manifests": [str(wiki_shards / "manifest.json")]}, "run": {"out": str(tmp_path / "study")}}
    study.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def test_plan_counts_parameters_and_flops_of_the_real_models(tmp_path, wiki_shards, vocab):
    from pretrieve.data.stream import ShardStream
    from pretrieve.engine.flops import train_flops
    from pretrieve.models.encoder import Encoder

    study, points = plan(write_study(tmp_path, wiki_shards))
    assert [(p.method, p.size, p.steps) for p in points] == [
        (m, s, steps) for m in ("mlm", "retromae") for s in ("h32", "h64") for steps in (8, 32)]
    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=1)), 4))
    for point in points:
        exp = experiment(load_config(CONFIGS / f"tiny-{point.method}.yaml", point.overrides))
        bert = Encoder(exp.model.hf_config()).model
        counted = {name: p.numel() for name, p in bert.named_parameters()}
        assert point.N == sum(n for name, n in counted.items() if name.startswith("encoder."))
        assert point.N_total == sum(n for name, n in counted.items() if not name.startswith("pooler."))
        assert point.D == point.steps * 4 * 64 and exp.train.max_steps == point.steps
        batch = exp.method.collator.from_options(exp.options, vocab, seed=0)(samples)
        assert point.C == train_flops(exp.method, exp.options, exp.model.hf_config(), batch) * point.steps
        assert point.lr == pytest.approx(1e-3 * 64 / exp.model.hidden_size)  # the inverse-width rule
        assert exp.run_dir == tmp_path / "study" / "points" / point.id
    retromae, mlm = (next(p for p in points if p.method == m and p.size == "h64" and p.steps == 8)
                     for m in ("retromae", "mlm"))
    assert retromae.C > mlm.C and retromae.N == mlm.N  # the decoder costs compute, not retriever parameters


def test_plan_counts_a_modernbert_study_on_its_own_model(tmp_path, wiki_shards):
    """model.backbone in the study's overrides: N is ModernBERT's layers and final norm, N_total adds its
    embeddings; FLOPs count its GeGLU blocks (engine/flops.py, checked against DeepSpeed in test_flops)."""
    from pretrieve.models.encoder import Encoder

    overrides = ["tracking.enabled=false", "model.backbone=modernbert"]
    study, points = plan(write_study(tmp_path, wiki_shards, methods=["mlm"], budgets={"tokens": [2048]},
                                     train={"batch_size": 4, "seq_len": 64, "overrides": overrides}))
    for point in points:
        exp = experiment(load_config(CONFIGS / "tiny-mlm.yaml", point.overrides))
        model = Encoder(exp.model.hf_config()).model
        assert model.config.model_type == "modernbert"
        counted = {name: p.numel() for name, p in model.named_parameters()}
        assert point.N == sum(n for name, n in counted.items() if not name.startswith("embeddings."))
        assert point.N_total == sum(counted.values())


def test_plan_command_prints_the_grid_and_writes_the_run_list(tmp_path, wiki_shards, capsys):
    assert cli(["scale", "plan", str(write_study(tmp_path, wiki_shards)), "--flops-per-second", "1e9"]) == 0
    printed = capsys.readouterr().out
    listed = json.loads((tmp_path / "study" / "plan.json").read_text())
    assert listed["study"] == "grid" and len(listed["points"]) == 8
    first = listed["points"][0]
    assert f"| {first['id']} | mlm | h32 | {first['N']:,} | {first['N_total']:,} | 2,048 | 8 |" in printed
    total = sum(p["C"] for p in listed["points"])
    assert f"8 points, {total:.3g} FLOPs in all: {total / 1e9 / 3600:.3g} device-hours at 1e+09 FLOP/s" in printed


@pytest.mark.parametrize("change,message", [
    ({"methods": ["mlm", "retro"]}, r"methods\[1\]: 'retro' is not a registered method"),
    ({"sizes": {"odd": {"hidden_size": 30, "num_layers": 1, "num_heads": 4, "intermediate_size": 64}}},
     "sizes.odd: num_heads 4 does not divide hidden_size 30"),
    ({"budgets": {"tokens": [100]}},
     r"budgets.tokens\[0\]: 100 gives 100 tokens, less than one step \(4 x grad_accum 1 x world 1 x 64 = 256"),
    ({"budgets": {"flops": [1e12]}}, "budgets: give one of tokens"),
    ({"budgets": {"tokens": ["abc"]}}, r"budgets.tokens\[0\]: a positive number is needed, got 'abc'"),
    ({"budgets": {"tokens": [2048, -1.0]}}, r"budgets.tokens\[1\]: a positive number is needed, got -1.0"),
    ({"budgets": {"tokens_per_parameter": [float("inf")]}}, r"budgets.tokens_per_parameter\[0\]: a positive number"),
    ({"budgets": {"tokens": []}}, r"budgets.tokens: a non-empty list of numbers is needed, got \[\]"),
    ({"budgets": {"tokens": 2048}}, r"budgets.tokens: a non-empty list of numbers is needed, got 2048"),
    ({"train": {"batch_size": 4}}, "train.batch_size .>= 1. and train.seq_len"),
    ({"config": str(CONFIGS / "tiny-{method}.yaml"), "train": {"batch_size": 4, "seq_len": 64,
                                                             "overrides": ["train.lr_schedule=step"]}},
     "point mlm-h32-D2.05e03-s0: train.lr_schedule: 'step'"),
])
def test_bad_studies_name_the_key(tmp_path, wiki_shards, change, message):
    with pytest.raises(StudyError, match=message):
        plan(write_study(tmp_path, wiki_shards, **change))


def test_a_budget_past_any_corpus_is_planned_with_a_warning(tmp_path, wiki_shards, capsys):
    path = write_study(tmp_path, wiki_shards, methods=["mlm"], budgets={"tokens": [2048, 1e30]})
    _, points = plan(path)
    assert len(points) == 4
    assert f"pretrieve: warning: {path}: budgets.tokens[1]: 1e+30 is more than 1e+13, more tokens than the " \
           "largest pre-training corpora hold; a typo?" in capsys.readouterr().err
    plan(write_study(tmp_path, wiki_shards, methods=["mlm"], budgets={"tokens": [2048, 1e12]}))
    assert "warning" not in capsys.readouterr().err


@pytest.mark.integration
def test_scale_run_pretrains_evaluates_and_resumes(tmp_path, wiki_shards, books_shards):
    """2 sizes x 2 budgets of mlm, end to end: one point stopped half-way beforehand continues, one that fails
    stops nothing else and runs once fixed; every point is a child run of the study tagged N, D, C, ... with its
    validation losses, its zero-shot evaluation nested under it; the fit reader finds them all; a re-run does
    nothing again."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from support import SAMPLES, pretrain_env
    from pretrieve.orchestrate.scale_run import pretrain_args, run_study, study_parent
    from pretrieve.scale.points import read_points_mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = write_study(tmp_path, wiki_shards, methods=["mlm"], budgets={"tokens": [512, 1024]},
                       tracking={"uri": uri, "experiment": "scale"}, run={"out": str(tmp_path / "study"), "workers": 2},
                       data={"manifests": [str(wiki_shards / "manifest.json")],
                             "validation": [str(books_shards / "manifest.json")]},
                       evaluation={"datasets": [{"name": "sample", "beir": str(SAMPLES / "beir" / "scifact-sample"),
                                                 "split": "test"}], "eval": {"max_length": 64, "batch_size": 32}})
    study, points = plan(path)
    stopped = points[1]  # 4 steps, stopped after 2 as a preempted job would be
    done = subprocess.run([sys.executable, "-m", "pretrieve", *pretrain_args(study, stopped, study_parent(study)),
                           "train.stop_at=2"], env=pretrain_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    first_run = json.loads((tmp_path / "study" / "points" / stopped.id / "run.json").read_text())["run_id"]

    broken = points[2]  # its run directory cannot be written: the point fails, the others go on
    (tmp_path / "study" / "points" / broken.id).mkdir(parents=True)
    (tmp_path / "study" / "points" / broken.id / "checkpoints").write_text("not a directory")

    result = run_study(path, progress=False)
    assert list(result["failed"]) == [broken.id] and "exit 1" in result["failed"][broken.id]
    assert (result["points"], result["pretrained"], result["skipped"]) == (4, 3, 0)
    assert len(result["evaluation"]["logged"]) == 3
    (tmp_path / "study" / "points" / broken.id / "checkpoints").unlink()
    result = run_study(path, progress=False)
    assert result["failed"] == {} and (result["pretrained"], result["skipped"]) == (4, 3)
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(result["parent_run_id"])
    assert parent.data.tags["pretrieve.study"] == "grid" and parent.data.tags["pretrieve.scale"] == "study"
    experiment = parent.info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(p.id for p in points)
    for point in points:
        run = next(r for r in children if r.info.run_name == point.id)
        tags = run.data.tags
        assert (int(tags["N"]), int(tags["D"]), float(tags["C"]), tags["size"]) == (point.N, point.D, point.C,
                                                                                      point.size)
        assert run.info.status == "FINISHED" and "val_loss" in run.data.metrics
        assert run.data.metrics["val_loss_best"] <= run.data.metrics["val_loss_final"] == run.data.metrics["val_loss"]
        evals = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
        assert len(evals) == 1 and "ndcg_at_10" in evals[0].data.metrics
    resumed = json.loads((tmp_path / "study" / "points" / stopped.id / "run.json").read_text())["run_id"]
    steps = [json.loads(line)["step"] for line in
             (tmp_path / "study" / "points" / stopped.id / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert resumed == first_run and steps == [1, 2, 3, 4]
    by_method, skipped = read_points_mlflow(uri, parent.info.run_id, "ndcg@10")
    assert len(by_method["mlm"].loss) == 4 and skipped == {}

    again = run_study(path, progress=False)
    assert (again["skipped"], again["failed"], again["evaluation"]["logged"]) == (4, {}, [])
    assert len(client.search_runs([experiment], "")) == 1 + 4 + 4


def test_scale_run_slurm_lists_the_pending_points(tmp_path, wiki_shards):
    import shlex

    from pretrieve.orchestrate.scale_run import run_study

    path = write_study(tmp_path, wiki_shards, tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    result = run_study(path, slurm_jobs=str(tmp_path / "jobs"), progress=False)
    lines = [shlex.split(line) for line in (tmp_path / "jobs").read_text().splitlines()]
    assert result["pending_for_slurm"] == len(lines) == 8 and all(line[0] == "pretrain" for line in lines)
    assert all("resume=auto" in line and f"tracking.parent_run_id={result['parent_run_id']}" in line
               for line in lines)
    assert not (tmp_path / "study" / "points").exists()  # nothing ran here


def test_plan_tokens_and_flops_count_accumulation_and_ranks(tmp_path, wiki_shards):
    """grad_accum 4 (a train override) on 2 ranks: an optimizer step takes 4 x 4 x 2 sequences, so the same budgets
    take 8 times fewer steps, and D and C (the micro-batch's FLOPs x 4 x 2 per step) stay those of the budgets.
    Each point pins its global batch: started on one rank, its config check refuses it."""
    from pretrieve.config import ConfigError

    _, base = plan(write_study(tmp_path, wiki_shards))
    study = write_study(tmp_path, wiki_shards,
                        train={"batch_size": 4, "seq_len": 64, "lr": 1e-3, "base_width": 64, "world_size": 2,
                               "overrides": ["tracking.enabled=false", "train.grad_accum=4"]})
    _, accumulated = plan(study)
    assert [p.steps for p in base] == [8, 32] * 4 and [p.steps for p in accumulated] == [1, 4] * 4
    for one, many in zip(base, accumulated):
        assert many.D == one.D == many.steps * 4 * 4 * 2 * 64 and many.tokens_per_step == 2048
        assert many.C == pytest.approx(one.C) and many.id == one.id
        exp = experiment(load_config(CONFIGS / f"tiny-{many.method}.yaml", many.overrides), world_size=2)
        assert (exp.train.grad_accum, exp.train.global_batch_size, exp.train.max_steps) == (4, 32, many.steps)
        with pytest.raises(ConfigError, match=r"global_batch_size: 32 != micro_batch_size 4 x grad_accum 4 x world"):
            experiment(load_config(CONFIGS / f"tiny-{many.method}.yaml", many.overrides), world_size=1)


def test_plan_prices_a_device_and_warns_when_a_micro_batch_will_not_fit(tmp_path, wiki_shards, capsys, vocab):
    """A BERT-large-shaped point, 64 x 512 tokens a micro-batch in fp32: about 117 GB on one device by the
    documented estimate (checked here against the formula), too much for an H100 (the warning names both ways
    out), not for an H200; the device-hours use the device's fp32 peak x --mfu."""
    from pretrieve.data.stream import ShardStream
    from pretrieve.scale.memory import GB, layer_activations, needed

    large = {"large": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "intermediate_size": 4096}}
    path = write_study(tmp_path, wiki_shards, methods=["mlm"], sizes=large, budgets={"tokens": [1e6]},
                       train={"batch_size": 64, "seq_len": 512, "overrides": ["tracking.enabled=false"]})
    assert cli(["scale", "plan", str(path), "--device", "h100", "--mfu", "0.5"]) == 0
    printed = capsys.readouterr()
    _, (point,) = plan(path)
    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=1)), 64))
    exp = experiment(load_config(CONFIGS / "tiny-mlm.yaml", point.overrides))
    length = exp.method.collator.from_options(exp.options, vocab, seed=0)(samples)["input_ids"].shape[1]
    assert point.memory["per_sequence"] == 24 * layer_activations(1, length, 1024, 4096, 16, 4)
    assert point.memory["per_sequence_checkpointed"] == 24 * 4 * length * 1024 + layer_activations(
        1, length, 1024, 4096, 16, 4)
    assert 100 < needed(point.memory, 64, False) / GB < 130 and needed(point.memory, 64, True) / GB < 72
    assert f"{point.C / (0.5 * 67e12) / 3600:.3g} device-hours at 50% MFU of h100 (6.7e+13 FLOP/s at fp32)" \
        in printed.out
    assert f"warning: point {point.id}: about {needed(point.memory, 64, False) / GB:.1f} GB per device" in printed.err
    assert "over the 72.0 GB usable of h100 (80 GB): add train.activation_checkpointing=true" in printed.err
    assert "or set train.batch_size: 32 with train.grad_accum=2 (the same tokens per step" in printed.err
    assert cli(["scale", "plan", str(path), "--device", "h200"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_interrupted_scale_run_saves_its_point_and_starts_no_other(tmp_path, wiki_shards, sigint_at_default):
    """Ctrl-C to the study's process group, as a terminal sends it, while its first point trains: the point (in
    a session of its own) gets SIGINT once, from the study, saves a checkpoint at the step it came and says so in
    its log; the second point does not start; the study says so in one line and ends by SIGINT."""
    import subprocess
    import sys

    from support import ctrl_c_when

    path = write_study(tmp_path, wiki_shards, methods=["mlm"], budgets={"tokens": [65536, 131072]},
                       sizes={"h32": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}},
                       run={"out": str(tmp_path / "study"), "workers": 1})
    proc = subprocess.Popen([sys.executable, "-m", "pretrieve", "scale", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    points = tmp_path / "study" / "points"
    training = lambda: any(p.stat().st_size for p in points.glob("*/metrics.jsonl"))  # a point has logged a step
    assert ctrl_c_when(proc, training) == (
        "pretrieve scale: interrupted: 2 of 2 points not pre-trained yet (the next run resumes each from its latest "
        "checkpoint); run the same command again to continue")
    [started] = [p for p in points.iterdir() if (p / "pretrain.log").exists()]
    said = (started / "pretrain.log").read_text().splitlines()[-1]
    latest = (started / "checkpoints" / "latest").read_text()
    assert said == f"pretrieve pretrain: interrupted: saved step {int(latest[4:])} to {started / 'checkpoints' / latest}"\
        "; resume with resume=auto", said
    assert 0 < int(latest[4:]) < 256  # at the step the signal came, not the end: 65,536 tokens are 256 steps
