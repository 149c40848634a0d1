"""The `condenser` and `cocondenser` losses and gradients against the released Condenser code (luyug/Condenser) on
identical weights and batches.

    python benchmarks/condenser_reference.py --released DIR --python VENV/bin/python \
        [--out benchmarks/results/condenser_reference.json]

DIR is a checkout of luyug/Condenser (its modeling.py); VENV a virtual environment of its own with the transformers
that code was written for (the repository pins none; 4.30.2 is the last release before the code's
`get_extended_attention_mask(mask, shape, device)` call stops working, and the first with tokenizers wheels for
Python 3.11) and a CPU torch:

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==4.30.2 "numpy<2"

Here: a tiny BERT (hidden 64, 4 layers, the head reading layer 2, 2 head layers, no dropout, fp32) from seed 0,
one batch of 8 bundled Wikipedia blocks collated by pretrieve (whole-word masking 0.15; for coCondenser two spans
of each, 16 rows). pretrieve's head computes the loss and its gradients, then writes its weights (under the
released code's names: BertForMaskedLM's `bert.*` and `cls.predictions.*`, `c_head.<i>.*`), the batch and its
results; this same file, run by VENV's Python (`--released-side`), loads them into CondenserForPretraining /
CoCondenserForPretraining (late_mlm on, one process) and computes the loss and gradients there. The JSON holds
both losses and the largest gradient difference per method. It also runs the released coCondenser's cached
(GradCache) path by hand, chunk by chunk as its trainer does, and reports the sum of its chunks' MLM terms
against the uncached MLM terms: the defect docs/methods.md lists (each MLM term counted twice).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import released_code

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, SKIP_FROM, HEAD_LAYERS, DOCS, MAX_LEN, CHUNK = 64, 4, 2, 2, 8, 128, 4


def pretrieve_side(method: str, work: Path) -> dict:
    """pretrieve's loss and gradients; the weights, batch and gradients under the released names, to work/."""
    import torch

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.stream import ShardStream
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    shards = work / "shards"
    if not (shards / "manifest.json").is_file():
        prepare(PrepareOptions(source="wikipedia", inputs=[str(ROOT / "pretrieve/assets/samples/wikipedia")],
                               out=str(shards), workers=0, max_len=512, progress=False))
    stream = iter(ShardStream([shards / "manifest.json"], seed=0, shuffle_buffer=1))
    samples = [next(stream) for _ in range(DOCS)]
    spec = get_method(method)
    options = spec.options_from({"max_len": MAX_LEN, "skip_from": SKIP_FROM, "head_layers": HEAD_LAYERS})
    model = ModelOptions(vocab_size=30522, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                         intermediate_size=4 * HIDDEN, max_position_embeddings=512, dropout=0.0, pad_token_id=0)
    head = spec.build(options, model, seed=0).eval()
    batch = spec.collator.from_options(options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))(samples)
    out = head(batch)
    out["loss"].backward()
    names = released_names(head)
    torch.save({"state": {names[k]: v for k, v in head.state_dict().items() if k in names},
                "grads": {names[k]: p.grad for k, p in head.named_parameters() if k in names and p.grad is not None},
                "config": head.encoder.config.to_dict(),
                "batch": {k: batch[k] for k in ("input_ids", "attention_mask", "mlm_labels")}},
               work / f"{method}.pt")
    return {k: v.item() for k, v in out.items()}


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


def released_side(released: str, work: str) -> None:
    """Run by the released code's venv: its losses and gradients for pretrieve's weights and batches."""
    import types

    import torch
    from transformers import BertConfig, BertForMaskedLM

    sys.path.insert(0, released)
    from modeling import CondenserForPretraining, CoCondenserForPretraining

    results = {}
    for method, cls in (("condenser", CondenserForPretraining), ("cocondenser", CoCondenserForPretraining)):
        saved = torch.load(Path(work) / f"{method}.pt")
        batch = saved["batch"]
        config = {k: v for k, v in saved["config"].items() if k not in ("architectures", "dtype", "torch_dtype")}
        rows = len(batch["input_ids"])
        model_args = types.SimpleNamespace(n_head_layers=HEAD_LAYERS, skip_from=SKIP_FROM, late_mlm=True)
        train_args = types.SimpleNamespace(per_device_train_batch_size=rows // 2 if method == "cocondenser" else rows,
                                           local_rank=-1)
        model = cls(BertForMaskedLM(BertConfig(**config)), model_args, None, train_args)
        result = model.load_state_dict(saved["state"], strict=False)
        params = dict(model.named_parameters())
        missing = [k for k in result.missing_keys if k in params and ".decoder." not in k]  # decoder: tied
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
        model.eval()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        loss = model(dict(inputs), batch["mlm_labels"])
        loss.backward()
        worst = max((float((params[name].grad - grad).abs().max()), name) for name, grad in saved["grads"].items())
        results[method] = {"loss": loss.item(), "max_grad_diff": worst[0], "max_grad_diff_at": worst[1],
                           "params_compared": len(saved["grads"])}
        if method == "cocondenser":
            results[method]["cached_path_mlm"] = cached_mlm(model, inputs, batch["mlm_labels"])
    print(json.dumps(results))


def cached_mlm(model, inputs: dict, labels) -> dict:
    """The released trainer's GradCache step by hand (chunks of CHUNK spans, the contrastive gradient of zeros: the
    MLM terms alone): the sum of the chunks' scaled MLM losses, against the uncached MLM terms."""
    import torch

    with torch.no_grad():
        chunks = []
        for start in range(0, len(labels), CHUNK):
            part = {k: v[start:start + CHUNK] for k, v in inputs.items()}
            cache = torch.zeros(len(labels), model.lm.config.hidden_size)
            lm_loss, _ = model(part, labels[start:start + CHUNK], grad_cache=cache, chunk_offset=start)
            chunks.append(lm_loss.item())
        whole = super(type(model), model).forward(dict(inputs), labels).item()  # Condenser's terms, unscaled
    return {"chunk": CHUNK, "sum_of_chunks": sum(chunks), "uncached": whole, "ratio": sum(chunks) / whole}


def main() -> int:
    setup = {"hidden": HIDDEN, "layers": LAYERS, "skip_from": SKIP_FROM, "head_layers": HEAD_LAYERS,
             "documents": DOCS, "max_len": MAX_LEN, "precision": "fp32", "dropout": 0.0}
    return released_code.main(__file__, __doc__, "a checkout of luyug/Condenser", "condenser_reference.json",
                              released_side,
                              lambda work: {m: pretrieve_side(m, work) for m in ("condenser", "cocondenser")},
                              "methods", setup)


if __name__ == "__main__":
    sys.exit(main())
