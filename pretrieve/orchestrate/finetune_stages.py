"""`pretrieve finetune-stages`: the three fine-tuning stages of RetroMAE-2 (ACL 2023) §3.5 for one
pre-trained model, chained:

    OUT/stage1/         contrastive, in-batch negatives (eq. 13), from MODEL
    OUT/hard.jsonl      ANN hard negatives mined with stage 1 (`pretrieve mine`)
    OUT/stage2/         contrastive, hard + in-batch negatives (eq. 14), from stage 1
    OUT/teacher/        the BERT cross-encoder on the hard negatives, from TEACHER_INIT (default MODEL)
    OUT/distill.jsonl   its scores (`pretrieve teacher-scores`)
    OUT/stage3/         soft-label distillation (eq. 15), from stage 2

Each stage's model is OUT/<stage>/export. A step whose output exists is skipped; a fine-tuning run that was
stopped continues from its checkpoint (resume=auto), so re-running after a crash or preemption loses nothing.
Every fine-tuning run is `pretrieve finetune BASE_CONFIG` with the overrides below, then the caller's: in this
process, or with `nproc` > 1 as NPROC `pretrieve finetune ...` ranks on this node (one per GPU, started as
torchrun would; in-batch negatives gathered from every rank), while mining and teacher scoring run here.
The process holds SIGTERM / SIGUSR1 / SIGINT from its first line (engine/preemption.py) and passes them on to
every rank. A preempted run (exit 85) ends the chain with exit 85 too; a Ctrl-C, with a checkpoint of the running
fine-tuning, ends it by SIGINT (status 130), and at once while mining or scoring, whose files are written whole
or not at all; a signal between two steps stops the chain before the next. Re-running continues it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pretrieve.engine.preemption import (Interrupted, Preempted, Stop, Stopped, interruptible, requested,
                                        stop_of_status)
from pretrieve.finetune.run import FINETUNE_META
from pretrieve.utils.run_dir import latest_checkpoint

STAGES = ("stage1", "stage2", "stage3")


@dataclass
class StagesOptions:
    model: str
    out: str
    config: str  # the base fine-tuning config (configs/finetune/*.yaml)
    up_to: str = "stage3"
    data: list[str] = field(default_factory=list)  # training data: files, or one of msmarco / beir
    msmarco: str | None = None
    beir: str | None = None
    split: str = "train"
    teacher_init: str | None = None
    negatives: int = 15  # per query in stages 2 and 3 (and the teacher)
    depth: int = 200  # mining depth
    pooling: str | None = None  # None: the base config's, else what MODEL says (eval.model_config), else cls
    normalize: bool | None = None
    overrides: list[str] = field(default_factory=list)  # dotted key=value for every fine-tuning run
    nproc: int = 1  # ranks per fine-tuning run, on this node


def done(export: Path) -> bool:
    return (export / FINETUNE_META).is_file()


def run_stages(opts: StagesOptions) -> dict:
    from pretrieve.config import load_config
    from pretrieve.finetune.config import finetune_experiment
    from pretrieve.finetune.mine import MineOptions, TeacherOptions, mine, teacher_scores
    from pretrieve.finetune.run import finetune

    if opts.up_to not in STAGES:
        raise ValueError(f"up_to: {opts.up_to!r} is not one of {', '.join(STAGES)}")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # every rank would mine and score, into the same files
        raise ValueError("finetune-stages runs as one process; --nproc N runs each fine-tuning over N processes")
    if opts.nproc < 1:
        raise ValueError(f"nproc: must be >= 1, got {opts.nproc}")
    out = Path(opts.out)
    wanted = STAGES[:STAGES.index(opts.up_to) + 1]
    if bool(opts.data) + (opts.msmarco is not None) + (opts.beir is not None) != 1:
        raise ValueError("give one of data files, an MS MARCO folder or a BEIR folder as training data")
    # the base config's own data and model, if any, give way to the chain's
    source = ["finetune.data=[]", "finetune.msmarco=null", "finetune.beir=null"]
    source.append(f"finetune.data=[{','.join(opts.data)}]" if opts.data else
                  f"finetune.{'msmarco' if opts.msmarco else 'beir'}={opts.msmarco or opts.beir}")
    source.append(f"finetune.split={opts.split}")
    mined = ["finetune.msmarco=null", "finetune.beir=null"]
    common = ["finetune.model=dual"]
    if opts.pooling is not None:
        common.append(f"finetune.pooling={opts.pooling}")
    if opts.normalize is not None:
        common.append(f"finetune.normalize={str(opts.normalize).lower()}")

    def train(name: str, *overrides: str) -> Path:
        run_dir = out / name
        if not done(run_dir / "export"):
            every = [f"run_dir={run_dir}", "resume=auto", *overrides, *opts.overrides]
            config = load_config(opts.config, every, required=("finetune",))
            exp = finetune_experiment(config, world_size=opts.nproc)  # bad keys, batch math: errors before launch
            if why := requested():  # held since the start or a step before (mining, scoring): this run waits
                raise _stopped(why, name, run_dir, started=False)
            if opts.nproc == 1:
                try:
                    finetune(exp)
                except Interrupted:
                    raise _stopped(Stop.INTERRUPTED, name, run_dir) from None
            elif why := _run_ranks(opts.nproc, ["finetune", opts.config, *every]):
                raise _stopped(why, name, run_dir)
        return run_dir / "export"

    def step(what: str, output: Path, run, options) -> None:
        """Mining or scoring into `output`, written whole or not at all: a Ctrl-C stops it at once."""
        if output.is_file():
            return
        try:
            with interruptible():
                run(options)
        except KeyboardInterrupt:
            raise Interrupted(f"interrupted while {what} ({output} not written); run the same command again to "
                              "continue") from None

    exports = {"stage1": train("stage1", f"finetune.init_from={opts.model}", *source, *common,
                               "finetune.negatives=0", "finetune.loss=contrastive")}
    hard, distill = out / "hard.jsonl", out / "distill.jsonl"
    if "stage2" in wanted:
        step("mining hard negatives", hard, mine, MineOptions(
            model=str(exports["stage1"]), out=str(hard), data=opts.data, msmarco=opts.msmarco, beir=opts.beir,
            split=opts.split, depth=opts.depth, negatives=opts.negatives))
        exports["stage2"] = train("stage2", f"finetune.init_from={exports['stage1']}", *mined,
                                  f"finetune.data=[{hard}]", *common, f"finetune.negatives={opts.negatives}",
                                  "finetune.loss=contrastive")
    if "stage3" in wanted:
        teacher = train("teacher", f"finetune.init_from={opts.teacher_init or opts.model}", *mined,
                        f"finetune.data=[{hard}]", "finetune.model=cross", "finetune.loss=contrastive",
                        f"finetune.negatives={opts.negatives}",
                        "finetune.pooling=null", "finetune.normalize=null")  # the dual stages' (a cross run's refused)
        step("scoring with the teacher", distill, teacher_scores,
             TeacherOptions(model=str(teacher), data=[str(hard)], out=str(distill)))
        exports["stage3"] = train("stage3", f"finetune.init_from={exports['stage2']}", *mined,
                                  f"finetune.data=[{distill}]", *common, f"finetune.negatives={opts.negatives}",
                                  "finetune.loss=distill")
    return {name: str(path) for name, path in exports.items()}


def _stopped(why: Stop, name: str, run_dir: Path, started: bool = True) -> Stopped:
    """How the chain ends when `why` stopped it at its step `name`; running it again continues from there."""
    if why == Stop.PREEMPTED:
        return Preempted(during_start_up=not started)
    if done(run_dir / "export"):  # it finished as the signal came
        return Interrupted(f"interrupted after {name} (its model: {run_dir / 'export'}); run the same command "
                           "again to continue")
    tag = latest_checkpoint(run_dir)
    saved = f"its latest checkpoint: {run_dir / 'checkpoints' / tag}" if tag else "nothing of it saved yet"
    return Interrupted(f"interrupted in {name} ({saved}); run the same command again to continue")


def _run_ranks(nproc: int, args: list[str]) -> Stop:
    """`pretrieve ARGS` as NPROC ranks on this node, with the environment torchrun would give them, each in its
    own session (engine/child_processes.py). SIGTERM / SIGUSR1 / SIGINT sent here reach every rank, once, which
    save a checkpoint at the same step boundary and exit 85 (SIGINT: end by SIGINT); returns how they stopped
    (Stop.NONE: they finished). A rank failing otherwise stops the others (they would wait in a collective until
    its timeout) and raises RuntimeError."""
    import sys
    import time

    from pretrieve.engine.child_processes import ChildProcesses
    from pretrieve.engine.world import free_loopback_port

    port = free_loopback_port()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))
    env = {**os.environ, "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": threads}
    with ChildProcesses() as children:
        ranks = children.start(*({"args": [sys.executable, "-m", "pretrieve", *args],
                                  "env": {**env, "RANK": str(r), "LOCAL_RANK": str(r)}} for r in range(nproc)))
        if ranks is None:  # a stop signal came before they started
            return children.stopped
        while any(rank.poll() is None for rank in ranks):
            if any(rank.returncode not in (None, 0) and not stop_of_status(rank.returncode) for rank in ranks):
                for rank in ranks:
                    if rank.poll() is None:
                        rank.kill()
                        rank.wait()
                break
            time.sleep(0.2)
    codes = [rank.returncode for rank in ranks]
    if all(stop_of_status(code) for code in codes):  # a second Ctrl-C ends them unsaved: `latest` says where
        return max(stop_of_status(code) for code in codes)
    if any(codes):
        raise RuntimeError(f"fine-tuning over {nproc} processes failed (exit codes by rank {codes}): "
                           f"pretrieve {' '.join(args)}")
    return children.stopped  # finished, but asked to stop: the chain stops before its next step
