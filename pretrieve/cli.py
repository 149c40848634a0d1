"""`pretrieve <command>`: the command line. Each command parses its arguments and calls one module."""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap

from pretrieve import __version__
from pretrieve.engine.preemption import (INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, Stopped, end_by_sigint_at_exit,
                                        hold_stop_signals)
from pretrieve.engine.world import leave_process_group
from pretrieve.models.poolings import DENSE_POOLINGS, DUAL_POOLINGS, EVAL_POOLINGS
from pretrieve.utils.options import default_of


def at_least(low: int):
    """An argparse type: an int >= `low`; argparse refuses anything else naming the option, before any work."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # how argparse names the type when int() itself fails
    return parse


def mixture_weight(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"a mixture weight must be finite and >= 0, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called only when help is shown: it may import the heavy
    parts (torch), which no other use of the command line should wait for."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def main(argv: list[str] | None = None) -> int:
    """Run `pretrieve ARGV`; without `argv`, this process's command line, and the process is the command's: a
    training command holds stop signals from here (engine/preemption.py; `python -m pretrieve` from its first
    line), and one that SIGINT stopped ends the process by SIGINT."""
    if argv is None:
        hold_stop_signals(sys.argv[1:])
    parser = _Parser(prog="pretrieve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pretrieve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_tokenizer(commands)
    _add_prepare(commands)
    _add_stream(commands)
    _add_pretrain(commands)
    _add_export(commands)
    _add_card(commands)
    _add_universal(commands)
    _add_launch_info(commands)
    _add_finetune(commands)
    _add_finetune_stages(commands)
    _add_mine(commands)
    _add_teacher_scores(commands)
    _add_encode(commands)
    _add_eval(commands)
    _add_farm(commands)
    _add_track(commands)
    _add_report(commands)
    _add_scale(commands)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    code = _run_command(args, own_process=argv is None)
    if argv is None and code in (0, PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE):
        leave_process_group()
    if argv is None and code == INTERRUPTED_EXIT_CODE:
        end_by_sigint_at_exit()  # as an interrupted program ends: a shell script running it stops too
    return code


def _run_command(args, own_process: bool) -> int:
    """Run the command; its errors and stops as one line each. `own_process`: the command is this process's
    (`pretrieve ...`): Ctrl-C outside a training loop ends it with a line too (a caller in this process, such as
    a test, keeps its KeyboardInterrupt)."""
    import os

    try:
        return args.run(args)
    except Stopped as stopped:  # a stop signal, with the work so far saved
        if stopped.every_rank or int(os.environ.get("RANK", 0)) == 0:
            print(f"pretrieve {args.command}: {stopped.line}", file=sys.stderr)
        return stopped.code
    except KeyboardInterrupt:
        if not own_process:
            raise
        print(f"pretrieve {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except (ValueError, RuntimeError, OSError) as e:  # our errors carry file/line/key; no traceback needed
        print(f"pretrieve {args.command}: error: {e}", file=sys.stderr)
        return 1


def _add_pretrain(commands) -> None:
    p = commands.add_parser("pretrain", help="pre-train a registered method with DeepSpeed from a YAML config",
                            description="Train CONFIG (configs/pretrain/*.yaml) with dotted key=value overrides,\n"
                                        "e.g. run_dir=runs/x train.max_steps=100 checkpoint.every=50 resume=auto.",
                            formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_config_sections)
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(run=_run_pretrain)


def _config_sections() -> str:
    """The sections of a pre-training config and their keys, from the schema in config.py."""
    from pretrieve.config import PLAIN_KEYS, SECTIONS, section_keys

    lines = ["config sections and their keys (docs/training.md, \"The config\"; the methods' options:",
             "docs/methods.md):"]
    for name in SECTIONS:
        lines += textwrap.wrap(", ".join(section_keys(name)), width=110, initial_indent=f"  {name:<12}",
                               subsequent_indent=" " * 14)
    return "\n".join([*lines, f"plain keys: {', '.join(PLAIN_KEYS)}"])


def _run_pretrain(args) -> int:
    import os

    from pretrieve.config import experiment, load_config
    from pretrieve.pretrain import train

    config = load_config(args.config, args.overrides)
    world = int(os.environ.get("WORLD_SIZE", 1))
    print_result(train(experiment(config, world_size=world)))  # a stop signal: Stopped, reported by main
    return 0


def print_result(result: dict) -> None:
    """The result line of a training command: printed by rank 0 alone, in one write. Under torchrun every rank
    returns the result, and two ranks' prints interleave on the shared stdout (`{...}{...}` and an empty line)."""
    import os

    if int(os.environ.get("RANK", 0)) == 0:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def _add_launch_info(commands) -> None:
    p = commands.add_parser("launch-info", help="print the world and batch a launch of CONFIG would use; no training",
                            description="Resolve the world (hostfile, launcher environment, SLURM allocation or "
                                        "this machine), validate CONFIG for it and print hosts, ranks, devices and "
                                        "the batch arithmetic.")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile (launchers/make_hostfile.sh writes one)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(run=_run_launch_info)


