"""A method added in one file, step by step as docs/methods.md "Add a method" shows it (the walk-through's code
blocks are this file's code): `first_token`, MLM plus predicting each text's first token from its [CLS] state.
It trains through `pretrieve pretrain` (this file run as a script registers it, then runs the command), its
range and its FLOPs are the registry's, and it is unregistered afterwards. A built-in method adds five files to
its one (the walk-through's list, counted here), and what reads the registry needs no edit.

    python tests/test_toy_method.py CONFIG KEY=VALUE...   # `pretrieve pretrain CONFIG ...` with first_token known
"""

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pretrieve.data.collators import MLMCollator
from pretrieve.models.flops import labelled, vocab_flops
from pretrieve.models.heads.base import PretrainingHead
from pretrieve.models.heads.registry import MethodOptions, option, register_method, unregister_method

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent


# 1. Options: the paper's defaults, each number's valid values beside it.
@dataclass
class FirstTokenOptions(MethodOptions):
    max_len: int = option(512, at_least=3, why="[CLS], a token, [SEP]")
    mlm_ratio: float = option(0.15, above=0, at_most=1)
    first_token_weight: float = option(0.5, at_least=0)  # weight of the first-token loss


# 2. Collator: MLM batches plus the method's own keys.
@dataclass
class FirstTokenCollator(MLMCollator):
    """MLM keys plus `first_token` [B]: each text's first ordinary token (-100 for a stream pad sample)."""

    def extend(self, out, batch, words, num_words, rng):
        first = np.where(batch.pad | (batch.lengths < 3), -100, batch.ids[:, 1])
        out["first_token"] = torch.from_numpy(first)


# 3. Head: the loss dict over the shared encoder; its own weights are exported with it.
class FirstTokenHead(PretrainingHead):
    """L = L_mlm + first_token_weight * CE(MLM head(W h_CLS), first token)."""

    def __init__(self, encoder, options):
        super().__init__(encoder, options)
        self.projection = nn.Linear(encoder.config.hidden_size, encoder.config.hidden_size)
        encoder.init_new(self.projection)

    def forward(self, batch):
        hidden = self.encoder(batch["input_ids"], batch["attention_mask"])
        mlm = self.encoder.token_loss(hidden, batch["mlm_labels"])
        first = self.encoder.token_loss(self.projection(hidden[:, :1]), batch["first_token"][:, None])
        loss = mlm + self.options.first_token_weight * first
        return {"loss": loss, "mlm": mlm.detach(), "first": first.detach()}


# 4. FLOPs: the head's forward beyond the encoder's (models/flops.py has the building blocks).
def first_token_flops(options, config, batch):
    """The h x h projection of each [CLS] state, then the MLM head at the texts that have a first token."""
    b = batch["input_ids"].shape[0]
    return 2 * b * config.hidden_size ** 2 + vocab_flops(config, labelled(batch["first_token"]))


# 5. Register: a module in pretrieve/models/heads/ does this at import; here, the fixture or the script does.
def register():
    return register_method("first_token", FirstTokenHead, FirstTokenCollator, FirstTokenOptions,
                           flops=first_token_flops, eval_pooling="cls")


@pytest.fixture
def first_token():
    yield register()
    unregister_method("first_token")  # the other tests see the built-in methods only


def _overrides(run_dir, wiki_shards, *more):
    return [f"run_dir={run_dir}", "method.name=first_token", f"data.manifests=[{wiki_shards / 'manifest.json'}]",
            "data.weights=null", "method.max_len=64", "train.max_steps=2", "train.micro_batch_size=4",
            "train.log_every=1", "checkpoint.every=2", "tracking.enabled=false", *more]


def test_the_toy_method_trains_through_pretrieve_pretrain(tmp_path, wiki_shards):
    from support import pretrain_env

    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, __file__, str(ROOT / "configs" / "pretrain" / "tiny-mlm.yaml"),
                           *_overrides(run_dir, wiki_shards, "method.first_token_weight=2")],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # the loss is the head's: L_mlm + 2 * L_first (each averaged over the window)
        assert r["first"] > 0 and r["tflops_per_device"] > 0
        assert r["loss"] == pytest.approx(r["mlm"] + 2 * r["first"], rel=1e-5)
    meta = json.loads((run_dir / "export" / "pretrieve_head.json").read_text())
    assert meta["method"] == "first_token" and meta["options"]["first_token_weight"] == 2
    from safetensors.torch import load_file

    head_weights = load_file(run_dir / "export" / "pretrieve_head.safetensors")
    assert {"projection.weight", "projection.bias"} <= set(head_weights)


