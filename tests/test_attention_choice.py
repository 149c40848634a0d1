"""`method.attention_impl: auto` resolves as the measured table says (kernels/choice.py): the committed H100
measurement, the matching rule on tables made up here, CPU and attention dropout, the table's refresh from a
benchmark JSON, and the config errors around the key. No GPU or triton needed."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pretrieve.kernels import choice, resolve

ROOT = Path(__file__).resolve().parent.parent
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))


def _entry(device, capability, length, fused, sdpa):
    return {"device": device, "capability": list(capability), "length": length,
            "ms": {"eager": 9.0, "sdpa": sdpa, "fused": fused}}


def test_committed_h100_measurement_picks_sdpa_at_512(monkeypatch):
    """2026-11-27 on an H100: fused 2.24 ms, SDPA 1.01 ms at L512, so auto runs SDPA there."""
    assert choice.winner(*H100, 512) == "sdpa"
    monkeypatch.setattr(choice, "cuda_device", lambda device: H100)
    assert resolve("auto", torch.device("cuda"), 0.0, 512) == "sdpa"
    assert choice.auto(torch.device("cuda"), 512) == "sdpa"


def test_cpu_dropout_and_no_triton_run_sdpa(monkeypatch):
    monkeypatch.setattr(choice, "winner", lambda *args, **kwargs: "fused")  # a table where fused always wins
    choice._auto_cuda.cache_clear()
    monkeypatch.setattr(choice, "cuda_device", lambda device: ("Some GPU", (9, 0)))
    cuda = torch.device("cuda")
    try:
        assert choice.auto(cuda, 512) == "fused"
        for length in (16, 512, 8192):
            assert choice.auto(torch.device("cpu"), length) == "sdpa"
            assert resolve("auto", torch.device("cpu"), 0.0, length) == "sdpa"
        assert choice.auto(cuda, 512, dropout_p=0.1) == "sdpa"
        assert choice.auto(cuda, 512, fused_available=False) == "sdpa"
    finally:
        choice._auto_cuda.cache_clear()


def test_matching_rule():
    table = [_entry("GPU A", (9, 0), 512, fused=2.0, sdpa=1.0), _entry("GPU A", (9, 0), 2048, fused=1.0, sdpa=3.0),
             _entry("GPU B", (8, 0), 512, fused=0.5, sdpa=1.0)]
    assert choice.winner("GPU A", (9, 0), 512, table) == "sdpa"
    assert choice.winner("GPU A", (9, 0), 2048, table) == "fused"
    assert choice.winner("GPU A", (9, 0), 700, table) == "sdpa"  # nearer 512 than 2048 on a log scale
    assert choice.winner("GPU A", (9, 0), 1500, table) == "fused"
    assert choice.winner("GPU A", (9, 0), 1024, table) == "fused"  # halfway: the longer
    assert choice.winner("GPU A", (9, 0), 64, table) == "sdpa"
    assert choice.winner("GPU A2", (9, 0), 4096, table) == "fused"  # no name: the same capability's
    assert choice.winner("GPU A", (8, 0), 512, table) == "sdpa"  # the name first
    assert choice.winner("GPU B", None, 512, table) == "fused"
    assert choice.winner("GPU C", (7, 5), 512, table) == "sdpa"  # never measured: sdpa
    assert choice.winner("GPU C", None, 512, []) == "sdpa"


def test_committed_table_is_the_committed_benchmark_result():
    """The table's H100 entry holds the times of benchmarks/results/two_stream_attention_gpu.json, and the
    benchmark's refresh path reproduces it from that file."""
    report = json.loads((ROOT / "benchmarks/results/two_stream_attention_gpu.json").read_text())
    entries = choice.entries_from_benchmark(report, "x.json")
    table = {(m["device"], m["length"]): m for m in choice.load_table()}
    assert entries and all(table[(e["device"], e["length"])]["ms"] == e["ms"] for e in entries)
    assert all(set(choice.CANDIDATES) <= set(m["ms"]) for m in table.values())


def test_refresh_replaces_this_device_and_length(tmp_path):
    path = tmp_path / "decoder_attention.json"
    shutil.copy(choice.TABLE, path)
    report = {"setup": {"device": H100[0], "torch": "t", "triton": "x"},  # no capability: an older result
              "lengths": {"512": {impl: {"fwd_bwd_ms": ms} for impl, ms in (("eager", 4.0), ("sdpa", 1.0),
                                                                              ("fused", 0.6))},
                          "1024": {impl: {"fwd_bwd_ms": ms} for impl, ms in (("sdpa", 3.0), ("fused", 3.5))}}}
    fresh = choice.merged(choice.load_table(path), choice.entries_from_benchmark(report, "r.json"))
    choice.write_table(fresh, path)
    measurements = choice.load_table(path)
    assert [(m["length"], m["capability"]) for m in measurements if m["device"] == H100[0]] == \
        [(512, [9, 0]), (1024, None)]
    assert choice.winner(*H100, 512, measurements) == "fused"
    assert choice.winner(*H100, 1024, measurements) == "sdpa"
    assert json.loads(path.read_text())["about"]  # the rest of the file kept


def test_config_names_where_the_setting_is():
    from pretrieve.models.heads import get_method
    from pretrieve.pretrain_config import settings_elsewhere
    from pretrieve.utils.options import ConfigError, Problems

    problems = Problems()
    settings_elsewhere(OmegaConf.create({"model": {"decoder_attention": "fused"}, "method": {"name": "retromae"}}),
                       problems)
    assert problems.messages == ["model.decoder_attention: this setting is method.attention_impl (auto | fused | "
                                 "sdpa | eager, the two-stream decoder's attention of retromae and dupmae, beside "
                                 "method.decoder_attention_dropout)"]
    for name in ("retromae", "dupmae"):
        assert get_method(name).options_from({"attention_impl": "sdpa"}).attention_impl == "sdpa"
        with pytest.raises((ConfigError, ValueError), match="attention_impl.*not one of auto, fused, sdpa, eager"):
            get_method(name).options_from({"attention_impl": "flash"})
