"""Token losses on the labelled positions the collators hand over (models/token_targets.py, data/collators.py
`labelled_positions`), padded to a fixed count: the loss and gradients of the boolean selection of the labelled
states they replace, and train.static_shapes, which gives every step of a run the same tensor shapes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import pretrain_env, tiny_head

from pretrieve.data.collators import POSITIONS, TARGETS, labelled_positions
from pretrieve.models.token_targets import Targets, token_targets
from pretrieve.models.vocab_loss import vocab_cross_entropy


def _labels(rows: int, width: int, labelled: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    labels = np.full(rows * width, -100, dtype=np.int64)
    labels[rng.choice(rows * width, labelled, replace=False)] = rng.integers(0, 30522, labelled)
    return torch.from_numpy(labels.reshape(rows, width))


def _loss_and_grads(encoder, hidden, loss_of) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [p for _, p in encoder.token_head_parameters()] + [encoder.output_weight]
    loss = loss_of(hidden)
    return loss.detach(), [g.detach() for g in torch.autograd.grad(loss, [hidden, *params])]


def _old_style(encoder, labels, vocab_loss):
    """The loss before positions: the labelled states picked by a boolean index (each pick a read of the mask)."""
    chosen = labels != -100
    return lambda hidden: vocab_cross_entropy(encoder.mlm_transform(hidden[chosen]), encoder.output_weight,
                                              encoder.mlm_bias, labels[chosen], vocab_loss)


def _new_style(encoder, labels, slots):
    positions, targets = (torch.from_numpy(a) for a in labelled_positions(labels.numpy(), slots))
    return lambda hidden: encoder.token_loss(hidden, Targets(positions, targets))


@pytest.mark.parametrize("vocab_loss", ["plain", "chunked"])
def test_fixed_count_positions_give_the_boolean_selections_loss_and_gradients(vocab_loss):
    encoder = tiny_head("mlm", f"model.vocab_loss={vocab_loss}")[2].encoder
    encoder.vocab_loss = vocab_loss
    labels = _labels(4, 32, 19)
    hidden = torch.randn(4, 32, encoder.config.hidden_size, generator=torch.Generator().manual_seed(1),
                         requires_grad=True)
    old_loss, old_grads = _loss_and_grads(encoder, hidden, _old_style(encoder, labels, vocab_loss))
    # the count itself: the same rows in the same order through the same ops, bit for bit
    loss, grads = _loss_and_grads(encoder, hidden, _new_style(encoder, labels, None))
    assert torch.equal(loss, old_loss) and all(torch.equal(g, o) for g, o in zip(grads, old_grads))
    # padded to 128 slots (-100 at position 0): the padding rows add zeros to every sum over rows (plain's mean and
    # weight GEMM; the MLM transform's LayerNorm gradients, whose rows both paths transform), and more terms group
    # a sum differently: equal within fp32 rounding (measured: 2e-9 on gradients of 1e-2)
    _within_rounding(*_loss_and_grads(encoder, hidden, _new_style(encoder, labels, 128)), old_loss, old_grads)


def _within_rounding(loss, grads, old_loss, old_grads) -> None:
    """Within fp32 rounding: a GEMM over another number of rows may take other blocks (the states' gradient, a
    sum over 30,522 words: measured 3e-6 of its largest entry)."""
    torch.testing.assert_close(loss, old_loss, rtol=1e-6, atol=0)
    for g, o in zip(grads, old_grads):
        torch.testing.assert_close(g, o, rtol=0, atol=1e-5 * float(o.abs().max()))


def test_padding_entries_alone_give_zero_loss_and_no_gradient():
    encoder = tiny_head("mlm", "model.vocab_loss=plain")[2].encoder
    hidden = torch.randn(2, 8, encoder.config.hidden_size, requires_grad=True)
    loss, grads = _loss_and_grads(encoder, hidden, _new_style(encoder, torch.full((2, 8), -100), 6))
    assert loss == 0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_shifted_targets_are_the_sliced_selection():
    """MNTP's and Llama2Vec's token i from the state at i - 1, as the heads sliced it: hidden[:, :-1] against
    labels[:, 1:] (a label at a row's first position has no state before it)."""
    encoder = tiny_head("mlm", "model.vocab_loss=plain")[2].encoder
    labels = _labels(3, 16, 11, seed=2)
    labels[1, 0] = 7  # left out by both
    hidden = torch.randn(3, 16, encoder.config.hidden_size, requires_grad=True)
    old_loss, old_grads = _loss_and_grads(encoder, hidden, lambda h: encoder.token_loss(h[:, :-1], labels[:, 1:]))
    positions, targets = (torch.from_numpy(a) for a in labelled_positions(labels.numpy()))
    shifted = Targets(positions, targets).shifted(16)
    assert int((shifted.labels != -100).sum()) == 11 and int(shifted.positions.min()) >= 0
    # the label at [1, 0] stays an entry, ignored: a row more in the sums, within fp32 rounding as above
    _within_rounding(*_loss_and_grads(encoder, hidden, lambda h: encoder.token_loss(h, shifted)), old_loss, old_grads)


@pytest.mark.parametrize("method", ["mlm", "retromae", "mntp", "bow"])
def test_a_head_on_positions_equals_the_head_on_labels_alone(method, wiki_samples, vocab):
    """The collator's positions against the labels alone (found on the device by nonzero, as before them): the
    same loss and gradients bit for bit, and with train.static_shapes' padded positions within fp32 rounding."""
    spec, options, head = tiny_head(method, "model.vocab_loss=plain")
    collate = spec.collator.from_options(options, vocab, seed=0)
    batch = collate(wiki_samples[:6])
    assert f"mlm_labels{POSITIONS}" in batch
    labels_alone = {k: v for k, v in batch.items() if not k.endswith((POSITIONS, TARGETS)) or k == "bow_targets"}
    assert isinstance(token_targets(labels_alone, "mlm_labels"), Targets)

    def run(b):
        head.zero_grad()
        out = head(b)
        out["loss"].backward()
        return out["loss"].detach(), {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}

    head.eval()  # no dropout: the runs see the same states
    old_loss, old_grads = run(labels_alone)
    loss, grads = run(batch)
    assert torch.equal(loss, old_loss) and all(torch.equal(grads[n], g) for n, g in old_grads.items())
    collate.static_shapes = True
    static = collate(wiki_samples[:6])
    assert static["input_ids"].shape[1] == options.max_len
    assert len(static[f"mlm_labels{POSITIONS}"]) == collate.label_slots("mlm_labels", 6, options.max_len)
    loss, _ = run(static)
    torch.testing.assert_close(loss, old_loss, rtol=1e-5, atol=0)  # more padding in the encoder too


_STATIC_RUN = """
import json, sys
from pretrieve.config import load_config
from pretrieve.engine.train import run_training
from pretrieve.pretrain import pretraining_job
from pretrieve.pretrain_config import experiment

shapes = []

def job(exp, rank):
    built = pretraining_job(exp, rank)
    count = built.count
    def counted(batch):
        shapes.append({k: list(v.shape) for k, v in batch.items()})
        return count(batch)
    built.count = counted
    return built

run_training(experiment(load_config(sys.argv[1], sys.argv[2:])), job)
print(json.dumps(shapes))
"""


@pytest.mark.system  # trains in a subprocess
def test_static_shapes_give_every_step_of_a_run_the_same_batch_shapes(tmp_path, wiki_shards):
    """A short tiny pre-training on Wikipedia blocks of many lengths (up to 510 tokens): each step's batch, as
    the loop counts it, has the shapes of the first. Without the switch the same batches vary in width."""
    from pretrieve.config import load_config
    from pretrieve.pretrain import pretraining_job
    from pretrieve.pretrain_config import experiment

    config = str(Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-mlm.yaml")
    overrides = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=512",
                 "train.micro_batch_size=2", "train.max_steps=6", "train.log_every=3", "checkpoint.every=100",
                 "tracking.enabled=false", "data.num_workers=0"]
    done = subprocess.run([sys.executable, "-c", _STATIC_RUN, config, *overrides, "train.static_shapes=true",
                           f"run_dir={tmp_path / 'run'}"], env=pretrain_env(), capture_output=True, text=True,
                          check=False, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    shapes = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(shapes) == 6 and all(s == shapes[0] for s in shapes), shapes
    assert shapes[0]["input_ids"] == [2, 512]
    (tmp_path / "plain").mkdir()
    loader = pretraining_job(experiment(load_config(config, [*overrides, f"run_dir={tmp_path / 'plain'}"])), 0).loader
    widths = {batch["input_ids"].shape[1] for batch, _ in zip(loader, range(6))}
    assert len(widths) > 1, widths


def test_static_shapes_are_refused_by_key_with_unpadding(wiki_shards):
    from pretrieve.config import ConfigError, load_config
    from pretrieve.pretrain_config import experiment

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-mlm.yaml",
                         [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
                          "train.static_shapes=true", "model.unpad=true"])
    with pytest.raises(ConfigError, match=r"train\.static_shapes: model\.unpad packs"):
        experiment(config)
