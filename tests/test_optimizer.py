"""train.optimizer: torch's fused AdamW, handed to DeepSpeed as its client optimizer, trains as the ds_config's
AdamW does (the same losses and weights within float rounding, at ZeRO 0 and 2), and a run stopped and resumed
with it ends bit for bit where the uninterrupted one does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import pretrain_env
from pretrieve.config import ConfigError, load_config
from pretrieve.engine.ds_config import deepspeed_config
from pretrieve.engine.optimizer import client_optimizer, clip_in_loop
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-retromae.yaml"
STAGES = (0, 2)


def _common(wiki_shards):
    return [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
            "train.max_steps=3", "train.warmup_ratio=0", "train.log_every=1", "checkpoint.every=1",
            "tracking.enabled=false"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _optimizer_state(run_dir: Path, stage: int) -> dict:
    """The optimizer state dict (torch's, inside DeepSpeed's wrapper at ZeRO >= 1) of the run's last checkpoint."""
    tag = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    if stage == 0:
        return torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["optimizer"]
    saved = torch.load(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    return saved["optimizer_state_dict"]["base_optimizer_state"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, wiki_shards):
    """In one process, per ZeRO stage: 3 steps with each optimizer, and 3 steps of torch-fused stopped after 2;
    and 3 steps with each in bf16 at ZeRO 2, 2 micro-batches a step."""
    base = tmp_path_factory.mktemp("optimizer")
    runs = [[f"run_dir={base / f'{name}{stage}'}", f"train.zero_stage={stage}", f"train.optimizer={optimizer}",
             *stop, *_common(wiki_shards)]
            for stage in STAGES for name, optimizer, stop in (("deepspeed", "deepspeed", []),
                                                              ("fused", "torch-fused", []),
                                                              ("split", "torch-fused", ["train.stop_at=2"]))]
    runs += [[f"run_dir={base / f'bf16-{optimizer}'}", "train.zero_stage=2", "train.precision=bf16",
              "train.grad_accum=2", f"train.optimizer={optimizer}", *_common(wiki_shards)]
             for optimizer in ("deepspeed", "torch-fused")]
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"), str(CONFIG),
                           json.dumps(runs)], env=pretrain_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return base


@pytest.mark.parametrize("stage", STAGES)
def test_fused_adamw_trains_as_deepspeeds(runs, stage):
    """The two optimizers compute the same update in another order of float operations: the losses agree within
    1e-6 relative (measured: 1e-7), and so do the exported weights, each within 1e-6
    of itself or 1e-8 (measured: 7.5e-9 at most, a few fp32 steps of a weight)."""
    plain, fused = _metrics(runs / f"deepspeed{stage}"), _metrics(runs / f"fused{stage}")
    assert [r["step"] for r in fused] == [1, 2, 3]
    assert [r["loss"] for r in fused] == pytest.approx([r["loss"] for r in plain], rel=1e-6)
    assert [r["lr"] for r in fused] == [r["lr"] for r in plain]  # the schedule drives the client optimizer
    if stage == 0:  # the loop clips with torch's foreach norm (clip_in_loop), DeepSpeed a gradient at a time
        assert all(r["grad_norm"] > 1.0 for r in plain)  # train.grad_clip 1.0: every step clipped
        assert [r["grad_norm"] for r in fused] == pytest.approx([r["grad_norm"] for r in plain], rel=1e-5)
    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        ours, reference = (load_file(runs / run / "export" / name) for run in (f"fused{stage}", f"deepspeed{stage}"))
        assert ours.keys() == reference.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], reference[key], rtol=1e-6, atol=1e-8, msg=key)
    # what stepped: torch's fused AdamW with the ds_config's settings, against DeepSpeed's own torch AdamW
    [group], [reference_group] = _optimizer_state(runs / f"fused{stage}", stage)["param_groups"], \
        _optimizer_state(runs / f"deepspeed{stage}", stage)["param_groups"]
    assert group["fused"] is True and not reference_group["fused"]
    assert {k: group[k] for k in ("betas", "eps", "weight_decay")} == \
        {k: reference_group[k] for k in ("betas", "eps", "weight_decay")} == \
        {"betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}


@pytest.mark.parametrize("stage", STAGES)
def test_a_fused_run_resumes_exactly(runs, wiki_shards, stage):
    """Stopped after step 2 and resumed in a fresh process with torch-fused: step 3's loss and the exported
    weights equal the uninterrupted torch-fused run's bit for bit (its moments and step count came back)."""
    split = runs / f"split{stage}"
    done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(CONFIG), f"run_dir={split}",
                           f"train.zero_stage={stage}", "train.optimizer=torch-fused", *_common(wiki_shards),
                           "resume=auto"], env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(r["step"], r["loss"]) for r in _metrics(split)] == \
        [(r["step"], r["loss"]) for r in _metrics(runs / f"fused{stage}")]
    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        ours, reference = load_file(split / "export" / name), load_file(runs / f"fused{stage}" / "export" / name)
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def _tensor_bytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return sum(_tensor_bytes(value) for value in values)


