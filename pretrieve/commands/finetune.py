"""`pretrieve finetune`, `finetune-stages`, `mine` and `teacher-scores`: fine-tuning a retriever and the data of
its stages. Each command's flags are in its `add_` function, its work in its `run_` function."""

from __future__ import annotations

import json
from functools import partial

from pretrieve.commands.arguments import (MODEL_SAYS, at_least, command, config_and_overrides, index_options,
                                          normalize_option, option, options_from, print_result, training_data,
                                          worker_options)
from pretrieve.models.poolings import DUAL_POOLINGS


def add_finetune(commands) -> None:
    p = command(commands, "finetune", run_finetune)
    config_and_overrides(p)


def run_finetune(args) -> int:
    """fine-tune a retriever (stages 1-3) or its cross-encoder teacher

    Fine-tune with DeepSpeed from CONFIG (configs/finetune/*.yaml; see pretrieve/finetune/run.py) with dotted
    key=value overrides, e.g. finetune.init_from=runs/x/export run_dir=runs/x-ft1 resume=auto.
    """
    import os

    from pretrieve.config import load_config
    from pretrieve.finetune.config import finetune_experiment
    from pretrieve.finetune.run import finetune

    config = load_config(args.config, args.overrides, required=("finetune",))
    world = int(os.environ.get("WORLD_SIZE", 1))
    print_result(finetune(finetune_experiment(config, world_size=world)))
    return 0


def add_finetune_stages(commands) -> None:
    p = command(commands, "finetune-stages", run_finetune_stages)
    p.add_argument("--model", required=True, metavar="DIR", help="the pre-trained model (an export or HF BERT)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--config", required=True, metavar="CONFIG", help="base fine-tuning config (configs/finetune/)")
    training_data(p, "training queries with positives")
    p.add_argument("--up-to", choices=("stage1", "stage2", "stage3"), default="stage3")
    p.add_argument("--teacher-init", default=None, metavar="DIR", help="the cross-encoder's start (default: --model)")
    p.add_argument("--negatives", type=int, default=15, help="hard negatives per query (default 15)")
    p.add_argument("--depth", type=at_least(1), default=200, help="mining depth (default 200)")
    p.add_argument("--pooling", choices=DUAL_POOLINGS, default=None,
                   help="dupmae: DupMAE's joint score, eq. 12 (--model: a DupMAE export). Default: the base config's, "
                        "else what --model says about itself, else cls")
    normalize_option(p, "cosine similarity in training and mining")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every fine-tuning run (repeatable), e.g. --set train.max_steps=100")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks per fine-tuning run on this node (one per GPU; default 1); SIGTERM / SIGUSR1 / "
                        "SIGINT reach every rank, a preemption exits 85")


def run_finetune_stages(args) -> int:
    """the three fine-tuning stages of one model, chained and resumable

    Stage 1 (in-batch), mining, stage 2 (hard negatives), the cross-encoder teacher, its scores and stage 3
    (distillation) into OUT/ (see pretrieve/orchestrate/finetune_stages.py); finished steps are skipped.
    """
    from pretrieve.orchestrate.finetune_stages import StagesOptions, run_stages

    print_result(run_stages(options_from(StagesOptions, args)))
    return 0


def add_mine(commands) -> None:
    from pretrieve.finetune.mine import PASSAGE_MAX_LENGTH, MineOptions

    p = command(commands, "mine", run_mine)
    p.add_argument("--model", required=True, metavar="DIR", help="the stage-1 retriever (its export directory)")
    training_data(p, "training queries with positives")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    flag = partial(option, p, MineOptions)
    flag("--depth", type=at_least(1), help="ranks sampled from (default %(default)s)")
    flag("--negatives", type=int, help="negatives per query (default %(default)s)")
    flag("--skip", type=int, help="top ranks left out (likely unjudged positives)")
    p.add_argument("--pooling", choices=DUAL_POOLINGS, default=None,
                   help=f"dupmae: eq. 12, searched as eval does. {MODEL_SAYS}")
    normalize_option(p, "L2-normalize vectors")
    p.add_argument("--max-length", type=at_least(1), default=None,
                   help=f"passage tokens, its prompt and special tokens included (default: the model's maximum length, else {PASSAGE_MAX_LENGTH})")
    flag("--query-max-length", type=at_least(3),
         help="a query's tokens after its prompt, its special tokens included (default %(default)s)")
    flag("--batch-size", type=at_least(1))
    index_options(p, MineOptions)
    p.add_argument("--embeddings", default=None, metavar="DIR",
                   help="--msmarco / --beir, cls / mean pooling: the corpus vectors `pretrieve encode` wrote to DIR "
                        "with this model and settings (default: encode the corpus here)")
    worker_options(p, MineOptions, "queries")
    flag("--seed", type=int)
    flag("--on-missing", choices=("fail", "skip"))
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (else refused)")


def run_mine(args) -> int:
    """mine ANN hard negatives with a fine-tuned retriever (stage 2's data)

    Encode the corpus (or read its vectors from --embeddings) and the training queries, search, drop positives and
    the top --skip, and sample --negatives from the results down to --depth; writes fine-tuning JSON lines. Worker i
    of n mines the i-th n-th of the queries into a part file; the worker that completes the parts merges them into
    --out.
    """
    from pretrieve.finetune.mine import MineOptions, mine

    print(json.dumps(mine(options_from(MineOptions, args))))
    return 0


def add_teacher_scores(commands) -> None:
    from pretrieve.finetune.mine import TeacherOptions

    p = command(commands, "teacher-scores", run_teacher_scores)
    p.add_argument("--model", required=True, metavar="DIR", help="the cross-encoder's export directory")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE")
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    option(p, TeacherOptions, "--max-length", type=at_least(1), help="tokens per query-passage pair")
    option(p, TeacherOptions, "--batch-size", type=at_least(1))
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file (else refused)")


def run_teacher_scores(args) -> int:
    """score training pairs with a cross-encoder (stage 3's soft labels)

    Add pos_scores / neg_scores from a fine-tuned cross-encoder (finetune.model=cross) to fine-tuning JSON lines.
    """
    from pretrieve.finetune.mine import TeacherOptions, teacher_scores

    print(json.dumps(teacher_scores(options_from(TeacherOptions, args))))
    return 0
