"""The `simlm` loss and gradients against the released SimLM code (microsoft/unilm, `simlm/src/models/rlm.py`,
`ReplaceLM`) on identical weights and batches, with the generator frozen (the released recipe) and trained.

    python benchmarks/simlm_reference.py --released UNILM/simlm --python VENV/bin/python \
        [--out benchmarks/results/simlm_reference.json]

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
`decoder.<i>.*`, `generator.bert.*`, `generator.cls.*`), the batch as the released collator lays it out (`enc_`,
`dec_` and `labels`) and its results; this file, run by VENV's Python (`--released-side`), imports the released
`ReplaceLM` from UNILM/simlm/src (its trainer module, imported for a type annotation, stood in for), loads them and
computes the loss and gradients there. The JSON holds both losses
and parts, and the largest gradient difference, for each generator setting, plus the training FLOPs of simlm
against mlm and retromae at BERT-base (engine.flops).

The loss comparison reads one batch, pretrieve's collator's, on both sides, and forces the generator's draws to
one token: it compares the head, not the collators nor the draws. The collators are compared apart, on what
needs no shared random stream: the released `DataCollatorForReplaceLM` (`--all_use_mask_token`) and pretrieve's
each mask the same texts (the 8 blocks as text, and one with [UNK]s) DRAWS times, and the JSON's `collators`
holds, for each, the encoder's masked tokens per text (mean over the draws), the share of draws that fill the
budget round(0.3 x n) exactly (n with [CLS] and [SEP]), the decoder's mean masked share and the masked [UNK]s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import released_code

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, GENERATOR_HIDDEN, TEXTS, MAX_LEN, PEAK = 64, 4, 32, 8, 144, 50.0
SETTINGS = {"frozen": True, "trained": False}  # the generator: --rlm_freeze_generator
DRAWS, ENCODER_RATIO, DECODER_RATIO = 50, 0.3, 0.5  # the collators' comparison: collations of the same texts
UNK_TEXT = "the cat \u2603 sat on the \U0001F600 mat near the \u2603 dog " * 4  # 12 [UNK]s among 48 tokens
TOKENIZER = ROOT / "pretrieve" / "assets" / "tokenizer"


def wikipedia_samples(work: Path, count: int, first: int = 0) -> list[dict]:
    from itertools import islice

    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.stream import ShardStream

    shards = work / "shards"
    if not (shards / "manifest.json").is_file():
        prepare(PrepareOptions(source="wikipedia", inputs=[str(ROOT / "pretrieve/assets/samples/wikipedia")],
                               out=str(shards), workers=0, max_len=512, progress=False))
    return list(islice(iter(ShardStream([shards / "manifest.json"], seed=0, shuffle_buffer=1)), first, first + count))


def forward_backward(head, collate, work: Path, texts: int = TEXTS) -> tuple[list[dict], dict, dict]:
    """One forward and backward of `head` on `texts` bundled Wikipedia blocks collated by `collate`: (the
    samples, the batch, the head's outputs)."""
    samples = wikipedia_samples(work, texts)
    batch = collate(samples)
    out = head(batch)
    out["loss"].backward()
    return samples, batch, out


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
    options = spec.options_from({"max_len": MAX_LEN, "generator_init": str(work / "generator"),
                                 "freeze_generator": SETTINGS[setting]})
    model = ModelOptions(vocab_size=30522, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=512, dropout=0.0, pad_token_id=0)
    head = spec.build(options, model, seed=0).eval()
    collate = spec.collator.from_options(options, vocab)
    samples, batch, out = forward_backward(head, collate, work)
    names = released_names(head)
    original = torch.from_numpy(collate.pad(samples).ids)
    released_batch = {"enc_input_ids": batch["input_ids"], "enc_attention_mask": batch["attention_mask"],
                      "enc_labels": batch["mlm_labels"], "dec_input_ids": batch["dec_input_ids"],
                      "dec_attention_mask": batch["attention_mask"],
                      "dec_labels": torch.where(batch["dec_masked"], original, -100), "labels": batch["rlm_labels"]}
    torch.save({"state": {names[k]: v for k, v in head.state_dict().items() if k in names},
                "grads": {names[k]: p.grad for k, p in head.named_parameters() if k in names and p.grad is not None},
                "config": head.encoder.config.to_dict(), "batch": released_batch},
               work / f"{setting}.pt")
    return {k: v.item() for k, v in out.items()}


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


def write_collator_texts(work: Path) -> None:
    """The texts both collators mask, to work/texts.json: the batch's blocks as text, and UNK_TEXT."""
    from pretrieve.data.tokenizer import load_backend

    backend = load_backend(TOKENIZER)
    texts = [backend.decode(s["ids"][:MAX_LEN - 2].tolist()) for s in wikipedia_samples(work, TEXTS)] + [UNK_TEXT]
    (work / "texts.json").write_text(json.dumps(texts))


def pretrieve_collator(work: Path) -> dict:
    """mask_statistics of pretrieve's SimLMCollator on work/texts.json, DRAWS collations."""
    import numpy as np

    from pretrieve.data.collators import SimLMCollator
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import load_backend

    vocab = Vocabulary.from_backend(load_backend(TOKENIZER))
    samples = [{"ids": np.array(vocab.encode(text))} for text in json.loads((work / "texts.json").read_text())]
    draws, batch = [], None
    for draw in range(DRAWS):
        batch = SimLMCollator(vocab, max_len=MAX_LEN, mlm_ratio=ENCODER_RATIO, decoder_mask_ratio=DECODER_RATIO,
                              seed=draw)(samples)
        draws.append(((batch["mlm_labels"] != -100).int().tolist(), batch["dec_masked"].int().tolist()))
    lengths = batch["attention_mask"].sum(1).tolist()
    original = np.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"])
    return mask_statistics(lengths, (original == vocab.backend.token_to_id("[UNK]")).tolist(), draws)


def released_collator(released: str, work: str) -> dict:
    """mask_statistics of the released DataCollatorForReplaceLM (recipe settings) on work/texts.json."""
    import random
    import types

    import torch
    from transformers import BertTokenizerFast

    sys.path.insert(0, str(Path(released) / "src"))
    from collators.rlm_collator import DataCollatorForReplaceLM

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


def released_side(released: str, work: str) -> None:
    """Run by the released code's venv: ReplaceLM's losses and gradients for pretrieve's weights and batches."""
    import types

    import torch
    from transformers import BertConfig, BertForMaskedLM

    sys.path.insert(0, str(Path(released) / "src"))
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
    (Path(work) / "released_collator.json").write_text(json.dumps(released_collator(released, work)))
    print(json.dumps(results))


def flops_against_mlm(work: Path, names: tuple[str, ...] = ("mlm", "retromae", "simlm")) -> dict:
    """Training FLOPs of a micro-batch at BERT-base (engine.flops) on the same full-length texts, against mlm's
    (`names`: mlm first; simlm's adds its frozen generator's)."""
    from dataclasses import replace

    from transformers import BertConfig

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.engine.flops import train_flops
    from pretrieve.models.heads import get_method
    from pretrieve.models.heads.simlm import generator_pass_flops

    vocab = Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER))
    texts = [s for s in wikipedia_samples(work, 400) if len(s["ids"]) >= 510][:8]
    config, result = BertConfig(), {"texts": len(texts)}
    for length in (144, 512):
        flops = {}
        for name in names:
            spec = get_method(name)
            options = spec.options_from({"max_len": length})
            batch = spec.collator.from_options(options, vocab)(texts)
            flops[name] = train_flops(name, options, config, batch)
            if name == "simlm":  # frozen (a loaded generator of the new one's shape): the encoder text's pass
                # takes no backward either
                options = replace(options, freeze_generator=False)
                flops["simlm, generator frozen"] = (flops["simlm"]
                                                    - 2 * generator_pass_flops(options, config, batch, "enc"))
        result[f"L{length}"] = {k: round(v / flops["mlm"], 3) for k, v in flops.items()}
    return result


def pretrieve_sides(work: Path) -> dict:
    """pretrieve_side of each generator setting, and the collators' texts written for the released side."""
    write_collator_texts(work)
    return {setting: pretrieve_side(setting, work) for setting in SETTINGS}


def main() -> int:
    setup = {"hidden": HIDDEN, "layers": LAYERS, "decoder_layers": 2, "generator_hidden": GENERATOR_HIDDEN,
             "generator_peak": PEAK, "texts": TEXTS, "max_len": MAX_LEN, "precision": "fp32", "dropout": 0.0}
    return released_code.main(__file__, __doc__, "the simlm folder of a microsoft/unilm checkout",
                              "simlm_reference.json", released_side,
                              pretrieve_sides,
                              "generator", setup,
                              lambda work: {"collators": {
                                  "pretrieve": pretrieve_collator(work),
                                  "released": json.loads((work / "released_collator.json").read_text())},
                                  "train_flops_against_mlm_bert_base": flops_against_mlm(work)})


if __name__ == "__main__":
    sys.exit(main())
