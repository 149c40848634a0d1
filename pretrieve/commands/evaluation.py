"""`pretrieve encode`, `eval`, `farm`, `track` and `report`: scoring encoders on retrieval sets, many at once, and
comparing them. Each command's flags are in its `add_` function, its work in its `run_` function."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from functools import partial

from pretrieve.commands.arguments import (MODEL_SAYS, at_least, command, index_options, max_length_option,
                                          normalize_option, option, options_from, qrels_split, retrieval_set,
                                          slurm_jobs_option, worker_options)
from pretrieve.models.poolings import DENSE_POOLINGS, EVAL_POOLINGS, PROMPT_POOLINGS

DIM_HELP = ("keep the vectors' first N coordinates, cut before --normalize (a Matryoshka model's prefix; default: "
            "all)")


def add_encode(commands) -> None:
    from pretrieve.eval.options import EncodeOptions
    from pretrieve.eval.vectors import DTYPES, encode_corpus_shards

    p = command(commands, "encode", run_encode)
    p.add_argument("--model", required=True, metavar="DIR")
    retrieval_set(p, split=False)
    p.add_argument("--pooling", choices=(*DENSE_POOLINGS, *PROMPT_POOLINGS), default=None,
                   help=f"llama2vec: a Llama2Vec export's prompt pooling. {MODEL_SAYS}")
    normalize_option(p, "L2-normalize vectors (cosine similarity)")
    max_length_option(p)
    option(p, EncodeOptions, "--batch-size", type=at_least(1))
    option(p, EncodeOptions, "--dim", type=at_least(1), metavar="N", help=DIM_HELP)
    option(p, encode_corpus_shards, "--shard-size", type=at_least(1), help="documents per shard")
    option(p, encode_corpus_shards, "--dtype", choices=DTYPES,
           help="vectors as stored (float16: half the disk; search computes in float32 or more)")
    worker_options(p, encode_corpus_shards, "shards of DIR")
    p.add_argument("--out", required=True, metavar="DIR")


def run_encode(args) -> int:
    """encode a corpus to .npy + .ids shards, resumable, split over workers

    Stream the corpus through the encoder and write DIR/corpus-NNNNN.npy and .ids per --shard-size documents; worker
    i of n takes every n-th shard, on GPU i mod the GPUs it sees, and complete shards are skipped. `pretrieve eval
    --embeddings DIR` and `pretrieve mine --embeddings DIR` with the same model and settings read them.
    """
    from pretrieve.data.retrieval import stream_corpus
    from pretrieve.engine.devices import worker_device
    from pretrieve.eval.encode import DenseEncoder
    from pretrieve.eval.model_config import resolve_encoding
    from pretrieve.eval.vectors import encode_corpus_shards

    encoding = resolve_encoding(args.model, args.pooling, args.normalize, args.max_length)
    if encoding.pooling not in (*DENSE_POOLINGS, *PROMPT_POOLINGS):
        raise ValueError(f"{args.model}: pooling {encoding.pooling} ({encoding.source}) is not a dense pooling; "
                         "`pretrieve encode` writes cls, mean, last or llama2vec vectors (give --pooling)")
    encoder = DenseEncoder(args.model, replace(encoding.encode_options(args.batch_size), dim=args.dim),
                           device=worker_device(args.worker))
    shards, documents = encode_corpus_shards(encoder, stream_corpus(args.beir, args.msmarco), args.out,
                                             args.shard_size, args.worker, args.workers, args.dtype)
    print(json.dumps({"out": args.out, "documents": documents, "shards": [s.name for s in shards]}))
    return 0


def add_eval(commands) -> None:
    from pretrieve.eval.contrastive import DEFAULT_NEGATIVES
    from pretrieve.eval.options import EvalOptions

    p = command(commands, "eval", run_eval)
    p.add_argument("--model", default=None, metavar="DIR", help="HF encoder directory (`pretrieve export` output)")
    retrieval_set(p, mteb=True)
    p.add_argument("--pooling", choices=EVAL_POOLINGS, default=None,
                   help="cls / mean / last: dense; llama2vec: a Llama2Vec export's prompt pooling; dupmae (eq. 12: "
                        "a DupMAE export or a model fine-tuned with dupmae), "
                        f"sparse (SPLADE-style) and hybrid (CLS + sparse) need the model's MLM head. {MODEL_SAYS}")
    flag = partial(option, p, EvalOptions)
    flag("--vocab-top-k", type=int, help="dupmae / sparse / hybrid: entries a document keeps (default: dupmae the "
                                         "trained k, else 384; sparse / hybrid 256)")
    flag("--sparse-weight", type=float, help="hybrid: weight of the sparse score")
    flag("--candidates", type=int,
         help="dupmae / hybrid: re-score each query's dense + sparse top N instead of the whole corpus "
              "(default: exact up to 100,000 documents, 1,000 candidates beyond)")
    normalize_option(p, "L2-normalize vectors (cosine similarity)")
    max_length_option(p)
    for name in ("query", "passage"):
        flag(f"--{name}-prompt", metavar="TEXT",
             help=f"put TEXT before each {name} (an instruction, E5-Mistral / Qwen3-Embedding style); default: the "
                  f"model's sentence-transformers prompt '{name}', else none")
    flag("--dim", type=at_least(1), metavar="N", help=DIM_HELP)
    flag("--batch-size", type=at_least(1))
    index_options(p, EvalOptions)
    flag("--depth", type=at_least(1), help="documents retrieved per query")
    p.add_argument("--bm25", action="store_true", help="BM25 baseline (alone, or beside --model in OUT/bm25/)")
    flag("--on-missing", choices=("fail", "skip"),
         help="qrels naming an unknown query or document: stop with file:line (fail), or drop and count")
    flag("--embeddings", metavar="DIR",
         help="dense: read the corpus vectors `pretrieve encode` wrote to DIR instead of encoding")
    flag("--contrastive-entropy", type=int, nargs="?", const=DEFAULT_NEGATIVES, metavar="K",
         help="also write contrastive_entropy (Fang et al. 2024): mean -log p(relevant) against K fixed sampled "
              "negatives per judged pair, by the model's own scores (K default %(const)s; needs --model)")
    flag("--ce-temperature", type=float,
         help="contrastive entropy: divide scores by this (default %(default)s, the raw inner product)")
    flag("--ce-seed", type=int,
         help="contrastive entropy: seed of the negatives, the same for every model compared (default %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="a new or empty folder, or an earlier evaluation's with --overwrite (else refused)")
    p.add_argument("--overwrite", action="store_true", help="replace the earlier evaluation in --out")


def run_eval(args) -> int:
    """score an encoder (or BM25) on a BEIR / MS MARCO set: metrics, run, per query

    Encode the corpus and the judged queries, search, and write OUT/metrics.json (ndcg@10, mrr@10, mrr@100,
    recall@100, recall@1000, map), OUT/run.trec and OUT/per_query.jsonl.
    """
    from pretrieve.eval.evaluate import EvalOptions, baseline_table, run_eval

    result = run_eval(options_from(EvalOptions, args, split=qrels_split(args)))
    if args.model and args.bm25:  # the result line is the model's: BM25's numbers beside it (stdout stays one line)
        print(baseline_table(args.out), file=sys.stderr)
    print(json.dumps({k: result[k] for k in ("ndcg@10", "mrr@10", "recall@100", "map", "contrastive_entropy",
                                             "mteb_main_score", "dataset", "retriever") if k in result}))
    return 0


def add_farm(commands) -> None:
    p = command(commands, "farm", run_farm)
    p.add_argument("farm", metavar="FARM.yaml")
    slurm_jobs_option(p, "the pending jobs")
    p.add_argument("--follow", default=None, metavar="RUN_DIR",
                   help="evaluate each checkpoint of this pre-training run as it comes, until the run ends "
                        "(FARM.yaml's follow: block; see pretrieve/orchestrate/follow.py)")


def run_farm(args) -> int:
    """evaluate checkpoints x datasets x stages in parallel or on SLURM; MLflow

    Run every pending `pretrieve eval` job of FARM.yaml (see pretrieve/orchestrate/farm.py), skipping done ones, and
    log each to MLflow. With --follow RUN_DIR (or a follow: block), evaluate each checkpoint of a pre-training run as
    it writes them, until it ends.
    """
    from pretrieve.orchestrate.farm import run_farm
    from pretrieve.orchestrate.follow import follow_farm, follows

    if follows(args.farm, args.follow):
        if args.slurm:
            raise ValueError("--slurm lists the pending jobs once; a follower runs as long as its run: on SLURM, run "
                             "`pretrieve farm --follow` as a job of its own (docs/evaluation.md)")
        result = follow_farm(args.farm, args.follow)
        print(json.dumps(result))
        return 1 if result["failed"] else 0
    result = run_farm(args.farm, slurm_jobs=args.slurm)
    print(json.dumps(result))
    if args.slurm and result["pending_for_slurm"]:
        print(f"submit: sbatch --array=0-{result['pending_for_slurm'] - 1} launchers/slurm/eval_farm.sbatch "
              f"{args.slurm}; then run `pretrieve farm {args.farm}` again to log the results", file=sys.stderr)
    return 1 if result["failed"] else 0


def add_track(commands) -> None:
    from pretrieve.eval.track import STAGES  # light: building the parser must not import torch (farm does)

    p = command(commands, "track", run_track)
    p.add_argument("eval_dirs", nargs="+", metavar="EVAL_DIR", help="`pretrieve eval --out` folders")
    p.add_argument("--uri", required=True, help="MLflow tracking URI, e.g. sqlite:///farm-out/mlflow.db")
    p.add_argument("--experiment", default="pretrieve-eval", help="MLflow experiment (default: the farm's, "
                                                                  "pretrieve-eval)")
    p.add_argument("--checkpoint", default=None, metavar="NAME",
                   help="the report's row name, with one EVAL_DIR (default: each folder's name)")
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help="the report's column name (default: the dataset folder's name recorded in metrics.json)")
    p.add_argument("--stage", choices=STAGES, default="zero-shot")


def run_track(args) -> int:
    """log finished `pretrieve eval` folders as MLflow evaluation runs (report)

    Log each EVAL_DIR (metrics.json, run.trec, per_query.jsonl; with its bm25/ baseline) as the farm logs a job, so
    `pretrieve report` compares it with farm runs; a folder logged before is not logged again (see
    pretrieve/eval/track.py).
    """
    from pretrieve.eval.track import track

    print(json.dumps(track(args.eval_dirs, args.uri, args.experiment, args.checkpoint, args.dataset, args.stage)))
    return 0


def add_report(commands) -> None:
    p = command(commands, "report", run_report)
    p.add_argument("--uri", required=True, help="MLflow tracking URI, e.g. sqlite:///farm-out/mlflow.db")
    p.add_argument("--experiment", action="append", default=None, help="only these experiments (repeatable)")
    p.add_argument("--metric", action="append", default=None, help="metrics to tabulate (default ndcg@10, mrr@10, "
                                                                   "recall@100)")
    p.add_argument("--out", default="report", metavar="DIR")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report as an MLflow run's artifacts")


def run_report(args) -> int:
    """comparison tables (markdown, CSV) and plots of evaluation runs in MLflow"""
    from pretrieve.eval.report import DEFAULT_METRICS, write_report

    print(write_report(args.uri, args.out, args.experiment, tuple(args.metric or DEFAULT_METRICS),
                       log_to_mlflow=not args.no_mlflow))
    print(f"report: {args.out}/report.html (tables and plots on one page)", file=sys.stderr)
    return 0
