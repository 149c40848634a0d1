"""What the commands share: argument types, flags that take their defaults from options classes, the flags several
commands have (training data, retrieval sets, index, workers, pooling), options built from parsed arguments and
the result line."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
from dataclasses import fields

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


def command(commands, name: str, run, **kwargs) -> argparse.ArgumentParser:
    """The parser of command `name`, run by `run`, whose docstring says what the command does: its first paragraph
    is the command's line in `pretrieve --help`, the rest the command's own help (reflowed, unless `kwargs` name a
    raw formatter)."""
    summary, _, description = inspect.cleandoc(run.__doc__).partition("\n\n")
    p = commands.add_parser(name, help=" ".join(summary.split()), description=description or None, **kwargs)
    p.set_defaults(run=run)
    return p


def option(p, options, flag: str, help: str | None = None, shown: str | None = None, **kwargs) -> None:
    """A flag whose default is its field's in the options class `options` (--max-len: max_len), the one place
    that default is written; `shown`: how the help's end states it, "(default: SHOWN)" (None: not stated)."""
    p.add_argument(flag, default=default_of(options, flag.lstrip("-").replace("-", "_")),
                   help=help if shown is None else f"{help} (default: {shown})", **kwargs)


def options_from(options, args, **given):
    """The options class `options` from the parsed arguments of the same names; `given`: the fields whose flag is
    named otherwise or whose value is derived."""
    return options(**{**{f.name: getattr(args, f.name) for f in fields(options) if hasattr(args, f.name)}, **given})


def print_result(result: dict) -> None:
    """The result line of a training command: printed by rank 0 alone, in one write. Under torchrun every rank
    returns the result, and two ranks' prints interleave on the shared stdout (`{...}{...}` and an empty line)."""
    if int(os.environ.get("RANK", 0)) == 0:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


MODEL_SAYS = ("Default: what the model directory says (its sentence-transformers config, else "
              "pretrieve_finetune.json), else cls; printed with its source")


def config_and_overrides(p) -> None:
    p.add_argument("config", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")


def normalize_option(p, what: str) -> None:
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help=f"{what}; default: as the model directory says, else off")


def max_length_option(p) -> None:
    p.add_argument("--max-length", type=at_least(1), default=None,
                   help="tokens per text, queries and documents, its prompt and special tokens included (default: the "
                        "model's maximum length, else 256)")


def training_data(p, what: str) -> None:
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", nargs="+", default=[], metavar="FILE",
                      help=f"{what}: fine-tuning JSON lines (.jsonl) or query<TAB>pos<TAB>neg triples")
    data.add_argument("--msmarco", default=None, metavar="DIR", help="MS MARCO folder with a training split")
    data.add_argument("--beir", default=None, metavar="DIR", help="BEIR folder with a training split")
    p.add_argument("--split", default="train", help="qrels split of --msmarco / --beir (default train)")


def retrieval_set(p, split: bool = True, mteb: bool = False) -> None:
    """--beir / --msmarco (or with `mteb`, --mteb), and with `split` the qrels split (encode reads the corpus alone:
    it has none)."""
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--beir", default=None, metavar="DIR", help="BEIR folder: corpus.jsonl, queries.jsonl, qrels/")
    data.add_argument("--msmarco", default=None, metavar="DIR",
                      help="MS MARCO folder: collection.tsv or msmarco-docs.tsv, queries.SPLIT.tsv, qrels.SPLIT.tsv")
    if mteb:
        data.add_argument("--mteb", default=None, metavar="TASK[,TASK...]",
                          help="MTEB's own evaluation (the mteb package, offline from the Hugging Face cache) of "
                               "MTEB tasks (SciFact), benchmarks' retrieval tasks (\"MTEB(eng, v2)\", BEIR) or BEIR "
                               "folders as local tasks; MTEB's results in OUT/mteb/")
    if split:
        p.add_argument("--split", default=None,
                       help="qrels split (default: test for BEIR, dev for MS MARCO, each MTEB task's own)")


def qrels_split(args) -> str | None:
    if getattr(args, "mteb", None):
        return args.split  # None: each task's own (a BEIR folder's: test)
    return args.split or ("test" if args.beir else "dev")


def index_options(p, options) -> None:
    """--index, --nprobe, --ef-search, defaulting to `options`' fields (EvalOptions, MineOptions)."""
    from pretrieve.eval.search import INDEXES

    option(p, options, "--index", choices=INDEXES,
           help="flat: exact; ivf, ivfpq, hnsw: approximate faiss indexes, one per block of the corpus")
    option(p, options, "--nprobe", type=at_least(1), help="ivf / ivfpq: lists searched per query")
    option(p, options, "--ef-search", type=at_least(1),
           help="hnsw: candidates kept while searching (default max(128, depth))")


def worker_options(p, options, what: str) -> None:
    """--worker, --workers, defaulting to `options`' (MineOptions, or encode_corpus_shards' parameters)."""
    option(p, options, "--worker", type=int, help="this worker's index (default %(default)s)")
    option(p, options, "--workers", type=at_least(1), help=f"workers sharing the {what} (default %(default)s)")


def slurm_jobs_option(parser, what: str) -> None:
    parser.add_argument("--slurm", default=None, metavar="JOBS",
                        help=f"write {what} to JOBS for launchers/slurm/eval_farm.sbatch instead of running them")
