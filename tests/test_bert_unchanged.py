"""BERT's losses and gradients on a fixed batch as recorded before the backbone interface: every head on the
tiny BERT configs, in training mode (dropout on), seed 0 for the weights and the masks. A method added after the
interface (`bow`) has its values recorded when it was added, to the same end.

tests/data/bert_losses.json holds the values as float.hex. On the machine that recorded them the backbone
interface reproduced them bit for bit; the test allows a relative 1e-6, so that another CPU's kernels (other
vector widths sum in another order) pass, while any change of the model, its initialisation order or the
dropout draws, which moves these numbers by far more, fails. To record them anew (only after a change meant
to alter BERT's numbers, said in its commit): PRETRIEVE_RECORD_BERT_LOSSES=1 pytest tests/test_bert_unchanged.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from test_heads import METHODS, tiny

RECORD = Path(__file__).resolve().parent / "data" / "bert_losses.json"
RECORDING = bool(os.environ.get("PRETRIEVE_RECORD_BERT_LOSSES"))


def bert_methods() -> list[str]:
    """The methods checked: those recorded; when recording, every method whose tiny config is a BERT."""
    if RECORDING:
        return [method for method in METHODS if tiny(method)[2].backbone == "bert"]
    return sorted(json.loads(RECORD.read_text()))


def losses_and_grad_norm(method: str, samples, vocab) -> dict[str, str]:
    spec, options, model = tiny(method)
    head = spec.build(options, model, seed=0)
    batch = spec.collator.from_options(options, vocab, seed=0)(samples[:8])
    if method == "cotmote":  # half the texts through the query experts
        batch["text_type"] = torch.arange(len(batch["input_ids"])) % 2
    torch.manual_seed(1)  # dropout
    out = head(batch)
    out["loss"].backward()
    grads = torch.stack([p.grad.norm() for p in head.parameters() if p.grad is not None])
    return {**{k: v.item().hex() for k, v in sorted(out.items())}, "grad_norm": grads.norm().item().hex()}


@pytest.mark.parametrize("method", bert_methods())
def test_bert_losses_and_gradients_are_unchanged(method, wiki_samples, vocab):
    got = losses_and_grad_norm(method, wiki_samples, vocab)
    if RECORDING:
        record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        record[method] = got
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    expected = {k: float.fromhex(v) for k, v in json.loads(RECORD.read_text())[method].items()}
    assert {k: float.fromhex(v) for k, v in got.items()} == pytest.approx(expected, rel=1e-6, abs=0)