def _run_launch_info(args) -> int:
    from pretrieve.config import deepspeed_config, ds_config_path, experiment, load_config
    from pretrieve.engine.world import local_devices, resolve_world
    from pretrieve.utils.run_dir import latest_checkpoint

    world = resolve_world(args.hostfile)
    exp = experiment(load_config(args.config, args.overrides), world_size=world.size)
    ds = deepspeed_config(exp)  # also checks the DeepSpeed JSON against the experiment
    t = exp.train
    devices, device_name = local_devices()
    info = {"world_size": world.size, "source": world.source, "hosts": dict(world.hosts),
            "devices_here": devices, "device": device_name, "micro_batch_size": t.micro_batch_size,
            "grad_accum": t.grad_accum, "global_batch_size": t.micro_batch_size * t.grad_accum * world.size,
            "max_len": getattr(exp.options, "max_len", None), "zero_stage": ds["zero_optimization"]["stage"],
            "precision": t.precision, "ds_config": str(ds_config_path(t)),
            "method": exp.method.name, "run_dir": str(exp.run_dir), "resume_from": latest_checkpoint(exp.run_dir)}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"world: {info['world_size']} ranks on {len(world.hosts)} host(s), from {world.source}")
    for host, slots in world.hosts:
        print(f"  {host}: {slots} rank(s)")
    print(f"devices here: {devices} x {device_name}")
    print(f"batch: micro {t.micro_batch_size} x grad_accum {t.grad_accum} x world {world.size} = global "
          f"{info['global_batch_size']} sequences of <= {info['max_len']} tokens")
    print(f"method {info['method']}, ZeRO {info['zero_stage']}, {t.precision} ({info['ds_config']})")
    resume = f"resume=auto continues from {info['resume_from']}" if info["resume_from"] else "no checkpoint yet"
    print(f"run_dir: {info['run_dir']} ({resume})")
    return 0


def _add_finetune(commands) -> None:
    p = commands.add_parser("finetune", help="fine-tune a retriever (stages 1-3) or its cross-encoder teacher",
                            description="Fine-tune with DeepSpeed from CONFIG (configs/finetune/*.yaml; see "
                                        "pretrieve/finetune/run.py) with dotted key=value overrides, e.g. "
                                        "finetune.init_from=runs/x/export run_dir=runs/x-ft1 resume=auto.")
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.set_defaults(run=_run_finetune)


def _run_finetune(args) -> int:
    import os

    from pretrieve.config import load_config
    from pretrieve.finetune.run import finetune, finetune_experiment

    config = load_config(args.config, args.overrides, required=("finetune",))
    world = int(os.environ.get("WORLD_SIZE", 1))
    print_result(finetune(finetune_experiment(config, world_size=world)))
    return 0


def _add_finetune_stages(commands) -> None:
    p = commands.add_parser("finetune-stages", help="the three fine-tuning stages of one model, chained and resumable",
                            description="Stage 1 (in-batch), mining, stage 2 (hard negatives), the cross-encoder "
                                        "teacher, its scores and stage 3 (distillation) into OUT/ (see "
                                        "pretrieve/orchestrate/finetune_stages.py); finished steps are skipped.")
    p.add_argument("--model", required=True, metavar="DIR", help="the pre-trained model (an export or HF BERT)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--config", required=True, metavar="CONFIG", help="base fine-tuning config (configs/finetune/)")
    _add_training_data(p, "training queries with positives")
    p.add_argument("--up-to", choices=("stage1", "stage2", "stage3"), default="stage3")
    p.add_argument("--teacher-init", default=None, metavar="DIR", help="the cross-encoder's start (default: --model)")
    p.add_argument("--negatives", type=int, default=15, help="hard negatives per query (default 15)")
    p.add_argument("--depth", type=at_least(1), default=200, help="mining depth (default 200)")
    p.add_argument("--pooling", choices=DUAL_POOLINGS, default=None,
                   help="dupmae: DupMAE's joint score, eq. 12 (--model: a DupMAE export). Default: the base config's, "
                        "else what --model says about itself, else cls")
    _normalize_option(p, "cosine similarity in training and mining")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every fine-tuning run (repeatable), e.g. --set train.max_steps=100")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks per fine-tuning run on this node (one per GPU; default 1); SIGTERM / SIGUSR1 / "
                        "SIGINT reach every rank, a preemption exits 85")
    p.set_defaults(run=_run_finetune_stages)


def _run_finetune_stages(args) -> int:
    from pretrieve.orchestrate.finetune_stages import StagesOptions, run_stages

    print_result(run_stages(StagesOptions(
        model=args.model, out=args.out, config=args.config, up_to=args.up_to, data=args.data, msmarco=args.msmarco,
        beir=args.beir, split=args.split, teacher_init=args.teacher_init, negatives=args.negatives, depth=args.depth,
        pooling=args.pooling, normalize=args.normalize, overrides=args.overrides, nproc=args.nproc)))
    return 0


def _add_training_data(p, what: str) -> None:
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", nargs="+", default=[], metavar="FILE",
                      help=f"{what}: fine-tuning JSON lines (.jsonl) or query<TAB>pos<TAB>neg triples")
    data.add_argument("--msmarco", default=None, metavar="DIR", help="MS MARCO folder with a training split")
    data.add_argument("--beir", default=None, metavar="DIR", help="BEIR folder with a training split")
    p.add_argument("--split", default="train", help="qrels split of --msmarco / --beir (default train)")


