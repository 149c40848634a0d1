"""A method study's pre-training runs: their overrides, their cost (encoder tokens and FLOPs, the equal budget),
and running them through the runner `pretrieve scale run` uses too (orchestrate/pretrain_runs.py): `parallel`
`pretrieve pretrain` processes at a time with `threads` torch threads each, or, for the smoke run, one after the
other in this process (DeepSpeed imported once). A run whose export exists is skipped; one that stopped continues
from its checkpoint. Each run's seconds go to RUN_DIR/wall_seconds.json."""

from __future__ import annotations

import json
from pathlib import Path

from pretrieve.orchestrate.pretrain_runs import PretrainRun, pretrain_runs
from pretrieve.study.context import StudyRun
from pretrieve.study.data import log, write_atomic
from pretrieve.study.processes import child_env


def tracking_uri(work: Path) -> str:
    """One MLflow store per study run: pre-training runs, and the farm's fine-tuning and evaluation runs nested
    under them."""
    return f"sqlite:///{work.resolve() / 'mlflow.db'}"


def run_overrides(run: StudyRun, manifests: list[str], corpora: list[str], spec: dict, seed: int,
                  checkpoints: int = 2, keep: int = 1) -> list[str]:
    """The overrides of a pre-training run on `manifests` with `spec`'s steps, batch, lr and warm-up:
    `checkpoints` evenly spaced saves (resume points; the curve's points), `keep` of them kept."""
    plan, steps = run.plan, spec["steps"]
    return [f"data.manifests=[{','.join(manifests)}]", "data.weights=null", f"data.corpora=[{','.join(corpora)}]",
            f"method.max_len={plan['max_len']}", f"train.micro_batch_size={spec['batch']}", f"train.lr={spec['lr']}",
            f"train.warmup_ratio={spec['warmup_ratio']}", f"train.max_steps={steps}",
            f"train.precision={plan['precision']}", f"train.log_every={max(1, min(50, steps // 10))}",
            f"checkpoint.every={max(1, steps // checkpoints)}", f"checkpoint.keep={keep}", f"seed={seed}",
            *(["tracking.enabled=false", "data.shuffle_buffer=64"] if plan["smoke"] else
              ["tracking.enabled=true", f"tracking.uri={tracking_uri(run.work)}",
               "tracking.experiment=quality-pretrain"])]


def flops_per_step(config: str, overrides: list[str], batches: int) -> float:
    """Mean training FLOPs of one optimizer step (engine.flops.train_flops) over the first `batches` real batches
    of the run's own collator and stream."""
    from itertools import islice

    from pretrieve.config import load_config
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.stream import ShardStream, StreamLoader
    from pretrieve.engine.flops import train_flops
    from pretrieve.pretrain_config import experiment

    exp = experiment(load_config(config, overrides))
    if exp.model.init_from:
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(exp.model.init_from)
    else:
        model_config = exp.model.hf_config()
    collate = exp.method.collator.from_options(exp.options, Vocabulary.of_tokenizer(exp.data.tokenizer_dir()))
    stream = ShardStream(exp.data.manifests, weights=exp.data.weights, seed=exp.seed,
                         shuffle_buffer=exp.data.shuffle_buffer)
    loader = StreamLoader(stream, batch_size=exp.train.micro_batch_size, collate_fn=collate)
    counts = [train_flops(exp.method, exp.options, model_config, batch)
              for batch in islice(iter(loader), batches)]
    return sum(counts) / len(counts) * exp.train.grad_accum


def budget(run: StudyRun, name: str, config: str, overrides: list[str], steps: int, batch: int) -> dict:
    """{steps, encoder_tokens (steps x batch x max_len: the equal budget), flops_per_step, flops} of one kind of
    run, cached in WORK/budget.json."""
    path = run.work / "budget.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    if known.get(name, {}).get("overrides") != overrides:
        per_step = flops_per_step(config, overrides, 2 if run.plan["smoke"] else 8)
        known[name] = {"steps": steps, "encoder_tokens": steps * batch * run.plan["max_len"],
                       "flops_per_step": round(per_step), "flops": round(per_step * steps), "overrides": overrides}
        write_atomic(path, json.dumps(known, indent=1))
    return {key: value for key, value in known[name].items() if key != "overrides"}


def pretrain(run: StudyRun, jobs: list[tuple[str, Path, list[str]]]) -> None:
    """Run the pending (config, run_dir, overrides) jobs; a failed one is an error naming its log, once the others
    have run."""
    plan = run.plan
    runs = [PretrainRun(run_dir.name, ["pretrain", config, f"run_dir={run_dir}", "resume=auto", *overrides],
                        run_dir / "export" / "config.json", run_dir.parent / f"{run_dir.name}.log")
            for config, run_dir, overrides in jobs]
    pending = [job for job in runs if not job.done()]
    if not pending:
        return
    at_once = 1 if plan["smoke"] else min(plan["parallel"], len(pending))
    log(f"pretrain: {len(pending)} of {len(runs)} runs to go, {at_once} at a time")

    def finished(job: PretrainRun) -> None:
        write_atomic(job.marker.parent.parent / "wall_seconds.json", json.dumps(job.seconds))
        log(f"pretrain {job.name} done in {job.seconds:.0f} s")

    failed = pretrain_runs(runs, plan["parallel"], env=child_env(plan["threads"]), after=finished, progress=False,
                           in_process=plan["smoke"])
    if failed:
        raise RuntimeError("pre-training failed: " + "; ".join(f"{name}: {why}" for name, why in failed.items()))
