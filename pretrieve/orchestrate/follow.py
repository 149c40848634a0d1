"""`pretrieve farm FARM.yaml --follow RUN_DIR`: the farm follows a pre-training run, evaluating each checkpoint it
writes (or every k-th) as it comes, until the run ends.

    follow:                            # in FARM.yaml; or `follow: runs/x`; --follow RUN_DIR sets run_dir
      run_dir: runs/x                  # the run followed; it must exist (an empty folder: a run still to start)
      name: x                          # its folder in the farm's out (default: the run directory's name)
      every: 1                         # every k-th checkpoint (steps that are multiples of k x checkpoint.every)
                                       # and the run's last; 1: each one the run writes
      poll: 60                         # seconds between looks at the run when there is nothing to do
      keep_exports: false              # keep each checkpoint's export once its evaluations are logged
      pooling: mean                    # how to encode, as a checkpoint entry's (default: the export's own)
      normalize: true

Each new complete checkpoint (orchestrate/follow_plan.py) is exported (`pretrieve export`, on the CPU) to
<out>/<name>/exports/<tag>, then evaluated by the farm's protocol, its datasets x stages, as checkpoint
`<name>/<tag>`: <out>/<name>/<tag>/<dataset>/<stage>/. Each evaluation is an MLflow run nested under the
pre-training run (in its store and experiment, unless `tracking.uri` names another store), tagged `step` and
`follow`, its metrics logged at that step. The follower's own processes never share the run's devices: its
exports see no GPU, and its evaluations take the farm's `gpus:`, which must be named on a machine whose GPUs
are all visible (the run's among them); under a SLURM allocation the ones CUDA_VISIBLE_DEVICES gives.

<out>/<name>/follow.json records the run followed, the steps evaluated and those skipped: a follower killed at
any point resumes where it was, evaluating nothing twice (a job is done when its metrics.json exists, an export
is whole or absent). A checkpoint the run deleted (checkpoint.keep) before the follower exported it is skipped
with a word. The follower ends once the run has ended and its last checkpoint is evaluated; a stop signal
(Ctrl-C, SIGTERM) ends it at once, what was cut off left not done.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pretrieve.engine.child_processes import STOPPED, ChildProcesses
from pretrieve.engine.devices import VISIBLE, device_count
from pretrieve.engine.preemption import stop_exit
from pretrieve.orchestrate import farm as farms
from pretrieve.orchestrate.follow_plan import RunView, look, next_steps
from pretrieve.utils.run_dir import step_of, tag_of
from pretrieve.utils.run_dir import write_atomic
from pretrieve.utils.run_lock import LOCK_FILE, DirectoryLock

FOLLOW_KEYS = ("run_dir", "name", "every", "poll", "keep_exports", "pooling", "normalize")
STATE = "follow.json"
RUN_ENTRIES = ("config.yaml", "checkpoints", LOCK_FILE)  # what a starting run writes first, config.yaml last
SHOWN = 5  # steps named in one line


def follows(path: str | Path, run_dir: str | None) -> bool:
    """Whether `pretrieve farm` follows a run: --follow, or a `follow:` entry in FARM.yaml."""
    return run_dir is not None or bool(farms.load_farm(path).get("follow"))


@dataclass
class Follow:
    """The `follow:` block, checked."""

    run_dir: Path
    name: str
    every: int = 1
    poll: float = 60.0
    keep_exports: bool = False
    encoding: dict = field(default_factory=dict)  # pooling / normalize, as a checkpoint entry's


def follow_settings(farm: dict, path: str | Path) -> Follow:
    block = farm["follow"] if isinstance(farm["follow"], dict) else {"run_dir": farm["follow"]}
    for key in block:
        if key not in FOLLOW_KEYS:
            raise ValueError(f"{path}: follow.{key}: unknown (known: {', '.join(FOLLOW_KEYS)})")
    for key, kind, least in (("every", int, 1), ("poll", (int, float), 0.01)):
        value = block.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, kind) or value < least:
            raise ValueError(f"{path}: follow.{key}: expected a number >= {least}, got {value!r}")
    if not isinstance(block.get("keep_exports", False), bool):
        raise ValueError(  # noqa: TRY004 - the command line reports a ValueError as one line naming the key
            f"{path}: follow.keep_exports: expected true or false, got {block['keep_exports']!r}")
    run_dir = Path(str(block.get("run_dir") or ""))
    if not block.get("run_dir") or not run_dir.is_dir():
        raise FileNotFoundError(f"{path}: follow.run_dir (--follow): {str(run_dir) or 'not given'}: no such run "
                                "directory; give the run_dir of a pre-training run (an empty folder for one still "
                                "to start)")
    if any(run_dir.iterdir()) and not any((run_dir / name).exists() for name in RUN_ENTRIES):
        raise ValueError(f"{path}: follow.run_dir (--follow): {run_dir}: not a run directory (no config.yaml, which "
                         "`pretrieve pretrain` writes when it starts)")
    name = str(block.get("name") or run_dir.resolve().name)
    if name in {c["name"] for c in farm["checkpoints"]} or "/" in name:
        raise ValueError(f"{path}: follow.name: {name!r} is a checkpoint's name or not a folder name; give the "
                         "follow a name of its own")
    return Follow(run_dir.resolve(), name, block.get("every", 1), float(block.get("poll", 60.0)),
                  block.get("keep_exports", False), {k: block[k] for k in ("pooling", "normalize") if k in block})


def check_own_devices(farm: dict, path: str | Path) -> None:
    """Evaluations on GPUs the run trains on would slow it: where every GPU is visible, `gpus:` names the farm's."""
    if farm.get("gpus") is None and VISIBLE not in os.environ and device_count():
        raise ValueError(f"{path}: gpus: a follower must not take the GPUs its run trains on; name the devices its "
                         "evaluations may use (gpus: [2, 3]; gpus: 0 for none), or run it where CUDA_VISIBLE_DEVICES "
                         "gives its own (a SLURM allocation)")


