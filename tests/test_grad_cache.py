"""GradCache under DeepSpeed, and the contrastive head's negatives across ranks.

The defining test: on 1 and 2 gloo ranks, at ZeRO 0 and 3 (and 1, 2, with activation checkpointing, with
gradient accumulation and with Matryoshka dimensions on 2), dropout on, one step with GradCache gives the loss and every weight's update
(SGD, lr 1: the gradient) of the same batch without it. With dropout, the reference encodes the same chunks
under one graph (the masks are drawn per chunk); without dropout, the whole micro-batch in one call."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support import free_port, pretrain_env, save_tiny_bert

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).resolve().parent / "grad_cache_step.py"


def _step(tmp_path: Path, ranks: int, variants: str) -> list[dict]:
    prefix = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                  str(ranks), "--master_port", free_port()]
    done = subprocess.run([*prefix, str(SCRIPT), variants, str(tmp_path)], env=pretrain_env(), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for f in sorted(tmp_path.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.parametrize("ranks,variants", [(1, "0:1:0:1,0:0:0:1,3:1:0:1,3:0:0:1"),
                                            (2, "0:1:0:1,0:0:0:1,3:1:0:1,3:0:0:1,1:1:0:1,2:1:0:2,3:1:1:1,"
                                                "3:1:0:1:1")])
def test_grad_cache_gives_the_loss_and_gradients_of_the_batch(tmp_path, ranks, variants):
    records = _step(tmp_path, ranks, variants)
    assert sorted((r["variant"], r["rank"]) for r in records) == sorted(
        (v, rank) for v in variants.split(",") for rank in range(ranks))
    for r in records:
        assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-6), r["variant"]
        trained = [n for n in r["size"] if r["size"][n] > 0]
        assert len(trained) > 30, r["variant"]  # every encoder weight and the temperature moved
        for name in r["diff"]:
            assert r["diff"][name] <= 1e-5 * r["size"][name] + 1e-7, (r["variant"], r["rank"], name)


def _pairs(rank: int, n: int = 4) -> list[dict]:
    """Pairs whose query is its passage's text: with dropout off, q_i = d_i, the best-scoring candidate."""
    rng = np.random.default_rng(rank)
    texts = [rng.integers(2000, 9000, size=int(rng.integers(4, 12))) for _ in range(n)]
    return [{"query": t, "pos": t, "negs": [], "source": "t", "doc": f"{rank}-{i}", "index": i}
            for i, t in enumerate(texts)]


def _head(vocab, **extra):
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    method = get_method("contrastive")
    options = method.options_from({"max_len": 16, "query_max_len": 16, "symmetric": True, "temperature": 0.1,
                                   **extra})
    head = method.build(options, ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                                              dropout=0.0, pad_token_id=0), seed=0)
    return head, method.collator.from_options(options, vocab)