def _add_mine(commands) -> None:
    from functools import partial

    from pretrieve.finetune.mine import PASSAGE_MAX_LENGTH, MineOptions

    p = commands.add_parser("mine", help="mine ANN hard negatives with a fine-tuned retriever (stage 2's data)",
                            description="Encode the corpus (or read its vectors from --embeddings) and the training "
                                        "queries, search, drop positives and the top --skip, and sample --negatives "
                                        "from the results down to --depth; writes fine-tuning JSON lines. Worker i of "
                                        "n mines the i-th n-th of the queries into a part file; the worker that "
                                        "completes the parts merges them into --out.")
    p.add_argument("--model", required=True, metavar="DIR", help="the stage-1 retriever (its export directory)")
    _add_training_data(p, "training queries with positives")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    option = partial(_option, p, MineOptions)
    option("--depth", type=at_least(1), help="ranks sampled from (default %(default)s)")
    option("--negatives", type=int, help="negatives per query (default %(default)s)")
    option("--skip", type=int, help="top ranks left out (likely unjudged positives)")
    p.add_argument("--pooling", choices=DUAL_POOLINGS, default=None,
                   help=f"dupmae: eq. 12, searched as eval does. {MODEL_SAYS}")
    _normalize_option(p, "L2-normalize vectors")
    p.add_argument("--max-length", type=int, default=None,
                   help=f"passage tokens (default: the model's maximum length, else {PASSAGE_MAX_LENGTH})")
    option("--query-max-length", type=int)
    option("--batch-size", type=at_least(1))
    _index_options(p, MineOptions)
    p.add_argument("--embeddings", default=None, metavar="DIR",
                   help="--msmarco / --beir, cls / mean pooling: the corpus vectors `pretrieve encode` wrote to DIR "
                        "with this model and settings (default: encode the corpus here)")
    _worker_options(p, MineOptions, "queries")
    option("--seed", type=int)
    option("--on-missing", choices=("fail", "skip"))
    p.set_defaults(run=_run_mine)


def _run_mine(args) -> int:
    from pretrieve.finetune.mine import MineOptions, mine

    print(json.dumps(mine(MineOptions(
        model=args.model, out=args.out, data=args.data, msmarco=args.msmarco, beir=args.beir, split=args.split,
        on_missing=args.on_missing, depth=args.depth, negatives=args.negatives, skip=args.skip, pooling=args.pooling,
        normalize=args.normalize, max_length=args.max_length, query_max_length=args.query_max_length,
        batch_size=args.batch_size, index=args.index, nprobe=args.nprobe, ef_search=args.ef_search,
        embeddings=args.embeddings, worker=args.worker, workers=args.workers, seed=args.seed))))
    return 0


def _add_teacher_scores(commands) -> None:
    from pretrieve.finetune.mine import TeacherOptions

    p = commands.add_parser("teacher-scores", help="score training pairs with a cross-encoder (stage 3's soft labels)",
                            description="Add pos_scores / neg_scores from a fine-tuned cross-encoder "
                                        "(finetune.model=cross) to fine-tuning JSON lines.")
    p.add_argument("--model", required=True, metavar="DIR", help="the cross-encoder's export directory")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    _option(p, TeacherOptions, "--max-length", type=int, help="tokens per query-passage pair")
    _option(p, TeacherOptions, "--batch-size", type=at_least(1))
    p.set_defaults(run=_run_teacher_scores)


def _run_teacher_scores(args) -> int:
    from pretrieve.finetune.mine import TeacherOptions, teacher_scores

    print(json.dumps(teacher_scores(TeacherOptions(model=args.model, data=args.data, out=args.out,
                                                   max_length=args.max_length, batch_size=args.batch_size))))
    return 0


MODEL_SAYS = ("Default: what the model directory says (its sentence-transformers config, else "
              "pretrieve_finetune.json), else cls; printed with its source")


def _normalize_option(p, what: str) -> None:
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{what}; default: as the model directory says, else off")


def _max_length_option(p) -> None:
    p.add_argument("--max-length", type=int, default=None,
                   help="tokens per text, queries and documents (default: the model's maximum length, else 256)")


def _add_retrieval_set(p, split: bool = True) -> None:
    """--beir / --msmarco, and with `split` the qrels split (encode reads the corpus alone: it has none)."""
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--beir", default=None, metavar="DIR", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/")
    data.add_argument("--msmarco", default=None, metavar="DIR",
                      help="MS MARCO folder: collection.tsv or msmarco-docs.tsv, queries.SPLIT.tsv, qrels.SPLIT.tsv")
    if split:
        p.add_argument("--split", default=None, help="qrels split (default: test for BEIR, dev for MS MARCO)")


def _split(args) -> str:
    return args.split or ("test" if args.beir else "dev")


def _index_options(p, options) -> None:
    """--index, --nprobe, --ef-search, defaulting to `options`' fields (EvalOptions, MineOptions)."""
    from pretrieve.eval.search import INDEXES

    _option(p, options, "--index", choices=INDEXES,
            help="flat: exact; ivf, ivfpq, hnsw: approximate faiss indexes, one per block of the corpus")
    _option(p, options, "--nprobe", type=at_least(1), help="ivf / ivfpq: lists searched per query")
    _option(p, options, "--ef-search", type=at_least(1),
            help="hnsw: candidates kept while searching (default max(128, depth))")


