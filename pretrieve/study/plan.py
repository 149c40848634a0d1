"""Settings of the quality study (benchmarks/quality.py) at each scale, and their fixing before any result.

One protocol for every arm (docs/benchmarks.md, "Retrieval quality"): initial weights -> the arm's pre-training
at an equal token budget -> the same fine-tuning -> `pretrieve eval` on held-out collections. An arm is `none`
(no pre-training beyond the base) or a pre-training method. The token budget is counted in encoder tokens:
every arm's continued pre-training takes the same steps of the same batch of `max_len`-token blocks; what a
method reads besides (CoT-MAE's neighbouring span goes to its decoder, COSTA's spans are positions of the same
block) costs FLOPs, which the results report per arm (engine/flops.py), not tokens.

Pooling (`pooling`), the same in fine-tuning and evaluation, is each method's paper's: [CLS] for RetroMAE,
SEED-Encoder, COSTA and CoT-MAE (the representation their papers fine-tune and evaluate); for DupMAE its joint
representation of eq. 12 ([CLS] through W^cls plus the top-384 entries of the max-pooled vocabulary vector): its
default, which §4.2 Table 4 shows beating either half (0.4102 MRR@10 against 0.3941 for "CLS:768", [CLS]
alone), and what its fine-tuning, eqs. 13-15, scores with; for LexMAE its SPLADE vector (`sparse`: what its
paper fine-tunes, with the FLOPS regulariser at its released stage-1 weights). `none` and `mlm` keep the base's own pooling
(`base`): [CLS] for the study's BERT (RetroMAE's BERT baseline), mean for MiniLM (what sentence-transformers
trained it with). Fine-tuning scores with the inner product (eq. 12 is one; no normalisation, temperature 1)
for every arm alike.

Settings are fixed before any test result exists: the first invocation writes them to WORK/settings.json (with
the time) and into the results file before any evaluation; a later invocation on the same WORK with other
settings is refused, naming the first differing key.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

ARMS = ("none", "mlm", "retromae", "dupmae", "seed", "costa", "cotmae", "bow", "condenser", "cocondenser", "simlm",
        "lexmae")
CPU_ARMS = ARMS[:7]  # the cpu study's, run and committed; the arms added since are for the gpu scales
REFERENCES = ("none", "mlm")  # the arms every other is compared with
POOLING = {"none": "base", "mlm": "base", "retromae": "cls", "dupmae": "dupmae", "seed": "cls", "costa": "cls",
           "cotmae": "cls", "bow": "cls", "condenser": "cls", "cocondenser": "cls", "simlm": "cls",
           "lexmae": "sparse"}  # "base": its own
# an arm's own overrides of its tiny config: GradCache saves memory these small models do not need (its loss and
# gradients are the one-graph ones: tests/test_equations_condenser.py), and would only encode each span twice
ARM_OVERRIDES = {"cocondenser": ["method.grad_cache=null"]}
GENERAL_DATASETS = ("scifact", "cacm", "cranfield")

def merge(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in, recursively."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# --- cpu: 2 cores, about 3 hours (docs/benchmarks.md has the measured cost of each stage) ---------------------
# The encoder: BERT-tiny's shape (Turc et al. 2019: 2 layers, hidden 128, 2 heads; 4.4M parameters, 0.4M outside
# the embeddings): fine-tuning and evaluating ~30 models on 2 cores allows no larger. Base: 2,000 MLM steps of
# 32 x 128 tokens (8.2M tokens, ~1/3 of the text). Each arm continues it for 200 steps (0.82M encoder tokens,
# 10 % of the base's): a decoder method's step costs 4-5x an mlm step here (the vocabulary projections of a
# 128-wide model dominate). Seeds: 3 for the four main arms; 1 for seed / costa / cotmae, which do not fit at 3.
# Fine-tuning: 200 steps of 32 queries, about one pass over the labelled set, each query with its positive and
# one BM25 negative; lr 5e-4, a small model's rate (BERT-base's 2e-5 to 1e-4, scaled up as for BERT-tiny; at
# 2e-4 the training loss had not moved from ln 64 after 20 steps). One torch thread per process, two processes
# side by side: two threads in one process ran 3x slower per step on this shared machine (measured). The arms
# added since this scale ran (CPU_ARMS: bag-of-words prediction, Condenser, coCondenser) are arms of the GPU
# scales only: at this scale the arms tie, and more CPU runs would not tell them apart.
CPU = {
    "scale": "cpu",
    "model": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 512},
    "max_len": 128,
    "precision": "fp32",
    "parallel": 2,  # processes at once (pre-training runs, farm jobs)
    "threads": 1,  # torch threads per process
    "base": {"steps": 2000, "batch": 32, "lr": 1e-3, "warmup_ratio": 0.06},
    "pretrain": {"steps": 200, "batch": 32, "lr": 5e-4, "warmup_ratio": 0.1},
    "finetune": {"steps": 200, "batch": 32, "lr": 5e-4, "negatives": 1, "temperature": 1.0, "query_max_len": 32,
                 "passage_max_len": 128, "warmup_ratio": 0.1},
    "eval": {"max_length": 128, "batch_size": 128},
    "pooling": dict(POOLING),  # every arm's, so that a run may add an arm (the smoke runs: bow)
    "general": {"arms": {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3, "seed": 1, "costa": 1, "cotmae": 1},
                "datasets": list(GENERAL_DATASETS)},  # CPU_ARMS
    "curve": {"arm": "retromae", "seed": 0, "points": 4},
    # Domain adaptation: DupMAE† (§4) continues on the target corpus for about one pass; the fine-tuning adds
    # SciFact's training claims (the target is not SciFact). One target, Cranfield (225 judged queries, CACM has
    # 52). MiniLM (22.7M parameters) costs ~5-10x the base per step: one seed, 100 fine-tuning steps at its own
    # rate (the README's MiniLM fine-tune, lr 2e-5, batch 16).
    "domain": {"arms": {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3},
               "bases": {"base": {"targets": ["cranfield"], "epochs": 1.0, "batch": 32, "lr": 5e-4, "max_steps": None},
                         "minilm": {"targets": ["cranfield"], "epochs": 1.0, "batch": 16, "lr": 5e-5, "max_steps": None,
                                    "seeds": 1, "finetune": {"lr": 2e-5, "batch": 16, "steps": 100}}}},
    "labelled": {"passage_words": 100, "seed": 0},
    "bootstrap": {"resamples": 10000, "seed": 0},
}

# --- gpu: one H100 / H200, 25 minutes or less (an estimate from FLOPs, docs/benchmarks.md: not yet measured) -------
# Base: 6 layers, hidden 512 (25M parameters, 19M outside the embeddings); 7,700 MLM steps of 256 x 256 tokens =
# 0.50B tokens, ~23 passes over the 22M tokens of text available (the text repeats). Each arm: 500 steps of
# 128 x 256 tokens (16M encoder tokens). All eight arms at 3 seeds; fine-tuning 300 steps of 64 queries (~3 passes
# over the labelled set); the domain adaptation of the base on all three targets, of MiniLM on SciFact and
# Cranfield. About 2.5e17 training FLOPs in all, ~100 processes six at a time.
GPU = copy.deepcopy(CPU) | {
    "scale": "gpu",
    "model": {"hidden_size": 512, "num_layers": 6, "num_heads": 8, "intermediate_size": 2048},
    "max_len": 256,
    "precision": "bf16",
    "parallel": 6,  # small models leave most of the GPU idle: runs side by side
    "threads": 2,
    "base": {"steps": 7700, "batch": 256, "lr": 5e-4, "warmup_ratio": 0.06},
    "pretrain": {"steps": 500, "batch": 128, "lr": 2e-4, "warmup_ratio": 0.1},
    "finetune": {"steps": 300, "batch": 64, "lr": 1e-4, "negatives": 1, "temperature": 1.0, "query_max_len": 32,
                 "passage_max_len": 256, "warmup_ratio": 0.1},
    "eval": {"max_length": 256, "batch_size": 256},
    "pooling": dict(POOLING),
    "general": {"arms": {arm: 3 for arm in ARMS}, "datasets": list(GENERAL_DATASETS)},
    "curve": {"arm": "retromae", "seed": 0, "points": 5},
    "domain": {"arms": {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3},
               "bases": {"base": {"targets": ["scifact", "cacm", "cranfield"], "epochs": 1.0, "batch": 64,
                                  "lr": 2e-4, "max_steps": None},
                         "minilm": {"targets": ["scifact", "cranfield"], "epochs": 1.0, "batch": 64,
                                    "lr": 5e-5, "max_steps": None, "finetune": {"lr": 2e-5}}}},
}
# --- gpu-short: what fits about 4 minutes of one H100, data work included (make gpu-check's quality stage) ------
# Still above the cpu scale: 4 layers x 512 (13M parameters outside the embeddings) and 1,600 MLM steps of
# 512 x 128 tokens = 105M tokens of base pre-training, ~15 passes over the Wikipedia subset an allocation can
# carry (make gpu-bundle) and the books. The four main arms and bag-of-words prediction (whose step costs about an
# mlm step's), each 300 steps of 256 x 128 tokens (9.8M encoder tokens), side by side; the same fine-tuning, 200 steps of 64 queries; SciFact, CACM and Cranfield. One seed an
# allocation (`--seeds 0`, then `--seeds 1-2` in later ones): each rebuilds the same base from the same seed,
# and the per-query scores merge into the results file. No domain part. Estimates until an allocation has run it.
GPU_SHORT = merge(GPU, {
    "scale": "gpu-short",
    "model": {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 2048},
    "max_len": 128,
    "parallel": 4,
    "data_workers": 8,  # `prepare` tokenizes on 8 of the node's 16 cores: the data work counts in the 4 minutes
    "base": {"steps": 1600, "batch": 512, "lr": 1e-3, "warmup_ratio": 0.06},
    "pretrain": {"steps": 300, "batch": 256, "lr": 5e-4, "warmup_ratio": 0.1},
    "finetune": {"steps": 200, "batch": 64, "lr": 2e-4, "passage_max_len": 128},
    "eval": {"max_length": 128, "batch_size": 512},
    "curve": {"arm": "retromae", "seed": 0, "points": 2},
})
GPU_SHORT["general"]["arms"] = {"none": 3, "mlm": 3, "retromae": 3, "dupmae": 3, "bow": 3, "condenser": 3,
                                "cocondenser": 3, "simlm": 3, "lexmae": 3}
GPU_SHORT["domain"] = {"arms": {}, "bases": {}}
SCALES = {"cpu": CPU, "gpu": GPU, "gpu-short": GPU_SHORT}

# --- smoke: the bundled samples, a hidden-64 encoder, 2 steps: the plumbing in a couple of minutes --------------
SMOKE = {
    "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
    "max_len": 64,
    "precision": "fp32",
    "parallel": 2,
    "threads": 1,
    "data_workers": 0,
    "base": {"steps": 4, "batch": 4},
    "pretrain": {"steps": 4, "batch": 4},
    "finetune": {"steps": 2, "batch": 4, "query_max_len": 16, "passage_max_len": 64},
    "eval": {"max_length": 64, "batch_size": 64},
    "curve": {"points": 2},
    "bootstrap": {"resamples": 1000},
}


def smoke_plan(plan: dict) -> dict:
    """The plan shrunk: SMOKE's sizes, one seed per arm, the bundled SciFact sample as every collection, the
    domain adaptation on the study's base only."""
    out = merge(plan, SMOKE)
    out["smoke"] = True
    out["general"]["arms"] = {arm: 1 for arm in out["general"]["arms"]}
    out["general"]["datasets"] = ["scifact-sample"]
    out["domain"]["arms"] = {arm: 1 for arm in out["domain"]["arms"]}
    if "base" in out["domain"]["bases"]:  # gpu-short has no domain part
        base = out["domain"]["bases"]["base"]
        out["domain"]["bases"] = {"base": {**base, "targets": ["scifact-sample"], "batch": 4, "max_steps": 4}}
    return out