def _cross_rank_worker(rank, world, port, vocab, chunk, results, extra):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        head, collate = _head(vocab, **extra, **({"grad_cache": {"chunk": chunk}} if chunk else {}))
        out = head(collate(_pairs(rank)))
        out["loss"].backward()
        results[rank] = (out["loss"].item(), out["accuracy"].item(),
                         {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk,extra", [(None, {}), (3, {}), (3, {"matryoshka_dims": [32, 8]})])
def test_negatives_across_two_ranks_keep_each_rows_own_positive(vocab, chunk, extra):
    """Two gloo ranks of 4 pairs each: every query's best candidate among all 8 passages is its own passage
    (accuracy 1 on both ranks: a positive taken from the wrong rank's slot scores lower), and the ranks' mean
    loss and gradients are those of the 8 pairs in one process (with GradCache too, and with Matryoshka
    dimensions: the full-width vectors gathered once, each prefix cut from them)."""
    import torch.multiprocessing as mp

    port = int(free_port())
    results = mp.Manager().dict()
    mp.start_processes(_cross_rank_worker, args=(2, port, vocab, chunk, results, extra), nprocs=2, join=True,
                       start_method="spawn")
    assert results[0][1] == results[1][1] == 1.0
    head, collate = _head(vocab, **extra)
    full = head(collate(_pairs(0) + _pairs(1)))
    full["loss"].backward()
    assert (results[0][0] + results[1][0]) / 2 == pytest.approx(full["loss"].item(), rel=1e-5)
    for name, p in head.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close((results[0][2][name] + results[1][2][name]) / 2, p.grad, rtol=1e-4,
                                       atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A random tiny BERT (dropout on) with the default tokenizer: what fine-tuning starts from."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), hidden=32, intermediate=64)


def test_interrupted_grad_cache_fine_tuning_resumes_exactly(tmp_path, tiny_bert):
    """`pretrieve finetune` with finetune.grad_cache.chunk=3 (dropout on): 4 steps in one go, and 2 steps,
    stopped, then resumed to 4, give the same losses at every step and the same weights."""
    from safetensors.torch import load_file

    from support import SAMPLES

    config = Path(__file__).resolve().parent.parent / "configs" / "finetune" / "tiny.yaml"
    common = [f"finetune.init_from={tiny_bert}", f"finetune.data=[{SAMPLES / 'finetune' / 'embedder_retrieval_msmarco.jsonl'}]",
              "finetune.grad_cache.chunk=3", "finetune.negatives=1", "finetune.passage_max_len=32",
              "train.micro_batch_size=4", "train.max_steps=4", "checkpoint.every=2"]

    def run(run_dir, *extra):
        done = subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(config), *common,
                               f"run_dir={run_dir}", *extra], env=pretrain_env(), capture_output=True, text=True,
                              timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]

    run(tmp_path / "full")
    run(tmp_path / "split", "train.stop_at=2")
    assert not (tmp_path / "split" / "export").exists()
    run(tmp_path / "split", "resume=auto")

    def losses(run_dir):
        return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                if "loss" in r]

    assert losses(tmp_path / "full") == losses(tmp_path / "split") and len(losses(tmp_path / "full")) == 4
    full, split = (load_file(str(tmp_path / d / "export" / "model.safetensors")) for d in ("full", "split"))
    assert full.keys() == split.keys()
    for key in full:
        assert torch.equal(full[key], split[key]), key