@dataclass
class FollowState:
    """<out>/<name>/follow.json: the run followed, the steps evaluated (every job done and logged) and skipped."""

    path: Path
    run_dir: str
    evaluated: set[int] = field(default_factory=set)
    skipped: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, run_dir: Path) -> FollowState:
        if not path.is_file():
            return cls(path, str(run_dir))
        saved = json.loads(path.read_text())
        if saved["run_dir"] != str(run_dir):
            raise ValueError(f"{path}: these evaluations follow {saved['run_dir']}, not {run_dir}; give this follow "
                             "another name (follow.name) or another out")
        return cls(path, saved["run_dir"], set(saved["evaluated"]), {int(k): v for k, v in saved["skipped"].items()})

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"run_dir": self.run_dir, "evaluated": sorted(self.evaluated),
                                            "skipped": {str(k): v for k, v in sorted(self.skipped.items())}},
                                           indent=1) + "\n")


def steps_named(steps) -> str:
    steps = sorted(steps)
    more = f" and {len(steps) - SHOWN} more" if len(steps) > SHOWN else ""
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps[:SHOWN])) + more


class Follower:
    """One follow of one run: its rounds (look, skip, export, evaluate, log) until the run ends or a stop."""

    def __init__(self, farm: dict, path: str | Path, follow: Follow, children: ChildProcesses, progress: bool):
        self.farm, self.path, self.follow, self.children, self.progress = farm, path, follow, children, progress
        self.home = Path(farm["out"]) / follow.name
        self.state = FollowState.load(self.home / STATE, follow.run_dir)
        self.seen: set[int] = set()  # complete steps found by this process's looks
        self.failed: dict[str, str] = {}  # jobs and exports that failed: not tried again by this process
        self.ran, self.cut, self.logged = 0, 0, []
        self.other_store_said = False

    def say(self, line: str) -> None:
        if self.progress:
            print(f"farm: {self.follow.run_dir.name}: {line}", file=sys.stderr, flush=True)

    def exported(self) -> set[int]:
        exports = self.home / "exports"
        return {s for p in (exports.iterdir() if exports.is_dir() else ()) if (s := step_of(p.name)) is not None}

    def round(self, view: RunView) -> bool:
        """One round at a look: skip what is gone, export what is new, evaluate and log what is exported. Returns
        whether it did anything (a round that did not waits `poll` before the next look)."""
        failed_steps = {step_of(name.split("/")[1]) for name in self.failed if name.endswith("/export")}
        handled = self.state.evaluated | set(self.state.skipped) | self.exported() | failed_steps
        decided = next_steps(view, self.follow.every, handled, self.seen)
        self.seen.update(view.complete)
        if decided.skip:
            self.state.skipped.update(decided.skip)
            self.state.save()
            self.say(f"{steps_named(decided.skip)} skipped: {next(iter(decided.skip.values()))}")
        for step in decided.export:
            if not self.export(step, view):
                break  # a stop signal
        return self.evaluate() or bool(decided.export or decided.skip)

    def export(self, step: int, view: RunView) -> bool:
        """`pretrieve export` of checkpoint `step`, on the CPU; False when a stop signal cut it off."""
        tag = self.follow.run_dir / "checkpoints" / tag_of(step)
        log = self.home / tag_of(step) / "export.log"
        env = {**os.environ, VISIBLE: ""}  # never the run's GPUs: the export reads and writes on the CPU
        code = self.children.run_job([sys.executable, "-m", "pretrieve", "export", str(tag),
                                      str(self.home / "exports" / tag_of(step))], log, env=env)
        if code is STOPPED:
            return False
        if code == 0:
            self.say(f"step {step} exported")
        elif not tag.is_dir():
            self.state.skipped[step] = f"deleted by the run (checkpoint.keep: {view.keep}) while being exported"
            self.state.save()
            self.say(f"step {step} skipped: {self.state.skipped[step]}")
        else:
            last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
            self.failed[f"{self.follow.name}/{tag_of(step)}/export"] = \
                f"exit {code}: {last[0] if last else ''} (log: {log})"
            self.say(f"step {step}: export failed (log: {log})")
        return True

    def checkpoints(self) -> list[dict]:
        """The farm's checkpoints for this round: its own, and each exported step not evaluated yet."""
        steps = sorted(self.exported() - self.state.evaluated)
        return self.farm["checkpoints"] + [
            {"name": f"{self.follow.name}/{tag_of(s)}", "model": str(self.home / "exports" / tag_of(s)),
             "run_dir": str(self.follow.run_dir), "step": s, "follow": self.follow.name, **self.follow.encoding}
            for s in steps]

    def evaluate(self) -> bool:
        """Run the pending jobs of the exported steps (and the farm's own checkpoints), log the done ones, and mark
        the steps whose every job is done and logged; returns whether any job ran."""
        if self.children.stopped:
            return False
        farm = {**self.farm, "checkpoints": self.checkpoints(), "tracking": self.tracking()}
        jobs = farms.jobs_of(farm)
        pending = [job for job in jobs if not job.done() and job.name not in self.failed]
        if pending:
            ran, failed, cut = farms.run_pending(farm, self.path, pending, self.children, self.progress)
            self.ran, self.cut = self.ran + ran - len(failed) - cut, self.cut + cut
            self.failed.update(failed)
        if self.children.stopped:
            return bool(pending)
        self.logged += farms.log_done(jobs, farm, self.progress)
        logging = farm["tracking"].get("enabled", True) is not False
        for checkpoint in farm["checkpoints"]:
            own = [job for job in jobs if job.checkpoint is checkpoint]
            if "step" in checkpoint and all(job.done() and (not logging or (job.out / "mlflow.json").is_file())
                                            for job in own):
                self.finished(checkpoint["step"])
        return bool(pending)

    def finished(self, step: int) -> None:
        self.state.evaluated.add(step)
        self.state.save()
        if not self.follow.keep_exports:  # a model's copy per checkpoint: removed once its evaluations are logged
            shutil.rmtree(self.home / "exports" / tag_of(step), ignore_errors=True)
        self.say(f"step {step} evaluated")

    def tracking(self) -> dict:
        """The farm's tracking, its store the run's (run.json) when the farm names none: the evaluations are child
        runs of the run, which MLflow keeps in one store."""
        tracking = dict(self.farm["tracking"])
        record = self.follow.run_dir / "run.json"
        run_uri = json.loads(record.read_text()).get("tracking_uri") if record.is_file() else None
        if run_uri and not tracking.get("uri"):
            tracking["uri"] = run_uri
        elif run_uri and tracking["uri"] != run_uri and not self.other_store_said:
            self.other_store_said = True
            self.say(f"the run logs to {run_uri}, the farm to {tracking['uri']}: its evaluations are not child runs "
                     "of the run (leave tracking.uri out to log them beside it)")
        return tracking

    def remove_leftovers(self) -> None:
        """What a killed follower left in exports/: an export cut off (its hidden staging folder, which a skipped
        step would keep), and exports of evaluated steps (killed between follow.json and their removal)."""
        exports = self.home / "exports"
        for staged in (p for p in (exports.iterdir() if exports.is_dir() else ()) if p.name.startswith(".")):
            shutil.rmtree(staged, ignore_errors=True)
        if not self.follow.keep_exports:
            for step in self.exported() & self.state.evaluated:
                shutil.rmtree(exports / tag_of(step), ignore_errors=True)


