"""Every registered method, and stage-1 fine-tuning, trains under DeepSpeed: a few optimizer steps at ZeRO 0, 2
and 3 on one rank and at ZeRO 2 on two gloo ranks; every trainable encoder tensor moves, and the stages agree on
the loss. On two ranks, fine-tuning's in-batch negatives are both ranks' passages."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from support import free_port, json_lines, pretrain_env, save_tiny_bert, text_methods
from pretrieve.models.heads import METHODS

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).resolve().parent / "one_step.py"
ALL = (*text_methods(METHODS), "finetune")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random tiny BERT with the default tokenizer: what fine-tuning starts from."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), hidden=64, intermediate=256)


def _run(prefix, out, wiki_shards, tiny_bert, stages, methods=",".join(ALL), *precision):
    done = subprocess.run([*prefix, str(SCRIPT), str(out), str(wiki_shards / "manifest.json"), methods, stages,
                           *precision],
                          env=pretrain_env(FINETUNE_INIT=str(tiny_bert)), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json_lines(done.stdout)


def _check(records, stages, methods=ALL):
    assert sorted((r["method"], r["stage"]) for r in records) == sorted((m, s) for m in methods for s in stages)
    for r in records:
        assert r["step"] == 3 and r["finite"], r
        if r["precision"] == "bf16" and r["stage"] == 0:
            # ZeRO 0 keeps its fp32 master weights inside the optimizer; the export holds the bf16 module
            # weights, where small updates to LayerNorm scales near 1.0 round away
            assert r["changed"] > 0.8 * r["trainable"], r
        else:  # ZeRO 1-3 exports consolidate the fp32 master weights
            assert r["changed"] == r["trainable"] > 0, r


def _finetune_first_loss(records) -> float:
    """A random tiny encoder scores every passage about equally: the first in-batch loss is ~ln(candidates)."""
    return next(r["first_loss"] for r in records if r["method"] == "finetune")


def test_every_method_at_zero_0_2_3(tmp_path, wiki_shards, tiny_bert):
    records = _run([sys.executable], tmp_path, wiki_shards, tiny_bert, "0,2,3")
    _check(records, (0, 2, 3))
    for method in ALL:  # fp32, same data and seed: the ZeRO stage does not change the numbers
        losses = [r["loss"] for r in records if r["method"] == method]
        assert losses == pytest.approx([losses[0]] * 3, rel=1e-5), method
    assert _finetune_first_loss(records) == pytest.approx(math.log(4), abs=0.02)  # one rank's 4 passages


def test_every_method_at_zero_2_on_two_ranks(tmp_path, wiki_shards, tiny_bert):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    records = _run(torchrun, tmp_path, wiki_shards, tiny_bert, "2")
    _check(records, (2,))
    assert all(r["world"] == 2 for r in records)
    assert _finetune_first_loss(records) == pytest.approx(math.log(8), abs=0.02)  # both ranks' 4 passages


def test_bf16_at_every_zero_stage(tmp_path, wiki_shards, tiny_bert):
    """bf16 runs on CPU at ZeRO 0-3 (fp16 needs a GPU: DeepSpeed refuses it on CPU, and so does the config)."""
    records = _run([sys.executable], tmp_path, wiki_shards, tiny_bert, "0,1,2,3", "dupmae", "bf16")
    _check(records, (0, 1, 2, 3), ["dupmae"])
    assert all(r["precision"] == "bf16" for r in records)
    # fp32 masters at every stage (ZeRO 1-3's flat partitions, ZeRO 0's wrapper): the same steps to bf16's rounding
    losses = [r["loss"] for r in records]
    assert len({r["first_loss"] for r in records}) == 1 and losses == pytest.approx([losses[0]] * 4, rel=1e-3)


def test_bf16_autocast_steps_the_fp32_weights_as_fp32_does(tmp_path, wiki_shards, tiny_bert):
    """train.precision bf16-autocast (the speed ladder's autocast rung): the module keeps fp32 weights, so every
    trainable tensor moves and the export holds them; the products in bf16 change the losses by bf16's rounding,
    and so does train.low_precision_norm on top (measured: within 2.2e-5 of fp32's losses, autocast alone 1.2e-5)."""
    fp32 = _run([sys.executable], tmp_path / "fp32", wiki_shards, tiny_bert, "0", "mlm,retromae", "fp32")
    records = _run([sys.executable], tmp_path / "autocast", wiki_shards, tiny_bert, "0,2", "mlm,retromae",
                   "bf16-autocast")
    _check(records, (0, 2), ["mlm", "retromae"])
    # train.low_precision_norm on top: the norms in bf16 too (tests/test_low_precision_norm.py), the same steps
    low = _run([sys.executable], tmp_path / "low-norm", wiki_shards, tiny_bert, "0", "mlm,retromae",
               "bf16-autocast", "train.low_precision_norm=true")
    _check(low, (0,), ["mlm", "retromae"])
    for r in records + low:
        plain = next(f for f in fp32 if f["method"] == r["method"])
        assert r["first_loss"] != plain["first_loss"]  # the products did run in bf16
        assert r["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-3)
        assert r["loss"] == pytest.approx(plain["loss"], rel=1e-3)
    for r in low:  # the norms' outputs are rounded too: not autocast's losses
        assert r["first_loss"] != next(a for a in records if a["method"] == r["method"] and a["stage"] == 0)["first_loss"]
