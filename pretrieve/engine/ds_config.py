"""DeepSpeed's JSON for a run: the file `train:` selects (ds_configs/), its "auto" fields filled from `train:`,
and refused where it contradicts `train:` (a schedule of its own, another precision)."""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.config import RunExperiment, TrainOptions
from pretrieve.utils.options import ConfigError

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"


def ds_config_path(train: TrainOptions) -> Path:
    """train.ds_config, or ds_configs/zero<train.zero_stage>.json."""
    return Path(train.ds_config) if train.ds_config else DS_CONFIG_DIR / f"zero{train.zero_stage}.json"


def deepspeed_config(exp: RunExperiment) -> dict:
    """The DeepSpeed JSON of the experiment with its "auto" fields filled from `train:`."""
    path = ds_config_path(exp.train)
    ds = json.loads(path.read_text())
    t = exp.train
    fill = {"train_micro_batch_size_per_gpu": t.micro_batch_size, "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": t.grad_clip, "lr": t.lr, "weight_decay": t.weight_decay}

    def resolve_auto(node, parent=None):
        if isinstance(node, dict):
            for key, value in node.items():
                if value == "auto":
                    if key == "enabled":
                        node[key] = {"bf16": t.precision == "bf16", "fp16": t.precision == "fp16"}[parent]
                    elif key in fill:
                        node[key] = fill[key]
                    else:
                        raise ConfigError(f"{path}: no value for \"auto\" field {key!r}")
                else:
                    resolve_auto(value, key)
        return node

    ds = resolve_auto(ds)
    if "scheduler" in ds:  # DeepSpeed would silently prefer the engine's schedule over this one
        raise ConfigError(f"{path}: has a \"scheduler\" section; the lr schedule comes from train.lr_schedule, "
                          "train.lr and train.warmup_ratio (remove the section)")
    # a precision variant (ds_configs/zero2_bf16.json) must say what train.precision says; under autocast the
    # module's weights stay fp32
    enabled = [name for name in ("bf16", "fp16") if ds.get(name, {}).get("enabled", False)]
    if (enabled or ["fp32"]) != ["fp32" if t.precision == "bf16-autocast" else t.precision]:
        raise ConfigError(f"train.precision: {t.precision}, but {path} enables "
                          f"{' and '.join(enabled) or 'neither bf16 nor fp16'}; make them agree, or write "
                          '"auto" in its "enabled" fields')
    # torch autocast is train.precision's to say: a ds_config's own section would be overwritten or contradict it
    own = ds.get("torch_autocast", {})
    if own.get("enabled", False) and (t.precision != "bf16-autocast" or own.get("dtype", "bfloat16") != "bfloat16"):
        raise ConfigError(f"{path}: its \"torch_autocast\" section ({own}) is for train.precision bf16-autocast "
                          f"(bfloat16), not {t.precision}: remove it and set train.precision")
    if t.precision == "bf16-autocast":
        ds["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    if t.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        # the configured torch AdamW steps on the CPU copy; DeepSpeedCPUAdam ("torch_adam": false) is faster on
        # GPU nodes but is a C++ op DeepSpeed compiles on first use
        ds["zero_force_ds_cpu_optimizer"] = False
    if t.offload_params:
        # page-locked host copies: asynchronous transfers to the GPU
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return ds
