"""The `simlm` loss and gradients against the released SimLM code (microsoft/unilm, `simlm/src/models/rlm.py`,
`ReplaceLM`) on identical weights and batches, with the generator frozen (the released recipe) and trained; and
the two collators' masks (docs/methods.md, "simlm").

    PRETRIEVE_RELEASED_SIMLM=UNILM/simlm PRETRIEVE_RELEASED_SIMLM_PYTHON=VENV/bin/python \
        pytest -m parity tests/parity/test_simlm_parity.py

UNILM/simlm is the `simlm` folder of a checkout of microsoft/unilm; VENV a virtual environment of its own with a
transformers of the code's time (its README pins 4.15, which has no wheels for Python 3.11; 4.30.2 runs it) and a
CPU torch:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.30.2 "numpy<2"

Here: a tiny BERT encoder (hidden 64, 4 layers, no dropout, fp32) from seed 0, its 2-layer decoder copied from its
last layers, a tiny BERT generator (hidden 32, 2 layers) whose MLM bias puts 50 on "the", so that its draws, which
the two codes take from different random streams, are "the" at every masked position on both sides (that the draws
follow the generator's distribution is tests/test_equations_simlm.py's); one batch of 8 bundled Wikipedia blocks
collated by pretrieve (144 tokens, the encoder masked at 0.3, the decoder at 0.5). pretrieve's head computes the
loss and its gradients, then writes its weights under the released names (`encoder.bert.*`, `encoder.cls.*`,
`decoder.<i>.*`, `generator.bert.*`, `generator.cls.*`) and the batch as the released collator lays it out (`enc_`,
`dec_` and `labels`); simlm_released.py, run by VENV's Python, loads them into the released `ReplaceLM` and
computes the loss and gradients there. Asserted, for both generator settings: the losses within 5e-7 relative and
every gradient within 3e-7 (106 tensors frozen, 148 trained), no gradient on a weight pretrieve lacks.

The loss comparison reads one batch, pretrieve's collator's, on both sides, and forces the generator's draws to
one token: it compares the head, not the collators nor the draws. The collators are compared apart, on what
needs no shared random stream: the released `DataCollatorForReplaceLM` (`--all_use_mask_token`) and pretrieve's
each mask the same texts (the 8 blocks as text, and one with [UNK]s) 50 times. Asserted: on every block both
fill the encoder's budget round(0.3 x n) (n with [CLS] and [SEP]) in every draw, pretrieve's on the [UNK] text too,
and the released one's there less (it draws the [UNK]s, then unmasks them); the decoders mask half of the tokens
(within 0.02); neither masks an [UNK]. The record: tests/parity/records/simlm_reference.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import released
import simlm_released as side

pytestmark = pytest.mark.parity
HIDDEN, LAYERS, GENERATOR_HIDDEN, TEXTS, PEAK = 64, 4, 32, 8, 50.0
UNK_TEXT = "the cat \u2603 sat on the \U0001F600 mat near the \u2603 dog " * 4  # 12 [UNK]s among 48 tokens
PARAMS_COMPARED = {"frozen": 106, "trained": 148}  # the trained generator's weights have gradients too


def save_generator(path: Path, vocab) -> None:
    """A random tiny BertForMaskedLM whose MLM bias makes "the" its every draw."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(1)
    model = BertForMaskedLM(BertConfig(hidden_size=GENERATOR_HIDDEN, num_hidden_layers=2, num_attention_heads=1,
                                       intermediate_size=4 * GENERATOR_HIDDEN, pad_token_id=0))
    with torch.no_grad():
        model.cls.predictions.bias[vocab.tokens.index("the")] = PEAK
    model.save_pretrained(str(path))


def pretrieve_side(setting: str, work: Path) -> dict:
    """pretrieve's loss and gradients; the weights, batch and gradients under the released names, to work/."""
    import torch

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    if not (work / "generator" / "config.json").is_file():
        save_generator(work / "generator", vocab)
    spec = get_method("simlm")
    options = spec.options_from({"max_len": side.MAX_LEN, "generator_init": str(work / "generator"),
                                 "freeze_generator": side.SETTINGS[setting]})
    model = ModelOptions(vocab_size=30522, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=512, dropout=0.0, pad_token_id=0)
    head = spec.build(options, model, seed=0).eval()
    collate = spec.collator.from_options(options, vocab)
    samples = released.wikipedia_blocks(work, TEXTS)
    batch = collate(samples)
    out = released.loss_and_gradients(head, batch)
    original = torch.from_numpy(collate.pad(samples).ids)
    released_batch = {"enc_input_ids": batch["input_ids"], "enc_attention_mask": batch["attention_mask"],
                      "enc_labels": batch["mlm_labels"], "dec_input_ids": batch["dec_input_ids"],
                      "dec_attention_mask": batch["attention_mask"],
                      "dec_labels": torch.where(batch["dec_masked"], original, -100), "labels": batch["rlm_labels"]}
    released.save_inputs(work / f"{setting}.pt", head, released_names(head), batch=released_batch)
    return out


