"""The `lexmae` loss and gradients against the released LexMAE code (taoshen58/LexMAE, `script_lexmae.py`'s
`LexmaeLearner` over `peach/models/modeling_lexmae.py`'s `BertForEDMLM`) on identical weights and batches, with
both lexicon-importance distributions (`importance: softmax`, the released `logits`; `saturated`, `logits_sat`).

    python benchmarks/lexmae_reference.py --released LEXMAE --python VENV/bin/python \
        [--out benchmarks/results/lexmae_reference.json]

LEXMAE is a checkout of taoshen58/LexMAE; VENV a virtual environment of its own with a transformers of the code's
time (its README pins 4.11.3, which has no wheels for Python 3.11; 4.30.2 runs it) and a CPU torch, the venv
simlm_reference.py uses:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.30.2 "numpy<2"

Here: a tiny BERT encoder (hidden 64, 4 layers, no dropout, fp32) from seed 0, its new 2-layer decoder and the
decoder's MLM head (its bias drawn from N(0, 0.5), so that a head shared with the encoder's would show); one batch
of 8 bundled Wikipedia blocks collated by pretrieve (144 tokens, the encoder masked at 0.3, the decoder at 0.5).
pretrieve's head computes the loss and its gradients, then writes its weights under the released names
(`encoder.bert.*`, `encoder.cls.*`, `encoder.decoder_heads.<i>.*`, `encoder.decoder_cls.*`) and the batch as the
released dataset and learner take it (`masked_input_ids`, `mlm_labels`, `dec_masked_input_ids`, `dec_mlm_labels`);
this file, run by VENV's Python (`--released-side`), builds `LexmaeLearner` on `BertForEDMLM` (its `peach.base`,
imported for the training loop's names only, stood in for: it imports accelerate, datasets and tensorboard; and
DistilBERT's `gelu`, which transformers 4.30 no longer exports, given from transformers.activations), loads them and
computes the loss and gradients there. The JSON holds both losses and parts, and the largest gradient
difference, for each importance, plus the training FLOPs of lexmae against mlm and retromae at BERT-base
(engine.flops).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import released_code
from simlm_reference import flops_against_mlm, forward_backward

HIDDEN, LAYERS, TEXTS, MAX_LEN, DECODER_BIAS_STD = 64, 4, 8, 144, 0.5
IMPORTANCES = {"softmax": "logits", "saturated": "logits_sat"}  # pretrieve's option -> --dec_mlm_bottleneck_src


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
    samples, batch, out = forward_backward(head, collate, work, TEXTS)
    names = released_names(head)
    released_batch = {"input_ids": torch.from_numpy(collate.pad(samples).ids),
                      "attention_mask": batch["attention_mask"], "masked_input_ids": batch["input_ids"],
                      "mlm_labels": batch["mlm_labels"], "dec_masked_input_ids": batch["dec_input_ids"],
                      "dec_attention_mask": batch["attention_mask"], "dec_mlm_labels": batch["dec_labels"]}
    tokens = {"mask_token_id": vocab.mask_id, "cls_token_id": vocab.cls_id, "sep_token_id": vocab.sep_id,
              "size": vocab.size}
    torch.save({"state": {names[k]: v for k, v in head.state_dict().items() if k in names},
                "grads": {names[k]: p.grad for k, p in head.named_parameters() if k in names and p.grad is not None},
                "unnamed": [k for k in head.state_dict() if k not in names and ".pooler." not in k],
                "config": head.encoder.config.to_dict(), "batch": released_batch, "tokens": tokens},
               work / f"{importance}.pt")
    return {k: v.item() for k, v in out.items()}


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


def released_side(released: str, work: str) -> None:
    """Run by the released code's venv: LexmaeLearner's losses and gradients for pretrieve's weights and batches."""
    import types

    import torch
    from transformers import BertConfig

    sys.path.insert(0, str(Path(released)))
    # script_lexmae's `from peach.base import *` brings the training loop's names (accelerate, datasets,
    # tensorboard), which the learner's forward does not use: an empty module stands in for it
    sys.modules["peach.base"] = types.ModuleType("peach.base")
    # transformers 4.11's distilbert module exported `gelu`, which modeling_lexmae imports for its DistilBERT class
    # (unused here); later versions keep it in transformers.activations
    from transformers.activations import gelu
    from transformers.models.distilbert import modeling_distilbert

    modeling_distilbert.gelu = gelu
    from peach.models.modeling_lexmae import BertForEDMLM
    from script_lexmae import LexmaeLearner

    class Tokenizer:  # what the learner reads of its tokenizer
        def __init__(self, tokens):
            self.mask_token_id, self.cls_token_id = tokens["mask_token_id"], tokens["cls_token_id"]
            self.sep_token_id, self.size = tokens["sep_token_id"], tokens["size"]

        def __len__(self):
            return self.size

    results = {}
    for importance, source in IMPORTANCES.items():
        saved = torch.load(Path(work) / f"{importance}.pt")
        config = BertConfig(**{k: v for k, v in saved["config"].items()
                               if k not in ("architectures", "dtype", "torch_dtype")})
        config.n_head_layers, config.skip_from, config.disable_bottleneck = 2, None, False
        config.dec_mlm_bottleneck_src = source
        args = types.SimpleNamespace(mlm_enc_loss_weight=1.0, mlm_dec_loss_weight=1.0, data_mlm_prob=0.30,
                                     enc_mlm_prob=0.0, dec_mlm_prob=0.50, dec_mlm_overlap="inclusive")
        model = LexmaeLearner(args, config, Tokenizer(saved["tokens"]), BertForEDMLM(config))
        result = model.load_state_dict(saved["state"], strict=False)
        params = dict(model.named_parameters())
        missing = [k for k in result.missing_keys if k in params]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
        model.eval()
        out = model(training_mode="pre-training", **saved["batch"])
        out["loss"].backward()
        worst = max((float((params[name].grad - grad).abs().max()), name) for name, grad in saved["grads"].items())
        no_grad = [name for name, p in params.items() if p.grad is not None and name not in saved["grads"]]
        embeddings = model.encoder.bert.embeddings.word_embeddings.weight
        results[importance] = {"loss": out["loss"].item(), "enc": out["mlm_enc_loss"].item(),
                               "dec": out["mlm_dec_loss"].item(), "max_grad_diff": worst[0],
                               "max_grad_diff_at": worst[1], "params_compared": len(saved["grads"]),
                               "released_grads_pretrieve_lacks": no_grad,
                               "pretrieve_weights_unnamed": saved["unnamed"],
                               "decoder_head_tied": model.encoder.decoder_cls.predictions.decoder.weight is embeddings}
    print(json.dumps(results))


def main() -> int:
    setup = {"hidden": HIDDEN, "layers": LAYERS, "decoder_layers": 2, "decoder_bias_std": DECODER_BIAS_STD,
             "texts": TEXTS, "max_len": MAX_LEN, "precision": "fp32", "dropout": 0.0}
    return released_code.main(__file__, __doc__, "a checkout of taoshen58/LexMAE", "lexmae_reference.json",
                              released_side,
                              lambda work: {importance: pretrieve_side(importance, work) for importance in IMPORTANCES},
                              "importance", setup,
                              lambda work: {"train_flops_against_mlm_bert_base":
                                            flops_against_mlm(work, ("mlm", "retromae", "lexmae"))})


if __name__ == "__main__":
    sys.exit(main())
