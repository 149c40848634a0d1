"""Bag-of-words prediction ("Drop your Decoder", Ma et al. 2024, §3; no equation numbers: the paper's text was not
available, the loss is the released code's, docs/methods.md "bow"), each part against a hand computation: the
targets (the unmasked input's set of ordinary tokens, special tokens out), the [CLS] state through the MLM head
written out, the uniform target distribution, the BoW weight's cosine over training, and the training loop
handing the head its step, so that a resumed run repeats the uninterrupted one's losses bit for bit."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from support import pretrain_stopped_and_resumed
from pretrieve.config import load_config
from pretrieve.models.heads.bow import cosine_decay
from pretrieve.pretrain_config import method_options, model_options

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def tiny_bow(*overrides):
    config = load_config(CONFIGS / "tiny-bow.yaml", ["model.dropout=0.0", *overrides])
    method, options = method_options(config)
    return method, options, method.build(options, model_options(config), seed=0).eval()


def test_targets_are_the_unmasked_inputs_set_of_ordinary_tokens_without_special_ones(vocab):
    """A text with a repeated word, a word masking may hide and an unknown character: each of its ordinary ids
    once, [UNK] left out (the released rule, ids <= 998 of bert-base-uncased, drops it too); a stream pad sample
    has none."""
    method, options, _ = tiny_bow("method.mlm_ratio=0.5")
    text = vocab.backend.encode("the cat saw the dog \u2603 near the cat", add_special_tokens=False).ids
    unk = vocab.backend.token_to_id("[UNK]")
    assert unk in text and vocab.special[unk]
    samples = [{"ids": np.array(text)}, {"ids": np.array(text[:3]), "pad": True}]
    batch = method.collator.from_options(options, vocab, seed=0)(samples)
    assert (batch["mlm_labels"][0] != -100).any()  # some tokens masked: the targets are still the unmasked ids
    targets = batch["bow_targets"]
    assert sorted(targets[0][targets[0] != -100].tolist()) == sorted(set(text) - {unk})
    assert (targets[1] == -100).all()
    assert sorted(set(text) - {unk}) == sorted(i for i in set(text) if i > 998)  # the released rule, this vocabulary


def test_loss_by_hand(wiki_samples, vocab):
    """L_bow: the [CLS] state through the MLM head (dense, GELU, LayerNorm, tied output weights, bias) written
    out, log-softmax over the vocabulary, minus the mean log-probability of the text's target set, averaged over
    texts; the total adds L_mlm and bow_weight x s(t) x L_bow."""
    method, options, head = tiny_bow("method.bow_weight=0.7")
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    head.set_step(3, 10)
    out = head(batch)
    hidden = head.encoder(batch["input_ids"], batch["attention_mask"])[:, 0].double()
    transform = head.encoder.mlm_transform
    x = hidden @ transform.dense.weight.double().T + transform.dense.bias.double()
    x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True)
                                                    + transform.LayerNorm.eps)
    x = x * transform.LayerNorm.weight.double() + transform.LayerNorm.bias.double()
    logits = x @ head.encoder.word_embeddings.weight.double().T + head.encoder.mlm_bias.double()
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    per_text = []
    for row, targets in enumerate(batch["bow_targets"]):
        kept = targets[targets != -100]
        per_text.append(-log_p[row, kept].sum() / len(kept))
    by_hand = torch.stack(per_text).mean()
    assert out["bow"].item() == pytest.approx(by_hand.item(), rel=1e-5)
    scale = 0.1 + 0.9 * (1 + math.cos(math.pi * 3 / 10)) / 2
    assert out["loss"].item() == pytest.approx(out["mlm"].item() + 0.7 * scale * by_hand.item(), rel=1e-5)


def test_the_bow_weight_decays_by_half_a_cosine():
    assert cosine_decay(0, 100, 0.1) == 1.0
    assert cosine_decay(50, 100, 0.1) == pytest.approx(0.55)
    assert cosine_decay(100, 100, 0.1) == pytest.approx(0.1)
    assert cosine_decay(150, 100, 0.1) == pytest.approx(0.1)  # past the end: the final value
    assert cosine_decay(37, 100, 1.0) == 1.0  # bow_decay_to 1: constant


def test_special_tokens_never_count_and_the_loss_is_finite_without_targets(vocab):
    """A batch of stream pad samples: no targets, a zero BoW loss that still has a graph."""
    method, options, head = tiny_bow()
    batch = method.collator.from_options(options, vocab, seed=0)([{"ids": np.arange(1000, 1010), "pad": True}])
    out = head(batch)
    assert out["bow"].item() == 0.0 and out["loss"].requires_grad
    out["loss"].backward()


def _bow_losses(records, max_steps, decay_to=0.1):
    """Each logged step's loss - mlm over its bow part: s(t) of the step the loop handed the head."""
    return [(r["loss"] - r["mlm"]) / r["bow"] for r in records], \
        [cosine_decay(k, max_steps, decay_to) for k in range(len(records))]


@pytest.mark.integration
def test_the_loop_hands_the_head_its_step_and_a_resume_repeats_it(tmp_path, wiki_shards):
    """`pretrieve pretrain` of tiny-bow, 4 steps: every logged loss is mlm + s(t) x bow at that step's t; a run
    stopped at step 2 and resumed in a fresh process logs the uninterrupted run's losses and lr bit for bit (not the
    timings and the gradient norm: a fresh process's first backward may round a last bit otherwise, as
    tests/test_engine.py says) and exports the same weights."""
    common = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
              "checkpoint.every=2", "train.log_every=1", "train.max_steps=4", "tracking.enabled=false"]
    pretrain_stopped_and_resumed(CONFIGS / "tiny-bow.yaml", [f"run_dir={tmp_path / 'full'}", *common],
                                 [f"run_dir={tmp_path / 'split'}", *common, "train.stop_at=2"], timeout=600)

    def records(name):
        return [{k: v for k, v in json.loads(line).items() if k in ("step", "loss", "mlm", "bow", "lr")}
                for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    full, split = records("full"), records("split")
    assert [r["step"] for r in split] == [1, 2, 3, 4] and split == full
    scales, expected = _bow_losses(full, 4)
    assert scales == pytest.approx(expected, rel=1e-4) and expected[-1] < 0.3
    from safetensors.torch import load_file

    for name in ("model.safetensors", "pretrieve_head.safetensors"):
        ours, reference = load_file(tmp_path / "split" / "export" / name), load_file(tmp_path / "full" / "export" / name)
        assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)

