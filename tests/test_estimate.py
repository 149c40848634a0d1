"""`pretrieve estimate`: a config's schedule priced from throughput records (the nearest record of the device kind,
scaled by FLOPs a token; a kind without records at the best MFU measured on another), its memory refused with
the settings that would make it fit, its checkpoint's size against a real one, `scale plan` pricing its points
the same way, and the command line's errors."""

import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from pretrieve.cli import main as cli
from pretrieve.config import load_config
from pretrieve.engine.flops import train_flops
from pretrieve.pretrain_config import method_options, model_options
from pretrieve.scale.estimate import Devices, estimate_config, tokens_per_second
from pretrieve.scale.records import load

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "pretrain"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
# hand-made records: retromae and mlm measured on an H100, retromae on an H200 at a higher MFU, and a peer's run
# (another program: never priced from)
RECORDS = [
    {"method": "retromae", "size": "base", "seq_len": 512, "batch": 32, "zero_stage": 0, "device": H100,
     "precision": "bf16", "tokens_per_s": 100000.0, "tflops_per_device": 90.0, "mfu": 0.091,
     "date": "2026-01-01T00:00:00+00:00", "job": "job-1"},
    {"method": "mlm", "size": "base", "seq_len": 512, "batch": 32, "zero_stage": 0, "device": H100,
     "precision": "bf16", "tokens_per_s": 150000.0, "tflops_per_device": 95.0, "mfu": 0.096,
     "date": "2026-01-01T00:00:00+00:00", "job": "job-1"},
    {"method": "retromae", "size": "base", "seq_len": 512, "batch": 32, "zero_stage": 0, "device": H200,
     "precision": "bf16", "tokens_per_s": 130000.0, "tflops_per_device": 120.0, "mfu": 0.121,
     "date": "2026-01-02T00:00:00+00:00", "job": "job-2"},
    {"peer": "hf-trainer", "method": "mlm", "size": "base", "seq_len": 512, "batch": 32, "device": H100,
     "precision": "bf16", "tokens_per_s": 900000.0, "tflops_per_device": 500.0, "mfu": 0.5},
]
SHAPE = ["model.hidden_size=256", "model.num_layers=4", "model.num_heads=4", "model.intermediate_size=1024"]


@pytest.fixture
def records_file(tmp_path) -> Path:
    path = tmp_path / "throughput_gpu.json"
    path.write_text(json.dumps(RECORDS))
    return path


def first_batch(config: Path, overrides: list[str], wiki_shards, vocab) -> tuple[dict, int, int]:
    """(the config's first micro-batch of the Wikipedia shards, its training FLOPs, its non-padding tokens)."""
    from pretrieve.data.stream import ShardStream

    config = load_config(config, overrides)
    method, options = method_options(config)
    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=1)), 32))
    batch = method.collator.from_options(options, vocab, seed=0)(samples)
    return batch, train_flops(method, options, model_options(config).hf_config(), batch), \
        int(batch["attention_mask"].sum())


@pytest.mark.parametrize("shape", [[], SHAPE], ids=["base", "smaller"])
def test_a_kind_with_records_is_priced_from_its_nearest_record_by_flops(records_file, wiki_shards, vocab, shape):
    """retromae on 8 H100s rests on the H100 retromae record (not mlm's, not the H200's): one device sustains the
    record's 90 TFLOP/s, so its tokens/s are the record's 100,000 x the record's FLOPs a token (9e8) over the
    config's; the same at a smaller width, which the estimate says it extrapolates to."""
    overrides = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "train.max_steps=1000",
                 "train.grad_accum=2", *shape]
    estimate = estimate_config(CONFIGS / "retromae.yaml", overrides, Devices(8, "h100"), load([records_file]))
    _, flops, tokens = first_batch(CONFIGS / "retromae.yaml", overrides, wiki_shards, vocab)
    per_token = flops / tokens
    assert tokens_per_second(estimate) == pytest.approx(100000 * (90e12 / 100000) / per_token, rel=1e-9)
    assert estimate.extrapolation == pytest.approx(per_token / 9e8)
    assert (estimate.extrapolation < 0.5) == bool(shape)  # the smaller encoder costs fewer FLOPs a token
    micro_batches = 1000 * 2 * 8
    assert estimate.tokens == tokens * micro_batches and estimate.flops == pytest.approx(flops * micro_batches)
    assert estimate.hours == pytest.approx(flops * micro_batches / (90e12 * 8) / 3600)
    assert estimate.gpu_hours == pytest.approx(8 * estimate.hours) and estimate.sequences_per_step == 32 * 2 * 8
    assert estimate.mfu == pytest.approx(90e12 / 989e12)
    assert estimate.rate_basis.startswith("the nearest record of h100: retromae base, L 512, micro-batch 32")
    assert "throughput_gpu.json [0], job-1" in estimate.rate_basis
    assert estimate.batch_from == "the first micro-batch of data.manifests (32 samples)"


