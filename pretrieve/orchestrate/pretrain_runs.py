"""Pre-training runs as child processes, then the farm of what they made: what `pretrieve scale run` (a scaling
study's points) and `pretrieve study run` (a method study's arms) share.

Each run is `pretrieve pretrain CONFIG OVERRIDES...` (with `resume=auto` among them) in its own process
(engine/child_processes.py), `workers` at a time, its output appended to its log. A run is done when its `marker`
file exists (a file of its export, written last): a re-run skips it, and one that stopped (killed, preempted,
`train.stop_at`) continues from its checkpoint. A failing run is reported with its log and stops nothing else. A
stop signal reaches the running ones once, none starts after it, and the command ends with one line saying how
many are left (engine/preemption.py). `in_process` trains them one after another in this process instead (a
smoke study's tiny runs: DeepSpeed imported once). With `--slurm JOBS` nothing runs: the pending runs' lines are
written to JOBS for launchers/slurm/eval_farm.sbatch.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pretrieve.engine.child_processes import STOPPED, ChildProcesses
from pretrieve.engine.preemption import stop_exit
from pretrieve.progress import Progress
from pretrieve.utils.run_dir import write_atomic


@dataclass
class PretrainRun:
    name: str
    args: list[str]  # the `pretrieve` arguments: pretrain CONFIG OVERRIDES...
    marker: Path  # exists once the run is done
    log: Path
    seconds: float | None = None  # wall seconds, once it has run here

    def done(self) -> bool:
        return self.marker.is_file()


def list_for_slurm(runs: list[PretrainRun], jobs: str | Path) -> int:
    """Write the pending runs' `pretrieve` lines to `jobs`; how many."""
    pending = [run for run in runs if not run.done()]
    write_atomic(Path(jobs), "".join(shlex.join(run.args) + "\n" for run in pending))
    return len(pending)


def pretrain_runs(runs: list[PretrainRun], workers: int, unit: str = "run", label: str = "pretrain",
                  env: dict | None = None, after: Callable[[PretrainRun], None] | None = None,
                  progress: bool = True, in_process: bool = False) -> dict[str, str]:
    """Run the pending runs; {name: why} of those that failed. `after(run)` follows each run that finished; `env`:
    the processes' environment (None: this process's); `unit` names a run in the lines said (point, run)."""
    pending = [run for run in runs if not run.done()]
    if in_process:
        for run in pending:
            start = time.monotonic()
            _train_here(run.args)
            run.seconds = round(time.monotonic() - start, 1)
            if after:
                after(run)
        return {}
    failed: dict[str, str] = {}

    def one(run: PretrainRun) -> str | None:
        """None once pre-trained; else why not (STOPPED: a stop signal cut it off or kept it from starting)."""
        start = time.monotonic()
        code = children.run_job([sys.executable, "-m", "pretrieve", *run.args], run.log, append=True, env=env)
        run.seconds = round(time.monotonic() - start, 1)
        if code is STOPPED:
            return STOPPED  # its checkpoint is saved: the next run resumes it
        if code != 0 or not run.done():
            return f"exit {code} (log: {run.log})"
        if after:
            after(run)
        return None

    bar = Progress(len(pending), f"{label}: pre-training", unit=unit, enabled=progress)
    with bar, ChildProcesses() as children, ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for run, error in zip(pending, pool.map(one, pending)):
            if error is STOPPED:
                continue
            if error:
                failed[run.name] = error
            if progress:
                bar.note(f"{label}: {run.name} {'failed: ' + error if error else 'pre-trained'}")
            bar.update()
    if children.stopped:  # the finished runs are done; the others resume from their checkpoints next time
        left = [run for run in pending if not run.done()]
        raise stop_exit(children.stopped, f"{len(left)} of {len(runs)} {unit}s not pre-trained yet (the next run "
                                          "resumes each from its latest checkpoint)",
                        "run the same command again to continue")
    return failed


def _train_here(args: list[str]) -> None:
    """`pretrieve pretrain CONFIG OVERRIDES...` in this process."""
    from pretrieve.config import load_config
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment

    train(experiment(load_config(args[1], args[2:])))


def evaluate(farm: dict, path: Path, slurm_jobs: str | None = None, progress: bool = True,
             env: dict | None = None) -> dict:
    """`farm` written to `path` and run (`pretrieve farm`, orchestrate/farm.py): the evaluations of the runs'
    exports, which skip what is done; its result."""
    # stopped by a signal, the farm ends the command too
    from pretrieve.orchestrate.farm import run_farm

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(farm, indent=1))  # JSON is YAML
    return run_farm(path, slurm_jobs=slurm_jobs, progress=progress, env=env)
