"""A speed switch added in one file, step by step as docs/training.md "Add a speed switch" shows it (the walk-through's
code blocks are this file's code): `train.checkpoint_every`, activation checkpointing kept on every Nth checkpointed
layer only (between recomputing every layer and none). Registered in the table of speed switches
(pretrieve/models/speed_switches.py), it is checked with the others, the engine applies it in its place of the one
order, for pre-training and fine-tuning alike, and the speed ladder climbs its rung; it is unregistered afterwards.

    python tests/test_toy_switch.py pretrain|finetune CONFIG KEY=VALUE...   # trains with the toy switch at 2
"""

import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import pytest
from transformers.modeling_layers import GradientCheckpointingLayer

from pretrieve.config import TrainOptions
from pretrieve.models.speed_switches import Rung, Switch, register_switch

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent


# 1. Option: a field of TrainOptions (here a subclass of it, so that the test changes no package file).
@dataclass
class ToyTrainOptions(TrainOptions):
    checkpoint_every: int | None = None  # recompute every Nth checkpointed layer only (None: each)


# 2. Pass: what the switch does to the module the engine trains (a pre-training head, a fine-tuning model).
def checkpoint_every(module, every):
    """Activation checkpointing kept on the first of every `every` checkpointed layers; the others keep their
    activations."""
    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0
    return layers


# 3. Check: the problems of a setting, each naming its key.
def checkpoint_every_problems(every, settings):
    if every is not None and every < 1:
        yield f"train.checkpoint_every: must be >= 1, got {every}"
    elif every is not None and not settings.train.activation_checkpointing:
        yield "train.checkpoint_every: picks among the layers train.activation_checkpointing recomputes: set it true"


# 4. Row: the key, its check, its pass, its place in the one order (after the pass it needs) and its ladder rung.
def register():
    return register_switch(Switch("train.checkpoint_every", checkpoint_every_problems, checkpoint_every,
                                  rung=Rung("checkpoint-half", ("train.activation_checkpointing=true",
                                                                "train.checkpoint_every=2"))),
                           after="train.activation_checkpointing")


@pytest.fixture
def toy_switch():
    from pretrieve.models.speed_switches import unregister_switch

    yield register()
    unregister_switch("train.checkpoint_every")  # the other tests see the built-in switches only


def _problems(**train) -> list[str]:
    from pretrieve.models.speed_switches import check_switches
    from pretrieve.utils.options import Problems

    problems = Problems()
    check_switches(problems, train=ToyTrainOptions(**train))
    return problems.messages


def test_the_toy_switch_is_checked_by_key_in_its_place(toy_switch):
    assert _problems(checkpoint_every=0) == ["train.checkpoint_every: must be >= 1, got 0"]
    assert _problems(checkpoint_every=2, activation_checkpointing=True) == []
    # beside a built-in switch's problem, in the table's order
    assert _problems(checkpoint_every=2, low_precision_norm=True) == [
        "train.checkpoint_every: picks among the layers train.activation_checkpointing recomputes: set it true",
        ("train.low_precision_norm: changes only a train.precision bf16-autocast run (its norms run in fp32 there), "
         "not fp32: set train.precision=bf16-autocast or remove it")]


def test_the_toy_switch_is_applied_after_the_pass_it_needs(toy_switch):
    """Activation checkpointing turns every layer's on, then the toy switch turns every second one off (had it run
    first, it would have found none on); the norms are swapped and the layers compiled after it."""
    from support import tiny_head

    from pretrieve.models.low_precision_norm import LowPrecisionLayerNorm
    from pretrieve.models.speed_switches import Settings, apply_switches

    _, _, head = tiny_head("retromae", "model.num_layers=4")
    train = ToyTrainOptions(activation_checkpointing=True, checkpoint_every=2, precision="bf16-autocast",
                            low_precision_norm=True, compile=True)
    assert apply_switches(head, Settings(train=train)) == [
        "train.activation_checkpointing", "train.checkpoint_every", "train.low_precision_norm", "train.compile"]
    layers = head.encoder.model.encoder.layer
    assert [layer.gradient_checkpointing for layer in layers] == [True, False, True, False]
    assert not head.decoder.layers[0].gradient_checkpointing  # the decoder was never checkpointed
    assert all(isinstance(layer.output.LayerNorm, LowPrecisionLayerNorm) for layer in layers)
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert apply_switches(head, Settings(train=ToyTrainOptions(checkpoint_every=None))) == []  # off: no pass


