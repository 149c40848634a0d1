"""The contrastive stage the recipe and Matryoshka studies share: weak pairs of the quality study's training text,
contrastive runs from a model on them, and zero-shot evaluation of a model with the pooling it was trained with.

The weak pairs (`pretrieve prepare --pairs`, from the quality study's training split of the text, nothing of its
held-out part): Wikipedia's sections (title -> first paragraph, "title: heading" -> the section), Wikipedia's and
the books' spans (two independent crops of a block, Contriever), drawn 2 : 1 : 1.
"""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.study.context import StudyRun
from pretrieve.study.data import log
from pretrieve.study.general import base_model
from pretrieve.study.inputs import pretraining_text, text_split
from pretrieve.study.pretraining import pretrain
from pretrieve.study.processes import pretrieve
from pretrieve.study.stage_times import timed

# The sources' shares of the pair stream: half title-like queries (a title, "title: heading"), as evaluation
# queries are short; the crops (193k of Wikipedia's, 13k of the books', against 67k sections) would otherwise
# make up three quarters of it
PAIR_WEIGHTS = {"wiki-sections": 2, "wiki-crops": 1, "books-crops": 1}


def weak_pairs(run: StudyRun) -> dict:
    """The pair shards of the study's training text: {name: manifest totals}, each prepared once."""
    from pretrieve.data.prepare import prepare
    from pretrieve.data.prepare_options import PrepareOptions

    parts = text_split(run)["parts"]
    sources = {"wiki-sections": ("wikipedia", parts["wiki-train"], "sections"),
               "wiki-crops": ("wikipedia", parts["wiki-train"], "spans"),
               "books-crops": ("books", parts["books-train"], "spans")}
    out = {}
    for name, (source, inputs, method) in sources.items():
        folder = run.work / "pairs" / name
        if not (folder / "manifest.json").is_file():
            log(f"pairs {name} ({source}, {method})")
            prepare(PrepareOptions(source=source, inputs=inputs, out=str(folder), max_len=run.plan["max_len"],
                                   workers=run.plan.get("data_workers", 0), pairs=True, pair_method=method,
                                   progress=False, on_error="skip" if source == "books" else "fail"))
        info = json.loads((folder / "manifest.json").read_text())
        out[name] = {"manifest": str(folder / "manifest.json"), "num_samples": info["num_samples"]}
    return out


def base_and_pairs(run: StudyRun) -> tuple[dict, Path, dict, dict]:
    """(the study's prepared text, the base's export, its record, the weak pairs) in the work directory, each made
    once."""
    run.work.mkdir(parents=True, exist_ok=True)
    with timed(run.work, "data"):
        text = pretraining_text(run)
    base, base_record = base_model(run, text)
    with timed(run.work, "pairs"):
        pairs = weak_pairs(run)
    return text, base, base_record, pairs


def contrastive_overrides(run: StudyRun, spec: dict, pairs: dict, start: Path, pooling: str, lr: float,
                          warmup: float, seed: int) -> list[str]:
    """A contrastive run from `start` on the pairs, with `spec`'s steps, batch, temperature and points (its
    checkpoints), `pooling`, normalised."""
    steps = spec["steps"]
    weights = ",".join(str(PAIR_WEIGHTS[name]) for name in pairs)
    return [f"model.init_from={start}", f"data.manifests=[{','.join(p['manifest'] for p in pairs.values())}]",
            f"data.weights=[{weights}]", f"method.pooling={pooling}", "method.normalize=true",
            f"method.temperature={spec['temperature']}", f"method.max_len={run.plan['max_len']}",
            f"method.query_max_len={spec['query_max_len']}", f"train.micro_batch_size={spec['batch']}",
            f"train.lr={lr}", f"train.warmup_ratio={warmup}", f"train.max_steps={steps}",
            f"train.precision={run.plan['precision']}", f"train.log_every={max(1, min(50, steps // 20))}",
            f"checkpoint.every={spec['points'][0]}", f"checkpoint.keep={steps // spec['points'][0]}", f"seed={seed}",
            "tracking.enabled=false"]


def train_runs(run: StudyRun, jobs: dict[str, list[str]], runs: Path) -> None:
    """The contrastive runs `jobs` (in `runs`/NAME): a finished run is skipped."""
    config = run.study.config("contrastive")
    pretrain(run, [(config, runs / name, overrides) for name, overrides in jobs.items()])


def evaluate(run: StudyRun, model: Path, pooling: str, beir: Path, out: Path, dim: int | None = None) -> float:
    """NDCG@10 of `model` on the test queries of the collection in `beir`, zero-shot, normalised (its vectors cut
    to their first `dim` coordinates when given); cached in `out` (its per-query scores too)."""
    metrics = out / "metrics.json"
    if not metrics.is_file():
        evaluation = run.plan["eval"]
        pretrieve(["eval", "--model", str(model), "--beir", str(beir), "--pooling", pooling, "--normalize",
                   "--max-length", str(evaluation["max_length"]), "--batch-size", str(evaluation["batch_size"]),
                   "--out", str(out), "--overwrite", *(["--dim", str(dim)] if dim else [])],
                  out.parent / f"{out.name}.log", run.plan["threads"])
    return json.loads(metrics.read_text())["ndcg@10"]


def last_loss(run_dir: Path) -> dict:
    """The last logged loss of a run, and its per-dimension parts (loss@<m>) when it has them."""
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)][-1]
    return {k: round(v, 4) for k, v in last.items() if k == "loss" or k.startswith("loss@")}
