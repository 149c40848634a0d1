"""`pretrieve pretrain`, `export`, `card`, `universal` and `launch-info`: a pre-training run and what is done with
its checkpoints. Each command's flags are in its `add_` function, its work in its `run_` function."""

from __future__ import annotations

import argparse
import json
import textwrap

from pretrieve.commands.arguments import command, config_and_overrides, print_result


def add_pretrain(commands) -> None:
    p = command(commands, "pretrain", run_pretrain, formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=_config_sections)
    config_and_overrides(p)


def _config_sections() -> str:
    """The sections of a pre-training config and their keys, from the schema in pretrain_config.py."""
    from pretrieve.pretrain_config import PLAIN_KEYS, SECTIONS, section_keys

    lines = ["config sections and their keys (docs/training.md, \"The config\"; the methods' options:",
             "docs/methods.md):"]
    for name in SECTIONS:
        lines += textwrap.wrap(", ".join(section_keys(name)), width=110, initial_indent=f"  {name:<12}",
                               subsequent_indent=" " * 14)
    return "\n".join([*lines, f"plain keys: {', '.join(PLAIN_KEYS)}"])


def run_pretrain(args) -> int:
    """pre-train a registered method with DeepSpeed from a YAML config

    Train CONFIG (configs/pretrain/*.yaml) with dotted key=value overrides,
    e.g. run_dir=runs/x train.max_steps=100 checkpoint.every=50 resume=auto.
    """
    import os

    from pretrieve.config import load_config
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment

    config = load_config(args.config, args.overrides)
    world = int(os.environ.get("WORLD_SIZE", 1))
    print_result(train(experiment(config, world_size=world)))  # a stop signal: Stopped, reported by main
    return 0


def add_export(commands) -> None:
    p = command(commands, "export", run_export)
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--keep-adapter", action=argparse.BooleanOptionalAction, default=None,
                   help="a LoRA run: write its adapter apart (peft's files under OUT/adapter/) instead of merged; "
                        "default: the run's model.lora.keep_adapter (finetune.lora.keep_adapter)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier export OUT holds (a folder holding anything else is refused)")


def run_export(args) -> int:
    """export a training checkpoint as a HF directory (+ head weights)

    CHECKPOINT: a run directory (latest checkpoint), its checkpoints/ directory or a tag directory, of a
    pre-training or a fine-tuning run (`pretrieve finetune`); ZeRO partitions are consolidated. OUT is written
    whole (a temporary folder beside it, then a rename): a new or empty folder, or an earlier export with
    --overwrite; a folder holding anything else is refused, and nothing in it is touched.
    """
    import os
    from pathlib import Path

    from transformers.utils import logging as transformers_logging

    from pretrieve.models.encoder import FINETUNE_META
    from pretrieve.models.export import describe_export
    from pretrieve.utils.run_dir import locate

    # an export reads and writes weights on the CPU: no accelerator to look for (DeepSpeed warns when it finds
    # none), and no progress bar for a one-file write
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    transformers_logging.disable_progress_bar()
    run_dir, _, tag = locate(Path(args.checkpoint))
    if (run_dir / FINETUNE_META).is_file():
        from pretrieve.finetune.run import export_finetuned as export_run
    else:
        from pretrieve.pretrain import export_checkpoint as export_run
    out = export_run(args.checkpoint, args.out, args.keep_adapter, overwrite=args.overwrite)
    print(describe_export(out, source=f"{run_dir}, checkpoint {tag}"))
    return 0


def add_card(commands) -> None:
    p = command(commands, "card", run_card)
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="the MLflow store the farm logs to (default: the run's own, from RUN/run.json)")


def run_card(args) -> int:
    """write a run's model card (RUN/export/README.md) again, with its evaluations

    Generate the Hugging Face model card of RUN/export from the run directory (method, size, data, tokens, steps,
    losses) and every evaluation the farm has logged for it in MLflow.
    """
    from pretrieve.eval.model_card import refresh_card

    print(refresh_card(args.run_dir, args.tracking_uri))
    return 0


def add_universal(commands) -> None:
    p = command(commands, "universal", run_universal)
    p.add_argument("run_dir", metavar="RUN")


def run_universal(args) -> int:
    """convert a run's latest checkpoint for resuming at another world size

    Convert RUN's latest ZeRO 1-3 checkpoint into a DeepSpeed universal checkpoint and make it `latest`; then
    `pretrain ... resume=auto` at any world size continues the run.
    """
    from pretrieve.engine.universal import to_universal

    print(to_universal(args.run_dir))
    return 0


def add_launch_info(commands) -> None:
    p = command(commands, "launch-info", run_launch_info)
    config_and_overrides(p)
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile (launchers/make_hostfile.sh writes one)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")


def run_launch_info(args) -> int:
    """print the world and batch a launch of CONFIG would use; no training

    Resolve the world (hostfile, launcher environment, SLURM allocation or this machine), validate CONFIG for it and
    print hosts, ranks, devices and the batch arithmetic.
    """
    from pretrieve.config import load_config
    from pretrieve.engine.ds_config import deepspeed_config, ds_config_path
    from pretrieve.engine.world import local_devices, resolve_world
    from pretrieve.pretrain_config import experiment
    from pretrieve.utils.run_dir import latest_checkpoint

    world = resolve_world(args.hostfile)
    exp = experiment(load_config(args.config, args.overrides), world_size=world.size)
    ds = deepspeed_config(exp)  # also checks the DeepSpeed JSON against the experiment
    t = exp.train
    devices, device_name = local_devices()
    info = {"world_size": world.size, "source": world.source, "hosts": dict(world.hosts),
            "devices_here": devices, "device": device_name, "micro_batch_size": t.micro_batch_size,
            "grad_accum": t.grad_accum, "global_batch_size": t.micro_batch_size * t.grad_accum * world.size,
            "max_len": getattr(exp.options, "max_len", None), "zero_stage": ds["zero_optimization"]["stage"],
            "precision": t.precision, "ds_config": str(ds_config_path(t)),
            "method": exp.method.name, "run_dir": str(exp.run_dir), "resume_from": latest_checkpoint(exp.run_dir)}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"world: {info['world_size']} ranks on {len(world.hosts)} host(s), from {world.source}")
    for host, slots in world.hosts:
        print(f"  {host}: {slots} rank(s)")
    print(f"devices here: {devices} x {device_name}")
    print(f"batch: micro {t.micro_batch_size} x grad_accum {t.grad_accum} x world {world.size} = global "
          f"{info['global_batch_size']} sequences of <= {info['max_len']} tokens")
    print(f"method {info['method']}, ZeRO {info['zero_stage']}, {t.precision} ({info['ds_config']})")
    resume = f"resume=auto continues from {info['resume_from']}" if info["resume_from"] else "no checkpoint yet"
    print(f"run_dir: {info['run_dir']} ({resume})")
    return 0