def follow_farm(path: str | Path, run_dir: str | None = None, progress: bool = True) -> dict:
    """Follow the run of FARM.yaml's `follow:` (or `run_dir`) until it ends; returns the farm's result with the
    follow's: the steps evaluated and skipped."""
    farm = farms.load_farm(path, follow=run_dir)
    follow = follow_settings(farm, path)
    farms.check_out(farm, follow.name)
    check_own_devices(farm, path)
    # one follower per run and name at a time: two would export and evaluate the same steps
    with DirectoryLock(Path(farm["out"]) / follow.name, "pretrieve farm --follow"), \
            ChildProcesses() as children:  # from here a stop signal ends the follow where it is, cleanly
        farms.mark_out(farm)
        follower = Follower(farm, path, follow, children, progress)
        follower.remove_leftovers()
        every = "each checkpoint" if follow.every == 1 else f"one checkpoint in {follow.every} and the last"
        follower.say(f"following {follow.run_dir} ({every}; a look every {follow.poll:g} s when idle)")
        while not children.stopped:
            view = look(follow.run_dir)
            busy = follower.round(view)
            if view.ended or children.stopped:
                break
            if not busy:
                _wait(children, follow.poll)
    state = follower.state
    if children.stopped:
        raise stop_exit(children.stopped, f"following {follow.run_dir}: {len(state.evaluated)} checkpoints "
                                          f"evaluated; {follower.cut} jobs cut off (not done)",
                        "run the same command again to go on")
    if farms.write_dims(farm, farms.jobs_of(farm)) and progress:
        print(f"farm: NDCG@10 against dimension in {Path(farm['out']) / 'dims.md'}", file=sys.stderr)
    follower.say(f"the run has ended; {len(state.evaluated)} checkpoints evaluated, {len(state.skipped)} skipped")
    return {"run_dir": str(follow.run_dir), "evaluated": sorted(state.evaluated),
            "skipped": {str(k): v for k, v in sorted(state.skipped.items())}, "ran": follower.ran,
            "failed": follower.failed, "logged": follower.logged}


def _wait(children: ChildProcesses, seconds: float) -> None:
    """Sleep `seconds`, or until a stop signal comes (its handler runs between two of these short sleeps)."""
    end = time.monotonic() + seconds
    while not children.stopped and time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))
