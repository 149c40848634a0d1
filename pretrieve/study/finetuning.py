"""A method study's fine-tuning and evaluation: every model of a seed fine-tuned the same way on the labelled set,
then evaluated, through `pretrieve farm` (its stage `stage1`: `finetune-stages --up-to stage1`, eq. 13 plus the
set's negatives; orchestrate/pretrain_runs.py's `evaluate`), which skips what is done; and the per-query scores
the farm leaves."""

from __future__ import annotations

from pathlib import Path

from pretrieve.orchestrate.pretrain_runs import evaluate
from pretrieve.study.context import StudyRun
from pretrieve.study.data import log
from pretrieve.study.pretraining import tracking_uri
from pretrieve.study.processes import child_env
from pretrieve.study.stats import per_query

STAGE = "stage1"  # the farm stage: fine-tune (eq. 13, + the set's negatives) then evaluate


def finetune_overrides(spec: dict, seed: int, precision: str) -> list[str]:
    steps = spec["steps"]
    return [f"finetune.negatives={spec['negatives']}", f"finetune.temperature={spec['temperature']}",
            f"finetune.query_max_len={spec['query_max_len']}", f"finetune.passage_max_len={spec['passage_max_len']}",
            f"train.lr={spec['lr']}", f"train.micro_batch_size={spec['batch']}", f"train.max_steps={steps}",
            f"train.warmup_ratio={spec['warmup_ratio']}", f"train.precision={precision}",
            f"train.log_every={max(1, min(50, steps // 10))}", f"checkpoint.every={max(1, steps // 2)}",
            "checkpoint.keep=1", f"seed={seed}"]


def checkpoint(name: str, model: Path, pooling: str, run_dir: Path | None = None) -> dict:
    """A farm checkpoint: fine-tuned and evaluated with `pooling`, not normalised."""
    entry = {"name": name, "model": str(model), "pooling": pooling, "normalize": False}
    if run_dir is not None:
        entry["run_dir"] = str(run_dir)
    return entry


def pooling(plan: dict, arm: str, base_pooling: str) -> str:
    """The arm's pooling in fine-tuning and evaluation (study.plan: its paper's; `base`: the base's own)."""
    chosen = plan["pooling"][arm]
    return base_pooling if chosen == "base" else chosen


def run_farm(run: StudyRun, path: Path, out: Path, checkpoints: list[dict], datasets: dict[str, Path],
             labelled: str, finetune: dict, seed: int) -> None:
    """`pretrieve farm` (written to `path`, its jobs under `out`): every checkpoint fine-tuned on `labelled` with
    `finetune` and `seed`, then evaluated on `datasets`' test queries."""
    plan = run.plan
    farm = {"out": str(out), "workers": plan["parallel"],
            "tracking": {"enabled": False} if plan["smoke"] else
            {"uri": tracking_uri(run.work), "experiment": f"quality-{path.parent.name}"},
            "eval": plan["eval"], "checkpoints": checkpoints,
            "datasets": [{"name": n, "beir": str(p), "split": "test"} for n, p in datasets.items()],
            "stages": [STAGE], "finetune": {"config": run.study.config("finetune"), "data": [labelled],
                                            "overrides": finetune_overrides(finetune, seed, plan["precision"])}}
    log(f"farm {path.name}: {len(checkpoints)} checkpoints x {len(datasets)} datasets")
    failed = evaluate(farm, path, env=child_env(plan["threads"]))["failed"]
    if failed:
        raise RuntimeError(f"farm {path} failed: " + "; ".join(f"{job}: {why}" for job, why in failed.items()))


def scores_of(out: Path, name: str, dataset: str) -> dict[str, float]:
    """The per-query NDCG@10 of checkpoint `name` on `dataset`, from the farm under `out`."""
    return per_query(out / name / dataset / STAGE)