def apply_sets(plan: dict, sets: list[str]) -> dict:
    """`key.sub=value` overrides (values parsed as JSON, else kept as strings); an unknown key is an error."""
    out = copy.deepcopy(plan)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        *parents, leaf = key.split(".")
        node = out
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise ValueError(f"--set {item!r}: {'.'.join(parents[:i + 1])} is not a settings section")
            node = node[part]
        if leaf not in node and not key.startswith(("general.arms.", "domain.arms.")):
            raise ValueError(f"--set {item!r}: unknown key {key} (known here: {', '.join(sorted(node))})")
        try:
            node[leaf] = json.loads(raw)
        except json.JSONDecodeError:
            node[leaf] = raw
    return out


def build_plan(scale: str, smoke: bool = False, beir: list[str] = (), sets: list[str] = ()) -> dict:
    """The full settings of one study run: the scale's, shrunk for --smoke, with the extra BEIR folders and the
    --set overrides; checked."""
    plan = SCALES[scale]
    plan = smoke_plan(plan) if smoke else {**copy.deepcopy(plan), "smoke": False}
    plan["general"]["beir"] = [str(Path(p).resolve()) for p in beir]
    names = list(plan["general"]["datasets"])
    for folder in map(Path, plan["general"]["beir"]):
        if not (folder / "qrels" / "test.tsv").is_file():
            raise ValueError(f"--beir {folder}: no qrels/test.tsv (a BEIR folder with a test split)")
        if folder.name in names:
            raise ValueError(f"--beir {folder}: a collection named {folder.name!r} is evaluated already")
        names.append(folder.name)
    plan = apply_sets(plan, list(sets))
    for key, arms in (("general.arms", plan["general"]["arms"]), ("domain.arms", plan["domain"]["arms"]),
                      ("pooling", plan["pooling"])):
        unknown = [arm for arm in arms if arm not in ARMS]
        if unknown:
            raise ValueError(f"{key}: unknown arm {unknown[0]!r} (known: {', '.join(ARMS)})")
    for arm, pooling in plan["pooling"].items():
        if pooling not in ("base", "cls", "mean", "dupmae", "sparse"):
            raise ValueError(f"pooling.{arm}: {pooling!r} is not base, cls, mean, dupmae or sparse")
    if plan["curve"]["arm"] not in plan["general"]["arms"]:
        raise ValueError(f"curve.arm: {plan['curve']['arm']!r} is not an arm of the general study")
    if plan["pretrain"]["steps"] % plan["curve"]["points"]:
        raise ValueError(f"curve.points: {plan['curve']['points']} must divide pretrain.steps "
                         f"({plan['pretrain']['steps']}): the curve's checkpoints are evenly spaced")
    return plan


def flat(settings: dict, prefix: str = "") -> dict:
    """{dotted key: value} of nested settings."""
    out = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def fix_settings(work: Path, plan: dict) -> dict:
    """Record `plan` as WORK/settings.json with the time it was fixed, or check it against the recorded one:
    another value (or a key added or dropped) is an error naming the key. Returns the record."""
    from pretrieve.utils.run_dir import write_atomic

    path = work / "settings.json"
    if path.is_file():
        record = json.loads(path.read_text())
        before, now = flat(record["settings"]), flat(plan)
        for key in sorted(set(before) | set(now)):
            if before.get(key, "<absent>") != now.get(key, "<absent>"):
                raise ValueError(f"{path}: settings were fixed at {record['fixed_at']} with {key} = "
                                 f"{before.get(key, '<absent>')!r}; this run has {now.get(key, '<absent>')!r}. "
                                 "Resume with the same settings, or start another --out")
        return record
    record = {"settings": plan, "fixed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "fixed_before_test_results": True}
    work.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return record