def released_names(head) -> dict[str, str]:
    """pretrieve's parameter names -> ReplaceLM's (BertForMaskedLM as `encoder` and `generator`, the decoder's
    layers as `decoder.<i>`)."""
    names = {}
    for key in head.state_dict():
        for ours, theirs in (("encoder", "encoder"), ("generator", "generator")):
            if key.startswith(f"{ours}.model.") and ".pooler." not in key:
                names[key] = f"{theirs}.bert." + key[len(f"{ours}.model."):]
            elif key.startswith(f"{ours}.mlm_transform."):
                names[key] = f"{theirs}.cls.predictions.transform." + key[len(f"{ours}.mlm_transform."):]
            elif key == f"{ours}.mlm_bias":
                names[key] = f"{theirs}.cls.predictions.bias"
        if key.startswith("decoder.layers."):
            names[key] = "decoder." + key[len("decoder.layers."):]
    return names


def write_collator_texts(work: Path) -> None:
    """The texts both collators mask, to work/texts.json: the batch's blocks as text, and UNK_TEXT."""
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

    backend = load_backend(DEFAULT_TOKENIZER)
    blocks = released.wikipedia_blocks(work, TEXTS)
    texts = [backend.decode(s["ids"][:side.MAX_LEN - 2].tolist()) for s in blocks] + [UNK_TEXT]
    (work / "texts.json").write_text(json.dumps(texts))


def pretrieve_collator(work: Path) -> dict:
    """mask_statistics of pretrieve's SimLMCollator on work/texts.json, DRAWS collations."""
    import numpy as np

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.heads.simlm import SimLMCollator

    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    samples = [{"ids": np.array(vocab.encode(text))} for text in json.loads((work / "texts.json").read_text())]
    draws, batch = [], None
    for draw in range(side.DRAWS):
        batch = SimLMCollator(vocab, max_len=side.MAX_LEN, mlm_ratio=side.ENCODER_RATIO,
                              decoder_mask_ratio=side.DECODER_RATIO, seed=draw)(samples)
        draws.append(((batch["mlm_labels"] != -100).int().tolist(), batch["dec_masked"].int().tolist()))
    lengths = batch["attention_mask"].sum(1).tolist()
    original = np.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"])
    return side.mask_statistics(lengths, (original == vocab.backend.token_to_id("[UNK]")).tolist(), draws)


def test_simlm_matches_the_released_code_with_the_generator_frozen_and_trained(tmp_path):
    checkout, python = released.checkout("simlm", "the simlm folder of a microsoft/unilm checkout")
    write_collator_texts(tmp_path)
    ours = {setting: pretrieve_side(setting, tmp_path) for setting in side.SETTINGS}
    generator = released.compared(ours, released.run_side("simlm", python, checkout / "src", tmp_path))
    collators = {"pretrieve": pretrieve_collator(tmp_path),
                 "released": json.loads((tmp_path / "released_collator.json").read_text())}
    setup = {"hidden": HIDDEN, "layers": LAYERS, "decoder_layers": 2, "generator_hidden": GENERATOR_HIDDEN,
             "generator_peak": PEAK, "texts": TEXTS, "max_len": side.MAX_LEN, "precision": "fp32", "dropout": 0.0}
    released.write_record("simlm_reference", {"setup": setup, "generator": generator, "collators": collators})
    for setting, result in generator.items():
        assert released.same_loss(result) and result["released"]["max_grad_diff"] <= released.GRADIENT_ATOL, result
        assert result["released"]["params_compared"] == PARAMS_COMPARED[setting], result
        assert result["released"]["released_grads_pretrieve_lacks"] == [], result

    ours, theirs = collators["pretrieve"], collators["released"]
    assert ours["encoder_masked"] == ours["budgets"] and ours["filled_share"] == 1, ours
    assert theirs["encoder_masked"][:TEXTS] == theirs["budgets"][:TEXTS], theirs  # every block, every draw
    assert theirs["encoder_masked"][TEXTS] < theirs["budgets"][TEXTS], theirs  # the [UNK] text's unmasked [UNK]s
    for collator in (ours, theirs):
        assert collator["decoder_share"] == pytest.approx(side.DECODER_RATIO, abs=0.02), collator
        assert collator["unk_masked"] == 0, collator
