"""The released side of tests/parity/test_simlm_parity.py, run by the released code's venv (the standard library,
torch and transformers; the src folder of microsoft/unilm's simlm on PYTHONPATH):

    python simlm_released.py WORK

imports the released `ReplaceLM` (its trainer module, imported for a type annotation, stood in for), loads the
weights and batch the test wrote to WORK and prints the losses and gradients for each generator setting as one
JSON line; and masks the texts of WORK/texts.json with the released `DataCollatorForReplaceLM`, its statistics to
WORK/released_collator.json. `mask_statistics` serves both sides' collators.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_LEN = 144
SETTINGS = {"frozen": True, "trained": False}  # the generator: --rlm_freeze_generator
DRAWS, ENCODER_RATIO, DECODER_RATIO = 50, 0.3, 0.5  # the collators' comparison: collations of the same texts
TOKENIZER = Path(__file__).resolve().parents[2] / "pretrieve" / "assets" / "tokenizer"


def mask_statistics(lengths: list[int], unknown: list[list[bool]], draws: list[tuple[list, list]]) -> dict:
    """What the collators' comparison reports of `draws` (the encoder's and the decoder's masks, lists of rows of
    0/1, per collation) of texts of `lengths` tokens ([CLS] and [SEP] counted) whose [UNK]s are `unknown`."""
    budgets = [max(1, round(ENCODER_RATIO * n)) for n in lengths]
    encoder = [[sum(row) for row in enc] for enc, _ in draws]
    masked_unknown = sum(bool(enc[t][i] or dec[t][i]) for enc, dec in draws for t, row in enumerate(unknown)
                         for i, unk in enumerate(row) if unk)
    decoder = [sum(dec[t]) / (n - 2) for _, dec in draws for t, n in enumerate(lengths)]
    return {"encoder_masked": [sum(counts[t] for counts in encoder) / len(draws) for t in range(len(lengths))],
            "budgets": budgets, "filled_share": sum(count == budget for counts in encoder
                                                   for count, budget in zip(counts, budgets)) / (len(draws) * len(budgets)),
            "decoder_share": sum(decoder) / len(decoder), "unk_masked": masked_unknown}


def released_collator(work: str) -> dict:
    """mask_statistics of the released DataCollatorForReplaceLM (recipe settings) on work/texts.json."""
    import random
    import types

    import torch
    from collators.rlm_collator import DataCollatorForReplaceLM
    from transformers import BertTokenizerFast

    texts = json.loads((Path(work) / "texts.json").read_text())
    tokenizer = BertTokenizerFast.from_pretrained(str(TOKENIZER))
    collate = DataCollatorForReplaceLM(tokenizer, args=types.SimpleNamespace(
        rlm_max_length=MAX_LEN, rlm_encoder_mask_prob=ENCODER_RATIO, rlm_decoder_mask_prob=DECODER_RATIO,
        all_use_mask_token=True))
    random.seed(0)
    torch.manual_seed(0)
    draws, batch = [], None
    for _ in range(DRAWS):
        batch = collate([{"contents": text} for text in texts])
        draws.append(((batch["enc_labels"] != -100).int().tolist(), (batch["dec_labels"] != -100).int().tolist()))
    ids = tokenizer(texts, max_length=MAX_LEN, truncation=True, padding=True, return_tensors="pt")["input_ids"]
    return mask_statistics(batch["enc_attention_mask"].sum(1).tolist(), (ids == tokenizer.unk_token_id).tolist(),
                           draws)


def released_side(work: str) -> None:
    """ReplaceLM's losses and gradients for pretrieve's weights and batches, and the released collator's masks."""
    import types

    import torch
    from transformers import BertConfig, BertForMaskedLM

    # ReplaceLM.__init__ imports its trainer for a type annotation only; the trainers package imports pytrec_eval
    # (for the bi-encoder's metrics), which the loss does not need: the module stands in for it
    sys.modules["trainers.rlm_trainer"] = types.SimpleNamespace(ReplaceLMTrainer=None)
    from models.rlm import ReplaceLM

    results = {}
    for setting, frozen in SETTINGS.items():
        saved = torch.load(Path(work) / f"{setting}.pt")
        config = {k: v for k, v in saved["config"].items() if k not in ("architectures", "dtype", "torch_dtype")}
        args = types.SimpleNamespace(rlm_decoder_layers=2, rlm_generator_model_name=str(Path(work) / "generator"),
                                     rlm_freeze_generator=frozen, rlm_generator_mlm_weight=0.2)
        model = ReplaceLM(args, BertForMaskedLM(BertConfig(**config)))
        result = model.load_state_dict(saved["state"], strict=False)
        params = dict(model.named_parameters())
        missing = [k for k in result.missing_keys if k in params and ".pooler." not in k]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
        model.eval()
        out = model(dict(saved["batch"]))
        out.loss.backward()
        worst = max((float((params[name].grad - grad).abs().max()), name) for name, grad in saved["grads"].items())
        no_grad = [name for name, p in params.items() if p.grad is not None and name not in saved["grads"]
                   and ".pooler." not in name]
        results[setting] = {"loss": out.loss.item(), "enc": out.encoder_mlm_loss.item(),
                            "dec": out.decoder_mlm_loss.item(), "gen": out.g_mlm_loss.item(),
                            "replace_ratio": out.replace_ratio.item(), "max_grad_diff": worst[0],
                            "max_grad_diff_at": worst[1], "params_compared": len(saved["grads"]),
                            "released_grads_pretrieve_lacks": no_grad}
    (Path(work) / "released_collator.json").write_text(json.dumps(released_collator(work)))
    print(json.dumps(results))


if __name__ == "__main__":
    released_side(sys.argv[1])
