"""benchmarks/pretrain_throughput.py --profile: the summary a GPU job brings back for the MFU work (the ops by
self time, their shares, the host syncs), here on CPU with a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import pretrain_env

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent


def test_a_profiled_run_says_where_the_time_went(tmp_path):
    profile, out = tmp_path / "profile.json", tmp_path / "throughput.json"
    # run in tmp_path (what the engine writes beside it stays there), the benchmarks package from the repository
    done = subprocess.run([sys.executable, "-m", "benchmarks.pretrain_throughput", "--size", "tiny", "--seq-len", "64",
                           "--batch", "4", "--steps", "3", "--warmup", "1", "--method", "mlm", "--profile",
                           str(profile), "--out", str(out)], env=pretrain_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(profile.read_text())
    assert summary["sorted_by"] == "self_cpu_time_total" and 0 < len(summary["top"]) <= 40
    times = [row["self_ms"] for row in summary["top"]]
    assert times == sorted(times, reverse=True) and 0 < sum(row["share"] for row in summary["top"]) <= 1.0001
    assert {"aten::mm", "aten::addmm"} & {row["name"] for row in summary["top"][:10]}  # matmuls lead
    assert summary["syncs"].get("aten::item", 0) > 0  # the loop's log steps read values back
    assert len(json.loads(out.read_text())) == 1  # the throughput record beside it


def test_retromaes_decoder_and_its_vocabulary_loss_are_regions_of_the_profile(tmp_path, vocab, wiki_samples):
    """The decoder projects onto the vocabulary at every ordinary token with the kernels of the encoder's MLM loss:
    the profile's record gives it a line of its own, a region with the projection's products inside it."""
    import torch
    from support import collated_with_a_pad_sample, tiny_head

    from benchmarks.pretrain_throughput import profiled

    method, options, head = tiny_head("retromae")
    batch, _ = collated_with_a_pad_sample(method, options, vocab, wiki_samples)
    with profiled(str(tmp_path / "profile.json"), gpu=False, timed_steps=1), \
            torch.profiler.record_function("step"):
        head(batch)["loss"].backward()
    regions = json.loads((tmp_path / "profile.json").read_text())["regions"]
    assert set(regions) == {"pretrieve/retromae.decoder", "pretrieve/retromae.decoder_vocab_loss"}
    assert all(r["calls"] == 1 and r["cpu_ms"] > 0 for r in regions.values())
    # the projection's products are the region's own: its events' descendants
    with torch.profiler.profile() as prof:
        head(batch)

    def below(event):
        return [event, *(e for child in event.cpu_children for e in below(child))]

    [region] = [e for e in prof.events() if e.name == "pretrieve/retromae.decoder_vocab_loss"]
    assert {"aten::mm", "aten::addmm", "aten::linear"} & {e.name for e in below(region)}