def _worker_options(p, options, what: str) -> None:
    """--worker, --workers, defaulting to `options`' (MineOptions, or encode_corpus_shards' parameters)."""
    _option(p, options, "--worker", type=int, help="this worker's index (default %(default)s)")
    _option(p, options, "--workers", type=at_least(1), help=f"workers sharing the {what} (default %(default)s)")


def _add_eval(commands) -> None:
    from functools import partial

    from pretrieve.eval.contrastive import DEFAULT_NEGATIVES
    from pretrieve.eval.options import EvalOptions

    p = commands.add_parser("eval", help="score an encoder (or BM25) on a BEIR / MS MARCO set: metrics, run, per query",
                            description="Encode the corpus and the judged queries, search, and write OUT/metrics.json "
                                        "(ndcg@10, mrr@10, mrr@100, recall@100, recall@1000, map), OUT/run.trec and "
                                        "OUT/per_query.jsonl.")
    p.add_argument("--model", default=None, metavar="DIR", help="HF encoder directory (`pretrieve export` output)")
    _add_retrieval_set(p)
    p.add_argument("--pooling", choices=EVAL_POOLINGS, default=None,
                   help="cls / mean: dense; dupmae (eq. 12: a DupMAE export or a model fine-tuned with dupmae), "
                        f"sparse (SPLADE-style) and hybrid (CLS + sparse) need the model's MLM head. {MODEL_SAYS}")
    option = partial(_option, p, EvalOptions)
    option("--vocab-top-k", type=int, help="dupmae / sparse / hybrid: entries a document keeps (default: dupmae the "
                                           "trained k, else 384; sparse / hybrid 256)")
    option("--sparse-weight", type=float, help="hybrid: weight of the sparse score")
    option("--candidates", type=int,
           help="dupmae / hybrid: re-score each query's dense + sparse top N instead of the whole corpus "
                "(default: exact up to 100,000 documents, 1,000 candidates beyond)")
    _normalize_option(p, "L2-normalize vectors (cosine similarity)")
    _max_length_option(p)
    option("--batch-size", type=at_least(1))
    _index_options(p, EvalOptions)
    option("--depth", type=at_least(1), help="documents retrieved per query")
    p.add_argument("--bm25", action="store_true", help="BM25 baseline (alone, or beside --model in OUT/bm25/)")
    option("--on-missing", choices=("fail", "skip"),
           help="qrels naming an unknown query or document: stop with file:line (fail), or drop and count")
    option("--embeddings", metavar="DIR",
           help="dense: read the corpus vectors `pretrieve encode` wrote to DIR instead of encoding")
    option("--contrastive-entropy", type=int, nargs="?", const=DEFAULT_NEGATIVES, metavar="K",
           help="also write contrastive_entropy (Fang et al. 2024): mean -log p(relevant) against K fixed sampled "
                "negatives per judged pair, by the model's own scores (K default %(const)s; needs --model)")
    option("--ce-temperature", type=float,
           help="contrastive entropy: divide scores by this (default %(default)s, the raw inner product)")
    option("--ce-seed", type=int,
           help="contrastive entropy: seed of the negatives, the same for every model compared (default %(default)s)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(run=_run_eval)


def _add_encode(commands) -> None:
    from pretrieve.eval.options import EncodeOptions
    from pretrieve.eval.vectors import DTYPES, encode_corpus_shards

    p = commands.add_parser("encode", help="encode a corpus to .npy + .ids shards, resumable, split over workers",
                            description="Stream the corpus through the encoder and write DIR/corpus-NNNNN.npy and "
                                        ".ids per --shard-size documents; worker i of n takes every n-th shard, "
                                        "on GPU i mod the GPUs it sees, and complete shards are skipped. "
                                        "`pretrieve eval --embeddings DIR` and `pretrieve mine --embeddings DIR` "
                                        "with the same model and settings read them.")
    p.add_argument("--model", required=True, metavar="DIR")
    _add_retrieval_set(p, split=False)
    p.add_argument("--pooling", choices=DENSE_POOLINGS, default=None, help=MODEL_SAYS)
    _normalize_option(p, "L2-normalize vectors (cosine similarity)")
    _max_length_option(p)
    _option(p, EncodeOptions, "--batch-size", type=at_least(1))
    _option(p, encode_corpus_shards, "--shard-size", type=at_least(1), help="documents per shard")
    _option(p, encode_corpus_shards, "--dtype", choices=DTYPES,
            help="vectors as stored (float16: half the disk; search computes in float32 or more)")
    _worker_options(p, encode_corpus_shards, "shards of DIR")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(run=_run_encode)


def _run_encode(args) -> int:
    from pretrieve.data.retrieval import stream_corpus
    from pretrieve.engine.devices import worker_device
    from pretrieve.eval.encode import DenseEncoder, EncodeOptions
    from pretrieve.eval.model_config import resolve_encoding
    from pretrieve.eval.vectors import encode_corpus_shards

    encoding = resolve_encoding(args.model, args.pooling, args.normalize, args.max_length)
    if encoding.pooling not in DENSE_POOLINGS:
        raise ValueError(f"{args.model}: pooling {encoding.pooling} ({encoding.source}) is not a dense pooling; "
                         "`pretrieve encode` writes cls or mean vectors (give --pooling)")
    encoder = DenseEncoder(args.model, EncodeOptions(encoding.pooling, encoding.max_length, args.batch_size,
                                                     encoding.normalize), device=worker_device(args.worker))
    shards, documents = encode_corpus_shards(encoder, stream_corpus(args.beir, args.msmarco), args.out,
                                             args.shard_size, args.worker, args.workers, args.dtype)
    print(json.dumps({"out": args.out, "documents": documents, "shards": [s.name for s in shards]}))
    return 0


def _run_eval(args) -> int:
    from pretrieve.eval.evaluate import EvalOptions, baseline_table, run_eval

    result = run_eval(EvalOptions(
        out=args.out, model=args.model, beir=args.beir, msmarco=args.msmarco, split=_split(args), pooling=args.pooling,
        max_length=args.max_length, normalize=args.normalize, batch_size=args.batch_size, index=args.index,
        nprobe=args.nprobe, ef_search=args.ef_search, depth=args.depth, bm25=args.bm25, on_missing=args.on_missing,
        vocab_top_k=args.vocab_top_k, sparse_weight=args.sparse_weight, candidates=args.candidates,
        embeddings=args.embeddings, contrastive_entropy=args.contrastive_entropy, ce_temperature=args.ce_temperature,
        ce_seed=args.ce_seed))
    if args.model and args.bm25:  # the result line is the model's: BM25's numbers beside it (stdout stays one line)
        print(baseline_table(args.out), file=sys.stderr)
    print(json.dumps({k: result[k] for k in ("ndcg@10", "mrr@10", "recall@100", "map", "contrastive_entropy",
                                             "dataset", "retriever") if k in result}))
    return 0


def _add_farm(commands) -> None:
    p = commands.add_parser("farm", help="evaluate checkpoints x datasets x stages in parallel or on SLURM; MLflow",
                            description="Run every pending `pretrieve eval` job of FARM.yaml (see "
                                        "pretrieve/orchestrate/farm.py), skipping done ones, and log each to MLflow.")
    p.add_argument("farm", metavar="FARM.yaml")
    _slurm_jobs_option(p, "the pending jobs")
    p.set_defaults(run=_run_farm)


def _slurm_jobs_option(parser, what: str) -> None:
    parser.add_argument("--slurm", default=None, metavar="JOBS",
                        help=f"write {what} to JOBS for launchers/slurm/eval_farm.sbatch instead of running them")


def _run_farm(args) -> int:
    from pretrieve.orchestrate.farm import run_farm

    result = run_farm(args.farm, slurm_jobs=args.slurm)
    print(json.dumps(result))
    if args.slurm and result["pending_for_slurm"]:
        print(f"submit: sbatch --array=0-{result['pending_for_slurm'] - 1} launchers/slurm/eval_farm.sbatch "
              f"{args.slurm}; then run `pretrieve farm {args.farm}` again to log the results", file=sys.stderr)
    return 1 if result["failed"] else 0


def _add_track(commands) -> None:
    from pretrieve.eval.track import STAGES  # light: building the parser must not import torch (farm does)

    p = commands.add_parser("track", help="log finished `pretrieve eval` folders as MLflow evaluation runs (report)",
                            description="Log each EVAL_DIR (metrics.json, run.trec, per_query.jsonl; with its bm25/ "
                                        "baseline) as the farm logs a job, so `pretrieve report` compares it with "
                                        "farm runs; a folder logged before is not logged again (see "
                                        "pretrieve/eval/track.py).")
    p.add_argument("eval_dirs", nargs="+", metavar="EVAL_DIR", help="`pretrieve eval --out` folders")
    p.add_argument("--uri", required=True, help="MLflow tracking URI, e.g. sqlite:///farm-out/mlflow.db")
    p.add_argument("--experiment", default="pretrieve-eval", help="MLflow experiment (default: the farm's, "
                                                                  "pretrieve-eval)")
    p.add_argument("--checkpoint", default=None, metavar="NAME",
                   help="the report's row name, with one EVAL_DIR (default: each folder's name)")
    p.add_argument("--dataset", default=None, metavar="NAME",
                   help="the report's column name (default: the dataset folder's name recorded in metrics.json)")
    p.add_argument("--stage", choices=STAGES, default="zero-shot")
    p.set_defaults(run=_run_track)


def _run_track(args) -> int:
    from pretrieve.eval.track import track

    print(json.dumps(track(args.eval_dirs, args.uri, args.experiment, args.checkpoint, args.dataset, args.stage)))
    return 0


def _add_report(commands) -> None:
    p = commands.add_parser("report", help="comparison tables (markdown, CSV) and plots of evaluation runs in MLflow")
    p.add_argument("--uri", required=True, help="MLflow tracking URI, e.g. sqlite:///farm-out/mlflow.db")
    p.add_argument("--experiment", action="append", default=None, help="only these experiments (repeatable)")
    p.add_argument("--metric", action="append", default=None, help="metrics to tabulate (default ndcg@10, mrr@10, "
                                                                   "recall@100)")
    p.add_argument("--out", default="report", metavar="DIR")
    p.add_argument("--no-mlflow", action="store_true", help="do not log the report as an MLflow run's artifacts")
    p.set_defaults(run=_run_report)


def _run_report(args) -> int:
    from pretrieve.eval.report import DEFAULT_METRICS, write_report

    print(write_report(args.uri, args.out, args.experiment, tuple(args.metric or DEFAULT_METRICS),
                       log_to_mlflow=not args.no_mlflow))
    print(f"report: {args.out}/report.html (tables and plots on one page)", file=sys.stderr)
    return 0


def _add_scale(commands) -> None:
    from pretrieve.scale.memory import DEVICES

    p = commands.add_parser("scale", help="scaling studies: plan a study's grid, fit scaling laws to its points")
    actions = p.add_subparsers(dest="scale_command", metavar="ACTION", required=True)
    fit = actions.add_parser("fit", help="fit Chinchilla / joint / single-variable laws, IsoFLOP allocation, metric",
                             description="Fit the study's points (its MLflow child runs, or a CSV with N, D, loss "
                                         "[, C, method, metric]) per method and write OUT/fit.json, fit.md, "
                                         "points.csv and plots (see pretrieve/scale/report.py).")
    source = fit.add_mutually_exclusive_group(required=True)
    source.add_argument("study", nargs="?", default=None, metavar="STUDY.yaml")
    source.add_argument("--csv", default=None, metavar="POINTS.csv")
    fit.add_argument("--out", required=True, metavar="DIR")
    fit.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for the 95%% intervals")
    fit.add_argument("--holdout", choices=("largest",), default=None,
                     help="largest: also fit without the largest compute budget and report the error on it")
    fit.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resamples")
    fit.set_defaults(run=_run_scale_fit)
    plan = actions.add_parser("plan", help="the study's grid: N, D, FLOPs and device-hours per point; writes plan.json",
                              description="Check STUDY.yaml, print its grid (pretrieve/scale/plan.py documents the "
                                          "keys) and write the run list to <run.out>/plan.json.")
    plan.add_argument("study", metavar="STUDY.yaml")
    plan.add_argument("--device", choices=sorted(DEVICES), default=None,
                      help="the device each rank trains on: its peak FLOP/s at the points' precision x --mfu gives "
                           "the device-hours, and a point whose micro-batch will not fit its memory is warned "
                           "about (default: this machine's CPU, measured, no memory check)")
    plan.add_argument("--mfu", type=float, default=0.25,
                      help="model FLOPs utilisation a run sustains, the share of the peak (default 0.25; "
                           "`pretrain` logs the real one)")
    plan.add_argument("--flops-per-second", type=float, default=None,
                      help="sustained FLOP/s of one device for the estimate, instead of the device's peak x --mfu")
    plan.set_defaults(run=_run_scale_plan)
    run = actions.add_parser("run", help="pre-train every point of the study, then evaluate them (MLflow child runs)",
                             description="Pre-train the pending points of STUDY.yaml (resume=auto), then evaluate "
                                         "the finished ones through `pretrieve farm`; see pretrieve/orchestrate/scale_run.py.")
    run.add_argument("study", metavar="STUDY.yaml")
    _slurm_jobs_option(run, "the pending jobs (pre-training, then evaluation)")
    run.set_defaults(run=_run_scale_run)


def _run_scale_fit(args) -> int:
    from pretrieve.scale.report import run_fit

    print(json.dumps(run_fit(args.out, study=args.study, points_csv=args.csv, bootstrap=args.bootstrap,
                             holdout=args.holdout, seed=args.seed)))
    return 0


def _run_scale_plan(args) -> int:
    from functools import cache

    from pretrieve.scale.memory import device, device_flops, fit_advice
    from pretrieve.scale.plan import plan, table, write_plan

    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    study, points = plan(args.study)
    name = args.device or "cpu"
    if args.flops_per_second:
        print(table(points, lambda p: args.flops_per_second, f"{args.flops_per_second:.3g} FLOP/s"))
    else:
        peak = cache(device_flops)  # the CPU's is measured: once
        peaks = sorted({f"{peak(name, p.precision):.3g} FLOP/s at {p.precision}" for p in points})
        print(table(points, lambda p: args.mfu * peak(name, p.precision),
                    f"{args.mfu:.0%} MFU of {name} ({', '.join(peaks)})"))
    if args.device:
        for point in points:
            advice = fit_advice(point, args.device, device(args.device).memory)
            if advice:
                print(f"pretrieve scale plan: warning: {advice}", file=sys.stderr)
    print(f"run list: {write_plan(study, points)}")
    return 0


def _run_scale_run(args) -> int:
    from pretrieve.orchestrate.scale_run import run_study

    result = run_study(args.study, slurm_jobs=args.slurm)
    print(json.dumps(result))
    return 1 if result.get("failed") else 0


def _add_export(commands) -> None:
    p = commands.add_parser("export", help="export a training checkpoint as a HF directory (+ head weights)",
                            description="CHECKPOINT: a run directory (latest checkpoint), its checkpoints/ "
                                        "directory or a tag directory; ZeRO partitions are consolidated.")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from pathlib import Path

    from pretrieve.models.export import describe_export
    from pretrieve.pretrain import export_checkpoint
    from pretrieve.utils.run_dir import locate

    run_dir, _, tag = locate(Path(args.checkpoint))
    print(describe_export(export_checkpoint(args.checkpoint, args.out), source=f"{run_dir}, checkpoint {tag}"))
    return 0


def _add_card(commands) -> None:
    p = commands.add_parser("card", help="write a run's model card (RUN/export/README.md) again, with its evaluations",
                            description="Generate the Hugging Face model card of RUN/export from the run directory "
                                        "(method, size, data, tokens, steps, losses) and every evaluation the farm "
                                        "has logged for it in MLflow.")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="the MLflow store the farm logs to (default: the run's own, from RUN/run.json)")
    p.set_defaults(run=_run_card)