def test_pretrain_contrastive_with_grad_cache_resumes_exactly(tmp_path):
    """`pretrieve pretrain configs/pretrain/tiny-contrastive.yaml` on pair shards (the bundled SciFact sample's
    qrels), symmetric, with GradCache, dropout on: 4 steps in one go, and 2 steps, stopped, then resumed to 4,
    log the same losses and export the same weights."""
    from safetensors.torch import load_file

    from support import SAMPLES
    from pretrieve.data.prepare import prepare
    from pretrieve.data.prepare_options import PrepareOptions

    shards = tmp_path / "pairs"
    prepare(PrepareOptions(source="beir", inputs=[str(SAMPLES / "beir" / "scifact-sample")], out=str(shards),
                           pairs=True, qrels_split="test", workers=0))
    config = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-contrastive.yaml"
    common = [f"data.manifests=[{shards / 'manifest.json'}]", "method.grad_cache.chunk=3", "method.symmetric=true",
              "train.micro_batch_size=8", "train.max_steps=4", "checkpoint.every=2", "tracking.enabled=false"]

    def run(run_dir, *extra):
        done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(config), *common,
                               f"run_dir={run_dir}", *extra], env=pretrain_env(), capture_output=True, text=True,
                              timeout=1500)
        assert done.returncode == 0, done.stderr[-3000:]

    run(tmp_path / "full", "train.log_every=1")
    run(tmp_path / "split", "train.log_every=1", "train.stop_at=2")
    run(tmp_path / "split", "train.log_every=1", "resume=auto")

    def losses(run_dir):
        return [(r["step"], r["loss"], r["masked_text"]) for r in
                map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(tmp_path / "full") == losses(tmp_path / "split") and len(losses(tmp_path / "full")) == 4
    full, split = (load_file(str(tmp_path / d / "export" / "model.safetensors")) for d in ("full", "split"))
    for key in full:
        assert torch.equal(full[key], split[key]), key


def test_fine_tuning_dual_encoder_with_grad_cache_equals_the_batch():
    """finetune.grad_cache: the dual encoder's contrastive loss and gradients with queries and groups encoded 3
    texts at a time equal the whole batch's (dropout off)."""
    from transformers import BertConfig

    from pretrieve.finetune.models import DualEncoder
    from pretrieve.models.encoder import Encoder

    torch.manual_seed(0)
    encoder = Encoder(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    q, p = torch.randint(2000, 9000, (4, 8)), torch.randint(2000, 9000, (8, 10))
    batch = {"query_input_ids": q, "query_attention_mask": torch.ones_like(q), "passage_input_ids": p,
             "passage_attention_mask": torch.ones_like(p)}
    runs = []
    for chunk in (None, 3):
        encoder.zero_grad()
        out = DualEncoder(encoder, grad_cache=chunk)(batch)
        out["loss"].backward()
        runs.append((out["loss"], {n: t.grad.clone() for n, t in encoder.named_parameters() if t.grad is not None}))
    torch.testing.assert_close(runs[0][0], runs[1][0])
    assert runs[0][1].keys() == runs[1][1].keys() and len(runs[0][1]) > 30
    for name in runs[0][1]:
        torch.testing.assert_close(runs[1][1][name], runs[0][1][name], rtol=1e-4, atol=1e-5, msg=name)


def _problems(run, config) -> list[str]:
    from pretrieve.utils.options import ConfigError

    try:
        run(config)
    except ConfigError as e:
        return e.problems
    return []


def test_a_chunk_that_splits_no_micro_batch_is_refused_naming_its_key(tiny_bert):
    """A chunk as large as the micro-batch's largest group encodes every text twice for nothing: refused, in
    pre-training (B queries, or B x negatives texts) and fine-tuning (B x (1 + negatives) passages); an error of
    the method's own check names its key once (not `method: method.grad_cache...`)."""
    from omegaconf import OmegaConf

    from support import SAMPLES
    from pretrieve.config import load_config
    from pretrieve.finetune.config import finetune_experiment
    from pretrieve.pretrain_config import experiment

    config = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-contrastive.yaml"

    def pretrain(*overrides):  # the tiny config's manifests are absent: that error comes too, and is left out
        problems = _problems(experiment, load_config(config, ["train.micro_batch_size=16", *overrides]))
        return [p for p in problems if not p.startswith("data.manifests")]

    assert pretrain("method.grad_cache.chunk=16") == [
        "method.grad_cache.chunk: 16 >= the 16 texts of the micro-batch's largest group (train.micro_batch_size "
        "16): no chunk would split the micro-batch, and GradCache would encode every text twice for nothing; give "
        "a chunk below 16, or leave method.grad_cache out"]
    assert pretrain("method.grad_cache.chunk=15") == []
    assert pretrain("method.grad_cache.chunk=16", "method.negatives=2") == []  # 32 negatives: split in two
    assert pretrain("method.grad_cache.chunk=32", "method.negatives=2")[0].startswith(
        "method.grad_cache.chunk: 32 >= the 32 texts of the micro-batch's largest group (train.micro_batch_size "
        "16 x method.negatives 2)")
    assert pretrain("method.grad_cache.chunk=0") == ["method.grad_cache.chunk: must be an integer >= 1, got 0"]

    def finetune(chunk):
        return _problems(finetune_experiment, OmegaConf.create({
            "finetune": {"init_from": str(tiny_bert), "negatives": 1, "grad_cache": {"chunk": chunk},
                         "data": [str(SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl")]},
            "train": {"micro_batch_size": 4}}))

    assert finetune(8) == [
        "finetune.grad_cache.chunk: 8 >= the 8 passages of a micro-batch (train.micro_batch_size 4 x (1 + "
        "finetune.negatives 1)): no chunk would split the micro-batch, and GradCache would encode every text twice "
        "for nothing; give a chunk below 8, or leave finetune.grad_cache out"]
    assert finetune(7) == []