def test_a_kind_without_records_takes_its_peak_at_the_best_mfu_measured_elsewhere(records_file):
    """No record of an A100: its bf16 peak (312 TFLOP/s) x the best MFU of the other kinds' nearest records (the
    H200's 120 / 989, above the H100's 90 / 989), and the estimate says so. With --mfu, that MFU instead."""
    estimate = estimate_config(CONFIGS / "retromae.yaml", ["train.max_steps=10"], Devices(4, "a100", nodes=2),
                               load([records_file]))
    assert estimate.flops_per_s == pytest.approx(120e12 / 989e12 * 312e12)
    assert estimate.rate_basis.startswith("no record of a100: its peak at the best MFU measured on another kind, by "
                                          "the record: retromae base, L 512, micro-batch 32, bf16 on NVIDIA H200")
    assert "12.13% MFU x a100's 312 TFLOP/s peak at bf16" in estimate.rate_basis
    assert estimate.world == 8 and estimate.devices == "2 nodes x 4xa100"
    assert estimate.batch_from.startswith("32 blocks of 512 tokens drawn from the tokenizer's vocabulary")
    assert estimate.tokens == 10 * 32 * 8 * 512  # full blocks: every position a token
    given = estimate_config(CONFIGS / "retromae.yaml", ["train.max_steps=10"], Devices(8, "a100"),
                            load([records_file]), mfu=0.3)
    assert given.flops_per_s == pytest.approx(0.3 * 312e12)
    assert given.rate_basis == "30.0% MFU (--mfu) of a100's 312 TFLOP/s peak at bf16"


def test_memory_that_does_not_fit_is_refused_with_the_settings_that_would_fit(records_file, capsys):
    """A BERT-large retromae, micro-batches of 16 x 512 in bf16 at ZeRO 0 on 8 A10s (24 GB, 21.6 usable): over.
    ZeRO 1 partitions Adam's 16 bytes a weight over the 8 ranks: the states fall from 20 to 2 + 2 + 16 / 8 bytes a
    trainable weight, and that fits; so do activation checkpointing and micro-batches of 8 x 2."""
    from pretrieve.scale.memory import GB

    overrides = ["model.hidden_size=1024", "model.num_layers=24", "model.num_heads=16",
                 "model.intermediate_size=4096", "train.micro_batch_size=16", "train.zero_stage=0"]
    code = cli(["estimate", str(CONFIGS / "retromae.yaml"), *overrides, "--devices", "8xA10",
                "--records", str(records_file), "--json"])
    printed = capsys.readouterr()
    estimate = json.loads(printed.out)
    config = load_config(CONFIGS / "retromae.yaml", overrides)
    method, options = method_options(config)
    with torch.device("meta"):
        trainable = sum(p.numel() for p in method.build(options, model_options(config)).parameters()
                        if p.requires_grad)
    needed = estimate["memory_gb"]
    at_zero_1 = needed - (20 - 6) * trainable / GB
    assert code == 1 and not estimate["fits"] and needed > 21.6 > at_zero_1
    assert f"does not fit 8xa10: {needed:.1f} GB per device of 21.6 usable; set train.zero_stage=1 " \
           f"({at_zero_1:.1f} GB); or set train.activation_checkpointing=true" in printed.err
    assert "or set train.micro_batch_size=8 and train.grad_accum=2 (the same tokens per step;" in printed.err
    assert estimate["fixes"][0] == f"set train.zero_stage=1 ({at_zero_1:.1f} GB)"  # the numbers are still shown