def _run_card(args) -> int:
    from pretrieve.eval.model_card import refresh_card

    print(refresh_card(args.run_dir, args.tracking_uri))
    return 0


def _add_universal(commands) -> None:
    p = commands.add_parser("universal", help="convert a run's latest checkpoint for resuming at another world size",
                            description="Convert RUN's latest ZeRO 1-3 checkpoint into a DeepSpeed universal "
                                        "checkpoint and make it `latest`; then `pretrain ... resume=auto` at any "
                                        "world size continues the run.")
    p.add_argument("run_dir", metavar="RUN")
    p.set_defaults(run=_run_universal)


def _run_universal(args) -> int:
    from pretrieve.engine.universal import to_universal

    print(to_universal(args.run_dir))
    return 0


def _add_prepare(commands) -> None:
    import os
    from functools import partial

    from pretrieve.data.corpora import SOURCES
    from pretrieve.data.prepare import PrepareOptions

    p = commands.add_parser("prepare", help="raw corpus -> tokenized, packed webdataset shards + manifest.json",
                            description="Read a raw corpus, tokenize, pack sentences into blocks and write "
                                        "webdataset shards and manifest.json. Re-running resumes. Split over "
                                        "jobs: --part I --parts N in each (own --out), then --combine.")
    option = partial(_option, p, PrepareOptions, shown="%(default)s")
    p.add_argument("--source", choices=SOURCES, help="the corpus format (needed unless --combine)")
    p.add_argument("--input", nargs="+", metavar="PATH", help="files or directories (needed unless --combine)")
    p.add_argument("--out", required=True, metavar="DIR", help="a folder, or a URL (s3://, gs://, file://)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="local HF tokenizer directory "
                   "(default: the bundled bert-base-uncased WordPiece vocabulary)")
    option("--max-len", "model sequence length; blocks hold max_len-2 tokens", type=int)
    p.add_argument("--workers", type=int, default=None,
                   help=f"tokenizer processes; 0 = in-process (default: all cores, {os.cpu_count()} here)")
    option("--shard-size", "samples per shard", type=int)
    option("--on-error", "bad records: stop with file:line (fail) or skip and count them in the manifest",
           choices=("fail", "skip"))
    option("--packing", "sentences: greedy sentence packing; passage: one text per sample",
           shown="passage for msmarco-passage and beir, else sentences", choices=("sentences", "passage"))
    option("--short-seq-prob", "probability of a shorter block target, BERT's 0.1", type=float)
    option("--seed", "of the --short-seq-prob block targets", type=int)
    option("--text-field", "jsonl / parquet: field holding the text")
    option("--id-field", "jsonl / parquet: field holding the document id")
    option("--queries-field", "jsonl / parquet: optional list of pseudo-queries per document, kept for CoT-MAE; '' "
           "for none")
    option("--title-field", "jsonl / parquet: optional title field; '' for none")
    option("--books-format", "books: paragraphs separated by blank lines (file) or one sentence per line (lines)",
           choices=("file", "lines"))
    p.add_argument("--overwrite", action="store_true", help="delete an earlier output in --out first (default: off)")
    option("--holdout", "split by document: this share of documents (by a hash of the id) is the validation side",
           shown="%(default)s, no split", type=float, metavar="FRACTION")
    option("--split", "with --holdout: the side this --out holds, run once per side", choices=("train", "validation"))
    option("--part", "with --parts: prepare record groups I, I+N, I+2N, ... of the input (e.g. a SLURM array task)",
           type=at_least(0), metavar="I")
    option("--parts", "jobs the input is split over", type=at_least(1), metavar="N")
    option("--group-records", "consecutive records per group, the unit of --part; no shard spans two groups",
           type=at_least(1), metavar="R")
    p.add_argument("--combine", nargs="+", default=None, metavar="PART",
                   help="write --out's manifest over the shards of these --part outputs (one corpus, as one job) "
                        "(default: none: prepare from --input)")
    p.set_defaults(run=_run_prepare)


