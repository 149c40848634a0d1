"""The released side of tests/parity/test_lexmae_parity.py, run by the released code's venv (the standard library,
torch and transformers; a taoshen58/LexMAE checkout on PYTHONPATH):

    python lexmae_released.py WORK

builds `LexmaeLearner` (script_lexmae.py) on `BertForEDMLM` (peach/models/modeling_lexmae.py) for each lexicon
importance, loads the weights and batch the test wrote to WORK, and prints the losses and gradients as one JSON
line. Its `peach.base`, imported for the training loop's names only, is stood in for (it imports accelerate,
datasets and tensorboard); and DistilBERT's `gelu`, which transformers 4.30 no longer exports, is given from
transformers.activations.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

IMPORTANCES = {"softmax": "logits", "saturated": "logits_sat"}  # pretrieve's option -> --dec_mlm_bottleneck_src


def released_side(work: str) -> None:
    """LexmaeLearner's losses and gradients for pretrieve's weights and batches."""
    import types

    import torch
    from transformers import BertConfig

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


if __name__ == "__main__":
    released_side(sys.argv[1])
