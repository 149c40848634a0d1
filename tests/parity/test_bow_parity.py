"""pretrieve's `bow` head against the released bag-of-words prediction code ("Drop your Decoder", caskcsg/ir
`bowdpr`) on identical weights and batches (docs/methods.md, "bow").

    PRETRIEVE_RELEASED_BOW=IR_CHECKOUT PRETRIEVE_RELEASED_BOW_PYTHON=REF_VENV/bin/python \
        pytest -m parity tests/parity/test_bow_parity.py

IR_CHECKOUT: a clone of github.com/caskcsg/ir at e64a12a898f526231b017e09d20aa363259693cf, the last commit that
holds `bowdpr/` (later ones replace it by a submodule). REF_VENV: a venv of the released code's own stack, which
pins no versions; one of the paper's time: `python -m venv REF_VENV && REF_VENV/bin/pip install torch==2.13.0
transformers==4.36.2`.

A tiny BERT (tiny-bow.yaml's shape) is built by pretrieve, its weights written as a `BertForMaskedLM` state dict,
and a batch of the bundled Wikipedia sample collated by pretrieve's `BoWCollator`. bow_released.py, run by
REF_VENV's Python, loads both into `BertForBoWPrediction` (src/bowdpr/pretrain/modeling.py), computes its
bag-of-words weights with the released collator's own `_get_bow_weights` from the same unmasked texts, and its loss
scale with the released trainer's cosine (scheduler.py) at a few steps. Both run in eval mode (no dropout), forward
and backward. Asserted: each loss part, the total at each step, and the gradient norms of the word embeddings and
of the whole model agree within 2e-7 relative. The record: tests/parity/records/bowdpr_reference.json.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import released
import torch

pytestmark = pytest.mark.parity
RELEASED_COMMIT = "e64a12a898f526231b017e09d20aa363259693cf"  # caskcsg/ir's last commit that holds bowdpr/
STEPS = (0, 250, 500, 1000)  # of MAX_STEPS: the BoW weight's cosine at its start, a quarter, half, end
MAX_STEPS, TEXTS = 1000, 8
PARTS = ("mlm", "bow", "grad_norm_word_embeddings", "grad_norm")


def bert_for_masked_lm_weights(head) -> dict[str, torch.Tensor]:
    """The head's encoder as `BertForMaskedLM` names it (the pooler dropped: BertForMaskedLM has none)."""
    out = {}
    for name, value in head.state_dict().items():
        if name.startswith("encoder.model.pooler."):
            continue
        name = (name.replace("encoder.model.", "bert.", 1).replace("encoder.mlm_transform.", "cls.predictions.transform.")
                .replace("encoder.mlm_bias", "cls.predictions.bias"))
        out[name] = value.detach().clone()
    return out


def wikipedia_samples(count: int, backend) -> list[dict]:
    """The first `count` articles of the bundled Wikipedia sample, tokenized (stream samples' `ids`), cut to
    lengths from 20 tokens up, so that the batch has padding."""
    path = min((released.ROOT / "pretrieve" / "assets" / "samples" / "wikipedia").glob("*.jsonl.gz"))
    with gzip.open(path, "rt") as lines:
        texts = [json.loads(next(lines))["text"] for _ in range(count)]
    return [{"ids": np.array(backend.encode(t, add_special_tokens=False).ids[:20 + 15 * i], dtype=np.int64),
             "index": i} for i, t in enumerate(texts)]


def pretrieve_side(head, batch: dict) -> dict:
    """The quantities the released side computes, from pretrieve's head."""
    out = {"total": {}}
    for step in STEPS:
        head.set_step(step, MAX_STEPS)
        head.zero_grad()
        result = head(batch)
        out["total"][str(step)] = result["loss"].item()
        if step == 0:
            result["loss"].backward()
            out["mlm"], out["bow"] = result["mlm"].item(), result["bow"].item()
            out["grad_norm_word_embeddings"] = head.encoder.word_embeddings.weight.grad.norm().item()
            out["grad_norm"] = float(sum(p.grad.pow(2).sum() for p in head.parameters() if p.grad is not None) ** 0.5)
    return out


def given_to_released(head, options, batch: dict, unmasked: list[list[int]]) -> dict:
    """What the released side reads: the encoder's config and weights, the batch and its unmasked texts, the steps."""
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    hf = head.encoder.config
    return {"config": {k: getattr(hf, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                    "num_attention_heads", "intermediate_size",
                                                    "max_position_embeddings", "pad_token_id")}
            | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
            "weights": bert_for_masked_lm_weights(head), "vocab_file": str(Path(DEFAULT_TOKENIZER) / "vocab.txt"),
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "mlm_labels": batch["mlm_labels"], "texts": unmasked, "steps": list(STEPS), "max_steps": MAX_STEPS,
            "decay_to": options.bow_decay_to}


def test_bow_matches_the_released_code(tmp_path):
    from pretrieve.config import load_config
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.pretrain_config import method_options, model_options

    checkout, python = released.checkout("bow", f"a checkout of caskcsg/ir at {RELEASED_COMMIT} (it holds bowdpr/)")
    source = checkout / "bowdpr" / "src"
    if not (source / "bowdpr" / "pretrain" / "modeling.py").is_file():
        pytest.fail(f"PRETRIEVE_RELEASED_BOW={checkout}: no bowdpr/src/bowdpr/pretrain/modeling.py (check out "
                    f"{RELEASED_COMMIT})")
    config = load_config(released.ROOT / "configs" / "pretrain" / "tiny-bow.yaml", ["model.dropout=0.0"])
    method, options = method_options(config)
    head = method.build(options, model_options(config), seed=0).eval()
    backend = load_backend(DEFAULT_TOKENIZER)
    collate = method.collator.from_options(options, Vocabulary.from_backend(backend), seed=0)
    samples = wikipedia_samples(TEXTS, backend)
    batch = collate(samples)
    lengths = batch["attention_mask"].sum(dim=1)
    unmasked = [[collate.vocab.cls_id, *s["ids"][:int(n) - 2].tolist(), collate.vocab.sep_id]
                for s, n in zip(samples, lengths)]
    ours = pretrieve_side(head, batch)
    torch.save(given_to_released(head, options, batch, unmasked), tmp_path / "given.pt")
    theirs = released.run_side("bow", python, source, tmp_path)

    def diff(a, b):
        return abs(a - b) / max(abs(b), 1e-12)

    differences = {**{k: diff(ours[k], theirs[k]) for k in PARTS},
                   "total": max(diff(ours["total"][s], theirs["total"][s]) for s in ours["total"])}
    released.write_record("bowdpr_reference", {
        "texts": TEXTS, "tokens": int(lengths.sum()), "shape": "tiny-bow (hidden 64, 2 layers), fp32, eval",
        "released_transformers": theirs.pop("transformers"), "torch": torch.__version__,
        "pretrieve": {k: ours[k] for k in (*PARTS, "total")}, "released": theirs,
        "max_relative_difference": differences}, indent=1)
    assert all(d <= 2e-7 for d in differences.values()), differences