def _add_tokenizer(commands) -> None:
    from functools import partial

    from pretrieve.data.corpora import SOURCES, ReaderOptions
    from pretrieve.data.tokenizer_train import KINDS, TokenizerTrainOptions

    p = commands.add_parser("tokenizer", help="train a WordPiece, BPE or Unigram tokenizer on raw corpora")
    actions = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = actions.add_parser(
        "train", help="raw corpus -> a HF tokenizer directory for `prepare --tokenizer` and `data.tokenizer`",
        description="Train a tokenizer (HF tokenizers) on a raw corpus, read as `prepare` reads it, and write a "
                    "HF tokenizer directory with the conventions of its backbone family: wordpiece (BERT), bpe "
                    "(RoBERTa, byte-level), unigram (XLM-R, SentencePiece).")
    option = partial(_option, train, TokenizerTrainOptions, shown="%(default)s")
    train.add_argument("--source", choices=SOURCES, required=True, help="the corpus format")
    train.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    train.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    option("--kind", "wordpiece: BERT's; bpe: RoBERTa's byte-level BPE; unigram: XLM-R's SentencePiece unigram",
           choices=KINDS)
    option("--vocab-size", "tokens in the vocabulary, special tokens included (a small corpus may give fewer)",
           type=at_least(300))
    option("--min-frequency", "wordpiece / bpe: occurrences a merge needs", type=at_least(1))
    train.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                       help="lower-case the text (default: yes for wordpiece, as bert-base-uncased; no otherwise)")
    option("--max-documents", "train on the first N documents only", shown="all", type=at_least(1), metavar="N")
    option("--model-max-length", "the longest input the tokenizer config declares", type=at_least(1))
    option("--on-error", "bad records: stop with file:line (fail) or skip and count them", choices=("fail", "skip"))
    train.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: off)")
    reader = partial(_option, train, ReaderOptions, shown="%(default)s")
    reader("--text-field", "jsonl / parquet: field holding the text")
    reader("--id-field", "jsonl / parquet: field holding the document id")
    reader("--title-field", "jsonl / parquet: optional title field, prepended to the text; '' for none")
    reader("--books-format", "books: paragraphs separated by blank lines (file) or one sentence per line (lines)",
           choices=("file", "lines"))
    train.set_defaults(run=_run_tokenizer_train)


