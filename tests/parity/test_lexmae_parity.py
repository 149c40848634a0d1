"""The `lexmae` loss and gradients against the released LexMAE code (taoshen58/LexMAE, `script_lexmae.py`'s
`LexmaeLearner` over `peach/models/modeling_lexmae.py`'s `BertForEDMLM`) on identical weights and batches, with
both lexicon-importance distributions (`importance: softmax`, the released `logits`; `saturated`, `logits_sat`;
docs/methods.md, "lexmae").

    PRETRIEVE_RELEASED_LEXMAE=LEXMAE PRETRIEVE_RELEASED_LEXMAE_PYTHON=VENV/bin/python \
        pytest -m parity tests/parity/test_lexmae_parity.py

LEXMAE is a checkout of taoshen58/LexMAE; VENV a virtual environment of its own with a transformers of the code's
time (its README pins 4.11.3, which has no wheels for Python 3.11; 4.30.2 runs it) and a CPU torch, the venv
test_simlm_parity.py uses:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.30.2 "numpy<2"

Here: a tiny BERT encoder (hidden 64, 4 layers, no dropout, fp32) from seed 0, its new 2-layer decoder and the
decoder's MLM head (its bias drawn from N(0, 0.5), so that a head shared with the encoder's would show); one batch
of 8 bundled Wikipedia blocks collated by pretrieve (144 tokens, the encoder masked at 0.3, the decoder at 0.5).
pretrieve's head computes the loss and its gradients, then writes its weights under the released names
(`encoder.bert.*`, `encoder.cls.*`, `encoder.decoder_heads.<i>.*`, `encoder.decoder_cls.*`) and the batch as the
released dataset and learner take it (`masked_input_ids`, `mlm_labels`, `dec_masked_input_ids`, `dec_mlm_labels`);
lexmae_released.py, run by VENV's Python, loads them into the released learner and computes the loss and
gradients there. Asserted, for both importances: the losses and their encoder and decoder parts within 5e-7
relative (fp32 sums in another order), every one of the 111 gradients within 3e-7, the released decoder's MLM head
tied to the word embeddings (as pretrieve's), and no weight in one model that the other lacks. The record:
tests/parity/records/lexmae_reference.json.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import released
from lexmae_released import IMPORTANCES

pytestmark = pytest.mark.parity
HIDDEN, LAYERS, TEXTS, MAX_LEN, DECODER_BIAS_STD = 64, 4, 8, 144, 0.5


def pretrieve_side(importance: str, work: Path) -> dict:
    """pretrieve's loss and gradients; the weights, batch and gradients under the released names, to work/."""
    import torch

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    spec = get_method("lexmae")
    options = spec.options_from({"max_len": MAX_LEN, "importance": importance})
    model = ModelOptions(vocab_size=30522, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=512, dropout=0.0, pad_token_id=0)
    head = spec.build(options, model, seed=0).eval()
    with torch.no_grad():
        head.decoder_mlm_bias.normal_(0.0, DECODER_BIAS_STD, generator=torch.Generator().manual_seed(1))
    collate = spec.collator.from_options(options, vocab)
    samples = released.wikipedia_blocks(work, TEXTS)
    batch = collate(samples)
    out = released.loss_and_gradients(head, batch)
    names = released_names(head)
    released_batch = {"input_ids": torch.from_numpy(collate.pad(samples).ids),
                      "attention_mask": batch["attention_mask"], "masked_input_ids": batch["input_ids"],
                      "mlm_labels": batch["mlm_labels"], "dec_masked_input_ids": batch["dec_input_ids"],
                      "dec_attention_mask": batch["attention_mask"], "dec_mlm_labels": batch["dec_labels"]}
    tokens = {"mask_token_id": vocab.mask_id, "cls_token_id": vocab.cls_id, "sep_token_id": vocab.sep_id,
              "size": vocab.size}
    released.save_inputs(work / f"{importance}.pt", head, names, batch=released_batch, tokens=tokens,
                         unnamed=[k for k in head.state_dict() if k not in names and ".pooler." not in k])
    return out


def released_names(head) -> dict[str, str]:
    """pretrieve's parameter names -> LexmaeLearner's (`encoder` a BertForEDMLM)."""
    renames = (("encoder.model.", "encoder.bert."), ("encoder.mlm_transform.", "encoder.cls.predictions.transform."),
               ("encoder.mlm_bias", "encoder.cls.predictions.bias"), ("decoder.layers.", "encoder.decoder_heads."),
               ("decoder_mlm_transform.", "encoder.decoder_cls.predictions.transform."),
               ("decoder_mlm_bias", "encoder.decoder_cls.predictions.bias"))
    names = {}
    for key in head.state_dict():
        for ours, theirs in renames:
            if key.startswith(ours) and ".pooler." not in key:
                names[key] = theirs + key[len(ours):]
    return names


def test_lexmae_matches_the_released_code_with_either_importance(tmp_path):
    checkout, python = released.checkout("lexmae", "a checkout of taoshen58/LexMAE")
    ours = {importance: pretrieve_side(importance, tmp_path) for importance in IMPORTANCES}
    importance = released.compared(ours, released.run_side("lexmae", python, checkout, tmp_path))
    setup = {"hidden": HIDDEN, "layers": LAYERS, "decoder_layers": 2, "decoder_bias_std": DECODER_BIAS_STD,
             "texts": TEXTS, "max_len": MAX_LEN, "precision": "fp32", "dropout": 0.0}
    released.write_record("lexmae_reference", {"setup": setup, "importance": importance})
    for result in importance.values():
        theirs = result["released"]
        assert released.same_loss(result, ("loss", "enc", "dec")), result
        assert theirs["max_grad_diff"] <= released.GRADIENT_ATOL and theirs["params_compared"] == 111, result
        assert theirs["decoder_head_tied"], result
        assert theirs["released_grads_pretrieve_lacks"] == theirs["pretrieve_weights_unnamed"] == [], result