def test_scale_plan_prices_a_device_with_records_from_them(tmp_path, wiki_shards, records_file, monkeypatch, capsys):
    """`scale plan --device h100` without --mfu: each point at its method's H100 record's FLOP/s (bf16 points:
    the records' own), named with how far the points are from it; a device without records keeps 25 % MFU."""
    import yaml

    from pretrieve.scale import records

    results = tmp_path / "results"
    results.mkdir()
    (results / "throughput_gpu.json").write_text(records_file.read_text())
    monkeypatch.setattr(records, "RESULTS", results)
    study = {"name": "grid", "methods": ["mlm", "retromae"], "config": str(CONFIGS / "tiny-{method}.yaml"),
             "sizes": {"h64": {"hidden_size": 64, "num_layers": 1, "num_heads": 4, "intermediate_size": 256}},
             "budgets": {"tokens": [8192]}, "train": {"batch_size": 4, "seq_len": 64, "overrides": [
                 "tracking.enabled=false", "train.precision=bf16"]},
             "data": {"manifests": [str(wiki_shards / "manifest.json")]}, "run": {"out": str(tmp_path / "study")}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    assert cli(["scale", "plan", str(path), "--device", "h100"]) == 0
    printed = capsys.readouterr().out
    points = json.loads((tmp_path / "study" / "plan.json").read_text())["points"]
    rate = {"mlm": 95e12, "retromae": 90e12}
    for point in points:
        assert f"| {point['C']:.3g} | {point['C'] / rate[point['method']] / 3600:.3g} | 4 x 1 x 1 |" in printed
    total = sum(p["C"] / rate[p["method"]] for p in points) / 3600
    assert "device-hours at the throughput records of h100 (9.61% MFU for mlm from mlm base" in printed
    assert f"{total:.3g} device-hours" in printed and "; 9.10% MFU for retromae from retromae base" in printed
    assert cli(["scale", "plan", str(path), "--device", "a100"]) == 0
    assert f"{sum(p['C'] for p in points) / (0.25 * 312e12) / 3600:.3g} device-hours at 25% MFU of a100" \
        in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["--devices", "8xFOO"], ("--devices 8xFOO: unknown device kind 'FOO' (known: h100, h100-pcie, h100-nvl, h200, "
                              "a100, a100-40gb, l40s, a10, rtx2080ti)")),
    (["--devices", "8H100"], "--devices '8H100': expected COUNTxKIND, e.g. 8xH100"),
    (["--devices", "0xh100"], "--devices 0xh100 --nodes 1: both counts must be >= 1"),
    (["--devices", "4xrtx2080ti"], "train.precision: bf16: the RTX 2080 Ti computes no bf16; use fp16 or fp32"),
    (["--devices", "8xh100", "--mfu", "1.5"], r"--mfu must be in (0, 1], got 1.5"),
    (["train.max_steps=0", "--devices", "8xh100"], "train.max_steps: must be >= 1, got 0"),
])
def test_bad_input_names_the_flag_or_key(args, message, capsys):
    assert cli(["estimate", str(CONFIGS / "retromae.yaml"), *args]) == 1
    assert message in capsys.readouterr().err


def test_a_pair_method_needs_its_shards(capsys):
    assert cli(["estimate", str(CONFIGS / "contrastive.yaml"), "--devices", "8xh100"]) == 1
    assert "data.manifests: method contrastive trains on pairs: the estimate reads its first micro-batch" \
        in capsys.readouterr().err


def test_the_command_prices_from_the_committed_records(capsys):
    """The repository's own records (benchmarks/results/*_gpu.json): retromae on H100s rests on the H100 job's
    retromae run; --json prints the same estimate, whose hours are its FLOPs at that record's FLOP/s."""
    argv = ["estimate", str(CONFIGS / "retromae.yaml"), "train.max_steps=1000", "--devices", "8xH100"]
    assert cli(argv) == 0
    text = capsys.readouterr().out
    assert cli([*argv, "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    record = next(r for r in json.loads((ROOT / "benchmarks/results/pretrain_throughput_gpu.json").read_text())
                  if r["method"] == "retromae" and r["device"] == H100)
    assert estimate["flops_per_s"] == pytest.approx(record["tflops_per_device"] * 1e12)
    assert estimate["hours"] == pytest.approx(estimate["flops"] / (record["tflops_per_device"] * 1e12 * 8) / 3600)
    assert f"priced from   the nearest record of h100: retromae base, L 512, micro-batch 32, bf16 on {H100}: " \
           f"{record['tokens_per_s']:,.0f} tokens/s" in text
    assert f"wall time     {estimate['hours']:,.1f} h" in text and "memory        " in text


@pytest.mark.integration
def test_the_checkpoint_size_is_a_real_checkpoints(tmp_path, wiki_shards, records_file):
    """One step of tiny mlm in bf16 at ZeRO 2 with a checkpoint: its tag's files come to the estimate within 1 %
    (the 16-bit weights, fp32 master weights and Adam's moments; the rest is the stream and RNG states)."""
    import subprocess
    import sys

    overrides = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "train.max_steps=1",
                 "checkpoint.every=1", "tracking.enabled=false", "train.precision=bf16", "train.zero_stage=2",
                 f"run_dir={tmp_path / 'run'}"]
    subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-mlm.yaml"), *overrides],
                   check=True, timeout=600)
    (tag,) = (tmp_path / "run" / "checkpoints").glob("step*")
    written = sum(f.stat().st_size for f in tag.iterdir())
    estimate = estimate_config(CONFIGS / "tiny-mlm.yaml", overrides, Devices(1, "h100"), load([records_file]))
    assert estimate.checkpoint_gb * 1e9 == pytest.approx(written, rel=0.01)