def _run_tokenizer_train(args) -> int:
    from pretrieve.data.corpora import ReaderOptions
    from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    record = train_tokenizer(TokenizerTrainOptions(
        source=args.source, inputs=args.input, out=args.out, kind=args.kind, vocab_size=args.vocab_size,
        min_frequency=args.min_frequency, lowercase=args.lowercase, max_documents=args.max_documents,
        model_max_length=args.model_max_length, on_error=args.on_error, overwrite=args.overwrite,
        reader=ReaderOptions(text_field=args.text_field, id_field=args.id_field,
                             title_field=args.title_field or None, books_format=args.books_format)))
    print(f"{args.out}: {record['kind']} tokenizer of {record['vocab_size']:,} tokens from "
          f"{record['documents']:,} documents ({record['characters']:,} characters); skipped "
          f"{record['skipped'] or 'none'}; {record['fingerprint'][:19]}...")
    return 0


def _option(p, options, flag: str, help: str | None = None, shown: str | None = None, **kwargs) -> None:
    """A flag whose default is its field's in the options class `options` (--max-len: max_len), the one place
    that default is written; `shown`: how the help's end states it, "(default: SHOWN)" (None: not stated)."""
    p.add_argument(flag, default=default_of(options, flag.lstrip("-").replace("-", "_")),
                   help=help if shown is None else f"{help} (default: {shown})", **kwargs)


