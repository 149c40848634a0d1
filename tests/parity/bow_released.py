"""The released side of tests/parity/test_bow_parity.py, run by the released code's venv (the standard library, torch
and transformers; caskcsg/ir's bowdpr/src on PYTHONPATH):

    python bow_released.py WORK

loads the config, weights and batch the test wrote to WORK/given.pt into the released `BertForBoWPrediction`
(eval mode), takes the bag-of-words weights from the released collator's own `_get_bow_weights` on the same
unmasked texts and the loss scale from the released trainer's cosine at the given steps, and prints each loss
part, the total at each step and the gradient norms as one JSON line.
"""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path


def released_side(work: str) -> None:
    import torch
    import transformers
    from bowdpr.pretrain.arguments import DataTrainingArguments, ModelArguments
    from bowdpr.pretrain.data_utils import BoWPredictionCollator
    from bowdpr.pretrain.modeling import BertForBoWPrediction
    from bowdpr.scheduler import (
        _get_cosine_schedule_with_warmup_lr_lambda_minlr as cosine,
    )
    from transformers import BertConfig, BertForMaskedLM, BertTokenizer

    given = torch.load(Path(work) / "given.pt")
    bert = BertForMaskedLM(BertConfig(**given["config"]))
    missing, unexpected = bert.load_state_dict(given["weights"], strict=False)
    assert not unexpected and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, \
        missing
    train_args = types.SimpleNamespace(bow_factor_cosine_decay_to=given["decay_to"])  # what forward reads of them
    model = BertForBoWPrediction(bert, ModelArguments(enable_dec_bow_loss=True), DataTrainingArguments(), train_args)
    model.eval()
    collator = BoWPredictionCollator(tokenizer=BertTokenizer(given["vocab_file"], do_lower_case=True))
    encoder_input = {"input_ids": given["input_ids"], "attention_mask": given["attention_mask"],
                     "labels": given["mlm_labels"]}
    bow_weights = collator._get_bow_weights(encoder_input, given["texts"])
    out = {"total": {}}
    for step in given["steps"]:
        model.scaling_factor = cosine(current_step=step, num_warmup_steps=0, num_training_steps=given["max_steps"],
                                      num_cycles=0.5, min_lr_ratio=given["decay_to"])
        model.zero_grad()
        result = model(encoder_input=encoder_input, bow_weights=bow_weights)
        out["total"][str(step)] = result.loss.item()
        if step == 0:
            result.loss.backward()
            out["mlm"], out["bow"] = result.logs["bert_mlm_loss"], result.logs["dec_bow_loss"]
            out["grad_norm_word_embeddings"] = bert.bert.embeddings.word_embeddings.weight.grad.norm().item()
            out["grad_norm"] = math.sqrt(sum(p.grad.pow(2).sum().item() for p in model.parameters()
                                             if p.grad is not None))
    out["transformers"] = transformers.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    released_side(sys.argv[1])