def test_the_toy_method_options_and_flops_are_its_registry_entry(first_token, wiki_shards, vocab, wiki_samples):
    from pretrieve.config import ConfigError, load_config
    from pretrieve.engine.flops import forward_flops, train_flops
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads.registry import get_method
    from pretrieve.pretrain_config import experiment

    config = load_config(ROOT / "configs" / "pretrain" / "tiny-mlm.yaml",
                         _overrides("unused", wiki_shards, "method.first_token_weight=-1", "method.mlm_ratio=0"))
    with pytest.raises(ConfigError) as refused:
        experiment(config)
    assert refused.value.problems == ["method.mlm_ratio: must be in (0, 1], got 0",
                                      "method.first_token_weight: must be >= 0, got -1"]
    options = first_token.options_from({"max_len": 64})
    batch = first_token.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    assert (batch["first_token"] == batch["input_ids"].new_tensor([s["ids"][0] for s in wiki_samples[:4]])).all()
    bert = ModelOptions(vocab_size=30522, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256).hf_config()
    own = 2 * 4 * 64 * 64 + 2 * 4 * (64 * 64 + 64 * 30522)  # projection + MLM head at 4 first tokens
    mlm = get_method("mlm")
    assert forward_flops(first_token, options, bert, batch) - forward_flops(mlm, options, bert, batch) == own
    assert train_flops(first_token, options, bert, batch) == 3 * forward_flops(first_token, options, bert, batch)


def test_an_unregistered_method_is_unknown():
    from pretrieve.models.heads.registry import get_method

    registered = register()
    assert get_method("first_token") is registered
    unregister_method("first_token")
    with pytest.raises(KeyError, match="method 'first_token' is not registered"):
        get_method("first_token")


def test_the_walk_through_is_this_files_code():
    """Each of the five steps' code in docs/methods.md is this file's, line for line (indentation aside)."""
    from support import walk_through_blocks

    _, blocks = walk_through_blocks("methods.md", "## Add a method", __file__)
    assert len(blocks) == 5


def test_a_new_method_touches_six_files():
    """The files "Add a method" says a new method touches: six at most, each one of the method's own (its name in
    the path: every built-in method on text has those) or a page's line. And nothing else: a method registered
    from one file, here the toy method as an arm of the method study, is at once an arm with its pooling and its
    tiny runs' overrides (pretrieve/study/plan.py, every plan's pooling) and a method of the GPU check's ladder with
    its paper's overrides (benchmarks/gpu_job.py)."""
    from support import text_methods

    from pretrieve.models.heads import METHODS

    section = (ROOT / "docs" / "methods.md").read_text().split("\n## Add a method", 1)[1].split("\n## ", 1)[0]
    listed = section.split("<!-- a method's files", 1)[1].split("\n\n", 1)[0]
    files = re.findall(r"^- `([^`]+)`", listed, re.MULTILINE)
    assert 0 < len(files) <= 6, files
    own = [path for path in files if "<name>" in path]
    assert set(files) - set(own) <= {"docs/methods.md", "docs/layout.md"}, files
    for name in text_methods(METHODS):
        if METHODS[name].head.__module__ == f"pretrieve.models.heads.{name}":  # a method of its own file
            missing = [path for path in own if not path.startswith("tests/")
                       and not (ROOT / path.replace("<name>", name)).is_file()]
            assert not missing, (name, missing)
            assert f"| `models/heads/{name}.py` |" in (ROOT / "docs" / "layout.md").read_text()

    seen = subprocess.run([sys.executable, "-c", f"""
import json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import test_toy_method as toy
from pretrieve.models.heads.registry import register_method, study_arms
register_method("first_token", toy.FirstTokenHead, toy.FirstTokenCollator, toy.FirstTokenOptions,
                flops=toy.first_token_flops, eval_pooling="cls", study_arm=study_arms()[-1].study_arm + 1,
                tiny_overrides=("method.first_token_weight=1",), paper_overrides=("method.first_token_weight=0.1",))
from pretrieve.study import plan
print(json.dumps({{"arms": plan.ARMS, "pooling": plan.POOLING, "overrides": plan.ARM_OVERRIDES}}))
from benchmarks import gpu_job
exec(gpu_job.LADDER_NEW_METHODS)  # the GPU check's reading of the registry
"""], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300, check=False)
    assert seen.returncode == 0, seen.stderr[-3000:]
    study, ladder = map(json.loads, seen.stdout.splitlines()[-2:])
    seen = {**study, "ladder": ladder}
    assert seen["arms"][-1] == "first_token"
    assert seen["pooling"]["first_token"] == "cls"
    assert seen["overrides"]["first_token"] == ["method.first_token_weight=1"]
    assert seen["ladder"]["first_token"] == ["method.first_token_weight=0.1"]


if __name__ == "__main__":
    from pretrieve.cli import main

    register()
    sys.argv = ["pretrieve", "pretrain", *sys.argv[1:]]
    sys.exit(main())