def _run_prepare(args) -> int:
    from pretrieve.data.prepare import PrepareOptions, prepare
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    if args.combine:
        return _run_prepare_combine(args)
    if not args.source or not args.input:
        raise ValueError("--source and --input are needed (or --combine PART... to join the parts of a split run)")
    opts = PrepareOptions(
        source=args.source, inputs=args.input, out=args.out, tokenizer=args.tokenizer or DEFAULT_TOKENIZER,
        max_len=args.max_len, shard_size=args.shard_size, on_error=args.on_error, packing=args.packing,
        short_seq_prob=args.short_seq_prob, seed=args.seed, text_field=args.text_field, id_field=args.id_field,
        title_field=args.title_field or None, queries_field=args.queries_field or None,
        books_format=args.books_format, overwrite=args.overwrite, holdout=args.holdout, split=args.split,
        part=args.part, parts=args.parts, group_records=args.group_records,
    )
    if args.workers is not None:
        opts.workers = args.workers
    _print_prepared(args.out, prepare(opts))
    return 0


def _run_prepare_combine(args) -> int:
    from pretrieve.data.combine import combine

    if args.source or args.input:
        raise ValueError("--combine joins prepared parts; it takes no --source or --input")
    _print_prepared(args.out, combine(args.combine, args.out))
    return 0


def _print_prepared(out: str, m: dict) -> None:
    print(f"{out}: {m['num_documents']:,} documents -> {m['num_samples']:,} samples, {m['num_tokens']:,} tokens "
          f"in {len(m['shards'])} shards; skipped {m['skipped'] or 'none'}; truncated {m['truncated_documents']}")


def _add_stream(commands) -> None:
    p = commands.add_parser("stream", help="stream shards for N epochs and print counts and throughput",
                            description="Read prepared shards through the training stream (mixture, shuffle, "
                                        "rank/worker split) and report what came out.")
    p.add_argument("manifests", nargs="+", metavar="MANIFEST", help="manifest.json files (or their directories)")
    p.add_argument("--weights", type=mixture_weight, nargs="+", default=None, help="mixture weights, one per manifest")
    p.add_argument("--epochs", type=at_least(1), default=1)
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader workers")
    p.add_argument("--shuffle-buffer", type=at_least(1), default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_run_stream)


def _run_stream(args) -> int:
    from pretrieve.data.stream_counts import epoch_counts

    for counts in epoch_counts(args.manifests, epochs=args.epochs, batch_size=args.batch_size, workers=args.workers,
                               shuffle_buffer=args.shuffle_buffer, seed=args.seed, weights=args.weights):
        print(json.dumps(counts))
    return 0