def test_bf16_with_accumulation_keeps_one_master_copy(runs):
    """bf16 at ZeRO 2, 2 micro-batches a step: DeepSpeed's wrapper keeps the fp32 master partition and the
    accumulated gradients either way, and the fused optimizer steps that partition as DeepSpeed's own AdamW
    does: the checkpoint (16-bit weights, fp32 masters, both moments) holds as many bytes of tensors, no second
    master copy, and the losses agree within 1e-6 (measured: 3e-7)."""
    plain, fused = (runs / f"bf16-{optimizer}" for optimizer in ("deepspeed", "torch-fused"))
    assert [r["loss"] for r in _metrics(fused)] == pytest.approx([r["loss"] for r in _metrics(plain)], rel=1e-6)
    sizes = [sum(_tensor_bytes(torch.load(f, map_location="cpu", weights_only=False))
                 for f in sorted((run / "checkpoints" / "step00000003").glob("*.pt"))) for run in (plain, fused)]
    assert sizes[0] == sizes[1] > 0


def _experiment(wiki_shards, *overrides):
    return experiment(load_config(CONFIG, [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                                           *overrides]))


def test_the_fused_optimizer_takes_the_ds_configs_settings_and_its_place(wiki_shards):
    exp = _experiment(wiki_shards, "train.optimizer=torch-fused", "train.lr=3e-4", "train.weight_decay=0.05")
    ds_config = deepspeed_config(exp)
    section = ds_config["optimizer"]["params"]
    parameters = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = client_optimizer(exp.train, ds_config, parameters)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True
    assert {k: optimizer.defaults[k] for k in ("lr", "eps", "weight_decay")} == \
        {"lr": 3e-4, "eps": section["eps"], "weight_decay": 0.05}
    assert optimizer.defaults["betas"] == tuple(section["betas"])
    assert optimizer.param_groups[0]["params"] == parameters
    assert "optimizer" not in ds_config  # DeepSpeed builds none of its own beside it
    for default in ("auto", "deepspeed"):  # the ds_config's own, untouched
        exp.train.optimizer = default
        ds_config = deepspeed_config(exp)
        assert client_optimizer(exp.train, ds_config, parameters) is None and "optimizer" in ds_config


def test_optimizer_errors_name_the_key(wiki_shards, tmp_path):
    with pytest.raises(ConfigError, match="train.optimizer: 'adam' is not one of auto, deepspeed, torch-fused"):
        _experiment(wiki_shards, "train.optimizer=adam")
    lamb = tmp_path / "lamb.json"
    lamb.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "Lamb",
                                                                                        "params": {"lr": "auto"}}}))
    exp = _experiment(wiki_shards, "train.optimizer=torch-fused", f"train.ds_config={lamb}")
    with pytest.raises(ConfigError, match="train.optimizer: torch-fused builds AdamW .* has type 'Lamb'"):
        client_optimizer(exp.train, deepspeed_config(exp), [torch.nn.Parameter(torch.zeros(3))])


def test_the_loop_clips_where_the_module_holds_the_gradients(wiki_shards):
    """torch-fused at ZeRO 0 in fp32 or bf16-autocast: the loop clips to train.grad_clip and DeepSpeed clips
    nothing; with the ds_config's optimizer, a bf16 wrapper or ZeRO's buffers, DeepSpeed clips as before."""
    for overrides, loop in ((["train.optimizer=torch-fused"], 1.0),
                            (["train.optimizer=torch-fused", "train.precision=bf16-autocast"], 1.0),
                            (["train.optimizer=torch-fused", "train.grad_clip=0"], None),
                            (["train.optimizer=deepspeed"], None),
                            (["train.optimizer=torch-fused", "train.precision=bf16"], None),
                            (["train.optimizer=torch-fused", "train.zero_stage=2"], None)):
        exp = _experiment(wiki_shards, *overrides)
        ds_config = deepspeed_config(exp)
        assert clip_in_loop(exp.train, ds_config) == loop, overrides
        # DeepSpeed's own (an absent key clips to its default of 1.0): none where the loop clips
        assert ds_config["gradient_clipping"] == (exp.train.grad_clip if loop is None else 0.0), overrides
    own = {"zero_optimization": {"stage": 0}}  # a ds_config of one's own without the key: DeepSpeed's 1.0 is moved
    assert clip_in_loop(_experiment(wiki_shards, "train.optimizer=torch-fused").train, own) == 1.0
    assert own["gradient_clipping"] == 0.0
