"""pretrieve's `bow` head against the released bag-of-words prediction code, on identical weights and batches.

    python benchmarks/bowdpr_reference.py --released IR_CHECKOUT --python REF_VENV/bin/python

IR_CHECKOUT: a clone of github.com/caskcsg/ir at e64a12a898f526231b017e09d20aa363259693cf, the last commit that
holds `bowdpr/` (later ones replace it by a submodule). REF_VENV: a venv of the released code's own stack, which
pins no versions; one of the paper's time: `python -m venv REF_VENV && REF_VENV/bin/pip install torch==2.13.0
transformers==4.36.2` (docs/methods.md, "bow").

A tiny BERT (tiny-bow.yaml's shape) is built by pretrieve, its weights written as a `BertForMaskedLM` state dict,
and a batch of the bundled Wikipedia sample collated by pretrieve's `BoWCollator`. The released side (a child
process in REF_VENV) loads both into `BertForBoWPrediction` (src/bowdpr/pretrain/modeling.py), computes its
bag-of-words weights with the released collator's own `_get_bow_weights` from the same unmasked texts, and its
loss scale with the released trainer's cosine (scheduler.py) at a few steps. Both run in eval mode (no dropout),
forward and backward. Writes benchmarks/results/bowdpr_reference.json: each loss part, the total at each step,
the gradient norms of the word embeddings and of the whole model, and their largest differences.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
RELEASED_COMMIT = "e64a12a898f526231b017e09d20aa363259693cf"  # caskcsg/ir's last commit that holds bowdpr/
STEPS = (0, 250, 500, 1000)  # of MAX_STEPS: the BoW weight's cosine at its start, a quarter, half, end
MAX_STEPS = 1000

# runs in the released code's venv: argv = [released src dir, input .pt, output .json]
RELEASED_SIDE = r'''
import json, math, sys, types
import torch
sys.path.insert(0, sys.argv[1])
from transformers import BertConfig, BertForMaskedLM, BertTokenizer
from bowdpr.pretrain.arguments import DataTrainingArguments, ModelArguments
from bowdpr.pretrain.data_utils import BoWPredictionCollator
from bowdpr.pretrain.modeling import BertForBoWPrediction
from bowdpr.scheduler import _get_cosine_schedule_with_warmup_lr_lambda_minlr as cosine

given = torch.load(sys.argv[2])
bert = BertForMaskedLM(BertConfig(**given["config"]))
missing, unexpected = bert.load_state_dict(given["weights"], strict=False)
assert not unexpected and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}, missing
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
import transformers
out["transformers"] = transformers.__version__
json.dump(out, open(sys.argv[3], "w"))
'''


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
    path = sorted((ROOT / "pretrieve" / "assets" / "samples" / "wikipedia").glob("*.jsonl.gz"))[0]
    with gzip.open(path, "rt") as lines:
        texts = [json.loads(next(lines))["text"] for _ in range(count)]
    return [{"ids": np.array(backend.encode(t, add_special_tokens=False).ids[:20 + 15 * i], dtype=np.int64),
             "index": i} for i, t in enumerate(texts)]


def pretrieve_side(head, batch: dict) -> dict:
    """The same quantities from pretrieve's head."""
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--released", required=True, type=Path, help="a checkout of caskcsg/ir holding bowdpr/")
    p.add_argument("--python", required=True, help="the released code's venv's python")
    p.add_argument("--texts", type=int, default=8)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bowdpr_reference.json")
    args = p.parse_args()
    source = args.released / "bowdpr" / "src"
    if not (source / "bowdpr" / "pretrain" / "modeling.py").is_file():
        p.error(f"--released {args.released}: no bowdpr/src/bowdpr/pretrain/modeling.py (check out {RELEASED_COMMIT})")

    from pretrieve.config import load_config
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.pretrain_config import method_options, model_options

    config = load_config(ROOT / "configs" / "pretrain" / "tiny-bow.yaml", ["model.dropout=0.0"])
    method, options = method_options(config)
    head = method.build(options, model_options(config), seed=0).eval()
    backend = load_backend(DEFAULT_TOKENIZER)
    collate = method.collator.from_options(options, Vocabulary.from_backend(backend), seed=0)
    samples = wikipedia_samples(args.texts, backend)
    batch = collate(samples)
    lengths = batch["attention_mask"].sum(dim=1)
    unmasked = [[collate.vocab.cls_id, *s["ids"][:int(n) - 2].tolist(), collate.vocab.sep_id]
                for s, n in zip(samples, lengths)]
    ours = pretrieve_side(head, batch)

    hf = head.encoder.config
    given = {"config": {k: getattr(hf, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                     "num_attention_heads", "intermediate_size",
                                                     "max_position_embeddings", "pad_token_id")}
             | {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
             "weights": bert_for_masked_lm_weights(head), "vocab_file": str(Path(DEFAULT_TOKENIZER) / "vocab.txt"),
             "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
             "mlm_labels": batch["mlm_labels"], "texts": unmasked, "steps": list(STEPS), "max_steps": MAX_STEPS,
             "decay_to": options.bow_decay_to}
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "side.py").write_text(RELEASED_SIDE)
        torch.save(given, Path(work) / "given.pt")
        done = subprocess.run([args.python, str(Path(work) / "side.py"), str(source), str(Path(work) / "given.pt"),
                               str(Path(work) / "released.json")], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"the released side failed:\n{done.stderr[-3000:]}")
        released = json.loads((Path(work) / "released.json").read_text())

    def diff(a, b):
        return abs(a - b) / max(abs(b), 1e-12)

    parts = ("mlm", "bow", "grad_norm_word_embeddings", "grad_norm")
    result = {
        "texts": args.texts, "tokens": int(lengths.sum()), "shape": "tiny-bow (hidden 64, 2 layers), fp32, eval",
        "released_transformers": released.pop("transformers"), "torch": torch.__version__,
        "pretrieve": {k: ours[k] for k in (*parts, "total")}, "released": released,
        "max_relative_difference": {
            **{k: diff(ours[k], released[k]) for k in parts},
            "total": max(diff(ours["total"][s], released["total"][s]) for s in ours["total"])},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    print(json.dumps(result["max_relative_difference"]))


if __name__ == "__main__":
    main()