def test_the_ladder_climbs_the_toy_rung_in_its_place():
    from pretrieve.models.speed_switches import unregister_switch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput_ladder import plan

    built_in = plan(["mlm"], 32).runs
    register()
    try:
        runs = plan(["mlm"], 32).runs
    finally:
        unregister_switch("train.checkpoint_every")
    assert [r[1] for r in runs] == ["baseline", "checkpoint-half", *(r[1] for r in built_in[1:])]
    settings = [dict(o.split("=", 1) for o in r[2]) for r in runs]
    assert {k: settings[1][k] for k in set(settings[1]) - set(settings[0])} == {
        "train.activation_checkpointing": "true", "train.checkpoint_every": "2"}
    assert all(s["train.checkpoint_every"] == "2" for s in settings[1:])  # the rungs above keep it
    assert plan(["mlm"], 32).runs == built_in  # unregistered: the ladder is the built-in switches' again


def test_a_switch_is_refused_where_it_would_clash(toy_switch):
    with pytest.raises(ValueError, match="speed switch train.checkpoint_every is registered already"):
        register()
    with pytest.raises(ValueError, match="after 'train.nothing', which is no switch"):
        register_switch(Switch("train.other", None, rung=Rung("other", ())), after="train.nothing")
    with pytest.raises(ValueError, match="rung autocast is another switch's"):
        register_switch(Switch("train.other", None, rung=Rung("autocast", ())), after="train.compile")


def test_the_engine_applies_the_toy_switch_for_pretraining_and_finetuning(tmp_path, wiki_shards, tiny_encoder):
    """One step of each: at its first step, every second layer of the trained module's encoder recomputes."""
    from support import pretrain_env

    flag = ROOT / "pretrieve" / "assets" / "samples" / "finetune" / "embedder_retrieval_msmarco.jsonl"
    runs = {"pretrain": ([str(ROOT / "configs" / "pretrain" / "tiny-mlm.yaml"), "model.num_layers=4",
                          f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                          "method.max_len=64"], [True, False, True, False]),
            "finetune": ([str(ROOT / "configs" / "finetune" / "tiny.yaml"), f"finetune.init_from={tiny_encoder}",
                          f"finetune.data=[{flag}]"], [True, False])}
    for kind, (args, checkpointed) in runs.items():
        done = subprocess.run([sys.executable, __file__, kind, *args, f"run_dir={tmp_path / kind}",
                               "train.max_steps=1", "train.micro_batch_size=4", "tracking.enabled=false"],
                              env=pretrain_env(), capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == {"checkpointed": checkpointed}, kind


def test_the_walk_through_is_this_files_code():
    """Each code block of docs/training.md's walk-through is this file's, line for line (indentation aside), and
    its steps name the five files a switch touches."""
    from support import walk_through_blocks

    section, blocks = walk_through_blocks("training.md", "### Add a speed switch", __file__)
    assert len(blocks) == 4
    files = re.findall(r"^\d\. \*\*\w+\*\*, `([^`]+)`", section, re.MULTILINE)
    assert len(files) == len(set(files)) == 5, files
    assert all((ROOT / f).is_file() for f in files if "<" not in f), files


def test_the_training_page_lists_the_switches_in_the_tables_order():
    from pretrieve.models.speed_switches import switches

    rows = re.findall(r"^\| \d+ \| `([\w.]+)` \| [^|]+ \|([^|]*)\|$", (ROOT / "docs" / "training.md").read_text(),
                      re.MULTILINE)
    assert [key for key, _ in rows] == [s.key for s in switches()]
    for (key, rungs), switch in zip(rows, switches()):
        named = [r.name for r in (switch.rung, *switch.alternatives) if r is not None]
        assert re.findall(r"`([\w-]+)`", rungs) == named, key


def _train_with_toy_switch(kind: str, config_file: str, overrides: list[str]) -> None:
    """`pretrieve pretrain|finetune` with train.checkpoint_every=2 on top of activation checkpointing; prints which
    layers of the trained module recompute at the first step."""
    from pretrieve.config import load_config
    from pretrieve.engine.train import run_training
    from pretrieve.finetune.config import finetune_experiment
    from pretrieve.finetune.run import _finetuning_job
    from pretrieve.pretrain import pretraining_job
    from pretrieve.pretrain_config import experiment

    register()
    if kind == "pretrain":
        exp, build = experiment(load_config(config_file, overrides)), pretraining_job
    else:
        exp, build = finetune_experiment(load_config(config_file, overrides, required=("finetune",))), _finetuning_job
    exp = replace(exp, train=ToyTrainOptions(**{**asdict(exp.train), "activation_checkpointing": True},
                                             checkpoint_every=2))
    seen = {}

    def watched(exp, rank):
        job = build(exp, rank)
        schedule = job.at_step

        def at_step(step):  # the loop calls it before each forward, after the engine's passes
            seen.setdefault("checkpointed", [m.gradient_checkpointing for m in job.module.modules()
                                             if isinstance(m, GradientCheckpointingLayer)])
            if schedule is not None:
                schedule(step)
        job.at_step = at_step
        return job

    run_training(exp, watched)
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    _train_with_toy_switch(sys.argv[1], sys.argv[2], sys.argv[3:])
