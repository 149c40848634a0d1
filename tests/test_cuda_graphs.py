"""`train.cuda_graphs` (pretrieve/engine/cuda_graphs.py) on CPU: each refusal by its key, at config time where the
config says it, at start-up where only the machine, the world or the module built can. The captured step itself
runs in tests/test_cuda_graphs_gpu.py (`make test-gpu`)."""

import pytest
from omegaconf import OmegaConf
from support import tiny_head

from pretrieve.config import (
    CheckpointOptions,
    RunExperiment,
    TrackingOptions,
    TrainOptions,
    run_sections,
)
from pretrieve.engine.cuda_graphs import module_refusal
from pretrieve.models.speed_switches import check_switches, check_train, switches
from pretrieve.utils.options import ConfigError, Problems

STATIC = ("train.cuda_graphs: a graph replays the shapes it captured: needs train.static_shapes=true (each batch "
          "padded to max_len and its labelled positions to a fixed count, no reads of the device in the step)")


def _problems(static_shapes: bool = True, **train) -> list[str]:
    options = TrainOptions(cuda_graphs=True, **{"precision": "bf16-autocast", **train})
    options.static_shapes = static_shapes  # a field of TrainOptions where the padded batches exist
    problems = Problems()
    check_switches(problems, train=options)
    return problems.messages


def test_a_step_a_graph_can_hold_passes_the_check():
    assert _problems() == []
    assert _problems(precision="fp32") == []
    options = TrainOptions(precision="bf16", zero_stage=2)  # off: nothing said
    problems = Problems()
    check_switches(problems, train=options)
    assert problems.messages == []


def test_each_thing_a_captured_step_cannot_hold_is_refused_by_key():
    assert _problems(static_shapes=False) == [STATIC]
    assert _problems(grad_accum=2) == [
        "train.cuda_graphs: needs train.grad_accum=1, got 2 (the graph writes each gradient anew)"]
    assert _problems(precision="bf16") == [
        ("train.cuda_graphs: train.precision bf16 steps through DeepSpeed's wrapper, which checks the gradients on "
         "the host: use bf16-autocast or fp32")]
    assert _problems(precision="fp16") == [m.replace("bf16 steps", "fp16 steps") for m in _problems(precision="bf16")]
    assert _problems(zero_stage=1) == [
        ("train.cuda_graphs: needs train.zero_stage 0, got 1 (ZeRO's hooks partition and reduce the gradients "
         "inside backward)")]
    assert _problems(activation_checkpointing=True) == [
        ("train.cuda_graphs: train.activation_checkpointing restores the device's random state to recompute each "
         "layer in backward, which a graph capture does not allow: leave one of them out")]


def test_every_experiment_checks_it_with_train_and_reports_every_problem():
    """config.run_sections, as pre-training and fine-tuning read `train:`: the key is a field, its problems are
    listed with the others."""
    config = OmegaConf.create({"train": {"cuda_graphs": True, "zero_stage": 2, "precision": "bf16-autocast"}})
    with pytest.raises(ConfigError) as refused:
        run_sections(config, 1, check_train)
    assert refused.value.problems == [STATIC, ("train.cuda_graphs: needs train.zero_stage 0, got 2 (ZeRO's hooks "
                                               "partition and reduce the gradients inside backward)")]


def test_a_machine_without_cuda_refuses_it_before_the_run_starts(tmp_path):
    from pretrieve.engine.train import run_training

    exp = RunExperiment(seed=0, run_dir=tmp_path / "run", resume=None, train=TrainOptions(cuda_graphs=True),
                        checkpoint=CheckpointOptions(), tracking=TrackingOptions(enabled=False),
                        raw=OmegaConf.create({}))

    def never(exp, rank):
        raise AssertionError("no job is built")

    with pytest.raises(ConfigError, match=r"^train.cuda_graphs: captures CUDA graphs, and torch .* sees no CUDA "
                                          r"device: leave it out on this machine$"):
        run_training(exp, never)
    assert not exp.run_dir.exists()


def test_the_module_built_is_refused_where_its_shapes_or_its_loss_change():
    """What the recipe built, for pre-training and fine-tuning alike: an unpadded encoder, a loss schedule; and a
    world of more than one rank."""
    _, _, mlm = tiny_head("mlm")
    assert module_refusal(mlm, 1) is None
    assert module_refusal(mlm, 2) == ("train.cuda_graphs: one rank only (this world has 2): the gradients' "
                                      "all-reduce of DeepSpeed's backward is not captured")
    _, _, unpadded = tiny_head("mlm", "model.unpad=true")
    assert module_refusal(unpadded, 1) == ("train.cuda_graphs: model.unpad packs each batch into a row of its own "
                                           "length, and a graph replays one shape: set model.unpad=false")
    _, _, bow = tiny_head("bow")
    assert module_refusal(bow, 1) == ("train.cuda_graphs: BoWHead's loss follows a schedule over training "
                                      "(set_step), which a replayed graph would keep at its value when captured")


def test_its_rung_is_measured_on_top_of_the_ladder_on_padded_batches():
    """An alternative: on top of compile, unpadding turned back off, the batches padded to one shape."""
    row = next(s for s in switches() if s.key == "train.cuda_graphs")
    keys = [s.key for s in switches()]
    assert keys.index("train.cuda_graphs") == keys.index("train.compile") + 1 and row.rung is None
    assert [(r.name, r.overrides) for r in row.alternatives] == [
        ("cuda-graphs", ("model.unpad=false", "train.static_shapes=true", "train.cuda_graphs=true"))]
