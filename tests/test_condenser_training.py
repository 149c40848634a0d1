"""`condenser` and `cocondenser` through `pretrieve pretrain`: a run stopped after step 2 and resumed in a fresh
process equals the uninterrupted one bit for bit (dropout on; coCondenser through GradCache, whose chunks replay
the dropout masks), and coCondenser warm-starts from a Condenser export with its head, as the paper does."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import pretrain_stopped_and_resumed
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.export import load_export
from pretrieve.models.heads import get_method

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
METHODS = ("condenser", "cocondenser")


def _overrides(run_dir, wiki_shards, *extra):
    return [f"run_dir={run_dir}", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
            "train.max_steps=4", "train.micro_batch_size=4", "checkpoint.every=2", "train.log_every=1",
            "train.zero_stage=2", "tracking.enabled=false", *extra]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.parametrize("method", METHODS)
def test_resume_reproduces_the_uninterrupted_run(method, wiki_shards, tmp_path):
    pretrain_stopped_and_resumed(CONFIGS / f"tiny-{method}.yaml", _overrides(tmp_path / "full", wiki_shards),
                                 _overrides(tmp_path / "split", wiki_shards, "train.stop_at=2"))
    full, split = _metrics(tmp_path / "full"), _metrics(tmp_path / "split")
    parts = ("loss", "mlm", "head", "co") if method == "cocondenser" else ("loss", "mlm", "head")
    assert [r["step"] for r in split] == [1, 2, 3, 4]
    assert [[r[p] for p in parts] for r in split] == [[r[p] for p in parts] for r in full]
    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        ours, reference = load_file(tmp_path / "split/export" / name), load_file(tmp_path / "full/export" / name)
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    assert any(k.startswith("head.layers.1.") for k in load_file(tmp_path / "full/export/pretrieve_head.safetensors"))


def test_cocondenser_warm_starts_from_a_condenser_export(tmp_path):
    from pretrieve.models.export import export

    condenser = get_method("condenser")
    options = condenser.options_from({"max_len": 64, "skip_from": 1})
    head = condenser.build(options, ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64))
    out = export(head, tmp_path / "condenser")
    cocondenser = get_method("cocondenser")
    co = cocondenser.build(cocondenser.options_from({"max_len": 64, "skip_from": 1}), ModelOptions(init_from=str(out)))
    for key, value in head.state_dict().items():  # the encoder, its MLM head and the Condenser head, all of them
        assert torch.equal(co.state_dict()[key], value), key
    assert load_export(out).options.head_layers == 2


def test_a_grad_cache_chunk_must_split_the_two_spans_of_each_sample():
    """coCondenser's micro-batch of B samples is 2B spans: a chunk below 2B splits it, one of 2B is refused."""
    from pretrieve.config import load_config
    from pretrieve.pretrain_config import experiment
    from test_grad_cache import _problems

    def problems(chunk):
        config = load_config(CONFIGS / "tiny-cocondenser.yaml", ["train.micro_batch_size=4",
                                                                 f"method.grad_cache.chunk={chunk}"])
        return [p for p in _problems(experiment, config) if not p.startswith("data.manifests")]

    assert problems(7) == []
    assert problems(8) == [
        "method.grad_cache.chunk: 8 >= the 8 texts of the micro-batch's largest group (train.micro_batch_size 4 x "
        "texts per sample 2): no chunk would split the micro-batch, and GradCache would encode every text twice for "
        "nothing; give a chunk below 8, or leave method.grad_cache out"]
