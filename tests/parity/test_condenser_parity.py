"""The `condenser` and `cocondenser` losses and gradients against the released Condenser code (luyug/Condenser) on
identical weights and batches (docs/methods.md, "The released code").

    PRETRIEVE_RELEASED_CONDENSER=DIR PRETRIEVE_RELEASED_CONDENSER_PYTHON=VENV/bin/python \
        pytest -m parity tests/parity/test_condenser_parity.py

DIR is a checkout of luyug/Condenser (its modeling.py); VENV a virtual environment of its own with the transformers
that code was written for (the repository pins none; 4.30.2 is the last release before the code's
`get_extended_attention_mask(mask, shape, device)` call stops working, and the first with tokenizers wheels for
Python 3.11) and a CPU torch:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.30.2 "numpy<2"

Here: a tiny BERT (hidden 64, 4 layers, the head reading layer 2, 2 head layers, no dropout, fp32) from seed 0,
one batch of 8 bundled Wikipedia blocks collated by pretrieve (whole-word masking 0.15; for coCondenser two spans
of each, 16 rows). pretrieve's head computes the loss and its gradients, then writes its weights (under the
released code's names: BertForMaskedLM's `bert.*` and `cls.predictions.*`, `c_head.<i>.*`), the batch and its
gradients; condenser_released.py, run by VENV's Python, loads them into the released models and computes the loss
and gradients there. Asserted: the losses within 5e-7 relative, every one of the 106 gradients within 3e-7
(Condenser) and 5e-6 (coCondenser, at the word embeddings, where 16 rows' gradients add up); and the released
coCondenser's cached (GradCache) path, run chunk by chunk as its trainer does, counting each MLM term twice (the
defect docs/methods.md lists). The record: tests/parity/records/condenser_reference.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import released
from condenser_released import HEAD_LAYERS, SKIP_FROM

pytestmark = pytest.mark.parity
HIDDEN, LAYERS, DOCS, MAX_LEN = 64, 4, 8, 128
# coCondenser's largest difference is at the word embeddings, where its 16 rows' gradients add up
GRADIENT_TOLERANCE = {"condenser": released.GRADIENT_ATOL, "cocondenser": 5e-6}


def pretrieve_side(method: str, work: Path) -> dict:
    """pretrieve's loss and gradients; the weights, batch and gradients under the released names, to work/."""
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    spec = get_method(method)
    options = spec.options_from({"max_len": MAX_LEN, "skip_from": SKIP_FROM, "head_layers": HEAD_LAYERS})
    model = ModelOptions(vocab_size=30522, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=512, dropout=0.0, pad_token_id=0)
    head = spec.build(options, model, seed=0).eval()
    collate = spec.collator.from_options(options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))
    batch = collate(released.wikipedia_blocks(work, DOCS))
    out = released.loss_and_gradients(head, batch)
    released.save_inputs(work / f"{method}.pt", head, released_names(head),
                         batch={k: batch[k] for k in ("input_ids", "attention_mask", "mlm_labels")})
    return out


def released_names(head) -> dict[str, str]:
    """pretrieve's parameter names -> the released model's (BertForMaskedLM inside `lm`, the head as `c_head`)."""
    names = {}
    for key in head.state_dict():
        if key.startswith("encoder.model.") and ".pooler." not in key:
            names[key] = "lm.bert." + key[len("encoder.model."):]
        elif key.startswith("encoder.mlm_transform."):
            names[key] = "lm.cls.predictions.transform." + key[len("encoder.mlm_transform."):]
        elif key == "encoder.mlm_bias":
            names[key] = "lm.cls.predictions.bias"
        elif key.startswith("head.layers."):
            names[key] = "c_head." + key[len("head.layers."):]
    return names


def test_condenser_and_cocondenser_match_the_released_code(tmp_path):
    checkout, python = released.checkout("condenser", "a checkout of luyug/Condenser")
    ours = {method: pretrieve_side(method, tmp_path) for method in GRADIENT_TOLERANCE}
    methods = released.compared(ours, released.run_side("condenser", python, checkout, tmp_path))
    setup = {"hidden": HIDDEN, "layers": LAYERS, "skip_from": SKIP_FROM, "head_layers": HEAD_LAYERS,
             "documents": DOCS, "max_len": MAX_LEN, "precision": "fp32", "dropout": 0.0}
    released.write_record("condenser_reference", {"setup": setup, "methods": methods})
    for method, tolerance in GRADIENT_TOLERANCE.items():
        result = methods[method]
        assert released.same_loss(result) and result["released"]["max_grad_diff"] <= tolerance, result
        assert result["released"]["params_compared"] == 106, result
    # the released trainer scales each chunk's MLM loss by rows / per-device batch, with two spans a document on a
    # device: its chunks add up to twice the MLM terms
    cached = methods["cocondenser"]["released"]["cached_path_mlm"]
    assert cached["ratio"] == pytest.approx(2, abs=1e-3), cached
