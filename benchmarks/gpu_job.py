"""`make gpu-check`: the whole job of one short GPU allocation (docs/offline.md, "A short GPU allocation").

    python -m benchmarks.gpu_job --out OUT [--budget 540] [--bundle gpu-bundle] [--dry-run]

An allocation is one job of about 9 minutes on a node with no network, whose output folder is all that comes
back. So the job runs its stages in priority order, each inside its own time box and all inside `--budget`
seconds, and writes each stage's record to OUT as soon as the stage ends (a "running" record when it starts),
so that a job killed at its limit still returns what it measured:

    OUT/0-summary.json        the plan, the node (device, torch, CUDA), and each stage's status when it ended
    OUT/<i>-<stage>.json      status (ok, failed, timeout, skipped), seconds, each command's exit status and the
                              tail of its log, and the JSON results of the stage's benchmarks, embedded
    OUT/logs.tar.gz           every command's full log, repacked after each stage

A failing stage records its error and the job goes on with the next one; the stages after a failed CUDA check
are skipped, since each needs the device. `--dry-run` prints the plan, each stage's estimate and time box, and
the total against the budget, and checks that the bundle (`make gpu-bundle`: the wheelhouse and the quality
study's data) and the repository fit what a job may carry.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# the job is planned before its install stage, in a Python that may lack torch and the package's dependencies: the
# ladder and the table of speed switches it climbs (pretrieve/models/speed_switches.py) need neither to be read
from benchmarks.throughput_ladder import plan as ladder_plan

ROOT = Path(__file__).resolve().parent.parent
CARRY_LIMIT_MIB = 64  # what one job may take in, the repository included
RETURNED_FILES = 8  # what comes back from one job's OUT: the summary, a record a stage and the logs
LOG_TAIL = 3000  # characters of a failed command's log kept in its stage record
GRACE_S = 10  # between SIGTERM and SIGKILL when a time box runs out


@dataclass
class Command:
    argv: list[str]
    results: str | None = None  # a JSON file the command writes, embedded in the stage record
    also: tuple[str, ...] = ()  # more of them: each embedded if the command wrote it


@dataclass
class Stage:
    name: str
    what: str
    estimate_s: int  # the expected time; the plan's total is checked against the budget
    box_s: int  # the most it may take, if the budget has that much left
    commands: list[Command]
    needs_cuda: bool = True
    results: dict = field(default_factory=dict)


# what a job runs unless told: the speed ladder's job (docs/benchmarks.md, "Three H200 jobs", says why each stage
# is here and why the ladder skips what it skips)
DEFAULT_STAGES = ("install", "floor", "mfu", "profile")
# the ladder's rungs the profile stage profiles: every switch at batch 32 but unpadding and compile, as the floor
PROFILED_RUNGS = ("fused-adamw",)
# why train.compile lost on the H200 (docs/benchmarks.md): the compiled rung and the compiled floor profiled, beside
# the uncompiled ones (a stage of its own: the default job has no room for it)
PROFILED_COMPILED = ("compile",)
# the ladder's BERT-base L512 runs (benchmarks/throughput_ladder.py): mlm climbs every rung, retromae takes the top
# alone; the rungs a short job skips (docs/benchmarks.md, "The speed ladder", says why)
LADDER_METHODS = ("mlm", "retromae")
LADDER_SKIP = ("unpad", "batch-128", "decoder-fused", "vocab-liger", "cuda-graphs", "static-shapes")


# the method study's arms beyond the cpu study's (pretrieve/study/plan.py), each at the ladder's baseline and top
# rungs in a stage of its own (the default job is full), with the overrides its paper trains with (the method
# registry's `paper_overrides`). This code reads them in a Python of its own, started in the repository's root,
# where the package imports before `make install`; a dependency missing then fails the stage, not the job
LADDER_NEW_METHODS = ("import json\n"
                      "from pretrieve.models.heads import get_method\n"
                      "from pretrieve.study.plan import ARMS, CPU_ARMS\n"
                      "print(json.dumps({name: list(get_method(name).paper_overrides) for name in ARMS "
                      "if name not in CPU_ARMS}))\n")


def ladder_new_methods() -> tuple[dict[str, list[str]], str | None]:
    """({method: its overrides}, None) as LADDER_NEW_METHODS reads them, or ({}, why not)."""
    read = subprocess.run([sys.executable, "-c", LADDER_NEW_METHODS], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if read.returncode:
        return {}, f"mfu-methods: the method registry was unreadable at the job's start:\n{read.stderr[-LOG_TAIL:]}"
    return json.loads(read.stdout.splitlines()[-1]), None


def ladder_ends_of(bert_base: list[str], method: str, work: Path, overrides: list[str]) -> list[str]:
    """The ladder's baseline and top rungs of `method` alone, its own overrides on each."""
    return bert_base + ["--ladder", "--ends-only", "--no-peers", "--methods", method, "--skip", *LADDER_SKIP,
                        *[a for o in overrides for a in ("--set", o)],
                        "--out", str(work / "pretrain_throughput_gpu.json")]


def plan(python: str, work: Path, bundle: Path, install: bool, quality_seeds: str) -> list[Stage]:
    """The stages in priority order. `python` runs everything after the install (the job's venv)."""
    wheelhouse = bundle / "wheelhouse"
    # the speed extra alone (Liger-Kernel; exact search needs no faiss), no DeepSpeed CPU op (the node trains on its
    # GPU), and the wheels as they are: a resolution against the image's own versions fails where one is below a
    # wheel's floor
    make_install = ["make", "install", f"PYTHON={sys.executable}", "EXTRAS=speed", "DS_CPU_OP=0", "NO_DEPS=1"]
    if wheelhouse.is_dir():
        make_install.append(f"WHEELHOUSE={wheelhouse}")
    unpack = [Command(["tar", "-xzf", str(bundle / "data.tar.gz"), "-C", str(bundle)])] \
        if (bundle / "data.tar.gz").is_file() else []
    # the seeds of earlier jobs, committed: this job's merge into them (`pretrieve study run --seeds`)
    committed = ROOT / "studies" / "quality" / "results" / "quality-gpu.json"
    merge_into = [Command(["cp", str(committed), str(work / "quality-gpu.json")])] if committed.is_file() else []
    recipe = recipe_commands(python, work, bundle, quality_seeds)
    pytest = [python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    bert_base_at = [python, "-m", "benchmarks.pretrain_throughput", "--size", "base", "--seq-len", "512", "--steps",
                    "16", "--warmup", "4"]
    bert_base = bert_base_at + ["--batch", "32"]
    throughput = bert_base + ["--out", str(work / "pretrain_throughput_gpu.json")]
    ladder = bert_base + ["--ladder", "--methods", *LADDER_METHODS, "--skip", *LADDER_SKIP,
                          "--top-only", *LADDER_METHODS[1:], "--out", str(work / "pretrain_throughput_gpu.json")]

    def profiled(names: tuple[str, ...]) -> list[Command]:  # the engine's step at the ladder's rungs `names`
        return [Command(bert_base_at + ["--method", "mlm", "--rung", name, *[a for o in overrides for a in ("--set", o)],
                                        "--batch", str(batch), "--profile", str(work / f"profile_{name}.json"),
                                        "--out", str(work / "profiled_throughput.json")],  # slowed by the profiler
                        results=str(work / f"profile_{name}.json")) for name, overrides, batch in ladder_rungs(names)]

    new_methods, unread = ladder_new_methods()
    qwen3 = [python, "-m", "benchmarks.pretrain_throughput", "--method", "llama2vec", "--size", "qwen3-0.6b",
             "--seq-len", "512", "--batch", "8", "--steps", "12", "--warmup", "4", "--zero-stage", "1",
             "--out", str(work / "pretrain_throughput_gpu.json")]
    return [
        # estimates and boxes: what each stage took where a job ran it whole, else made from its parts' runs
        # (docs/offline.md's table; docs/benchmarks.md, "The job's time boxes")
        Stage("install", "offline install from the bundle's wheelhouse, its data unpacked, then torch.cuda sanity", 35, 90,
              ([Command(make_install)] if install else []) + unpack
              + [Command([python, "-m", "benchmarks.gpu_job", "--sanity", str(work / "sanity.json")],
                         results=str(work / "sanity.json"))], needs_cuda=False),
        # the kernels' and the unpadded path's GPU tests; the engine's bf16 step and resume, the farm's placement and
        # the fp16 variants are left to `make test-gpu`, whose engine tests alone outgrow this box
        Stage("correctness", "the fused decoder-attention kernel against eager in bf16 on real shapes, unpadded "
              "varlen against padded", 90, 120,
              [Command(pytest + ["tests/test_kernels_gpu.py"]),
               Command(pytest + ["tests/test_unpadding_gpu.py"])]),
        Stage("attention", "fused two-stream attention at L512, forward and backward, against eager and SDPA", 15, 45,
              [Command([python, "-m", "pretrieve.kernels.tune", "--lengths", "512",
                        "--out", str(work / "two_stream_attention.json")],
                       results=str(work / "two_stream_attention.json"))]),
        # the head without the engine at batch 32 (benchmarks/step_floor.py), beside the ladder of the same job;
        # then that every backbone's attention trains on a fused SDPA kernel, here and not in the install stage,
        # whose failure would stop the job
        Stage("floor", "BERT-base L512 mlm's head trained by a bare loop (no DeepSpeed, batches on the device): "
              "bf16 autocast, with bf16 LayerNorms, and bf16 weights, in turns; then each backbone's attention "
              "trained with SDPA's math kernel off", 55, 80,
              [Command([python, "-m", "benchmarks.step_floor", "--method", "mlm", "--size", "base", "--seq-len", "512",
                        "--batch", "32", "--steps", "10", "--warmup", "3", "--rounds", "2", "--variants", "autocast",
                        "autocast-lpnorm", "bf16", "--out", str(work / "step_floor_gpu.json")],
                       results=str(work / "step_floor_gpu.json")),
               Command(pytest + ["tests/test_sdpa_kernels_gpu.py"])]),
        # no benchmark run writes an export
        Stage("mfu", "the speed ladder at BERT-base L512 bf16 (each switch on top of the ones before, each rung "
              f"its own process: {', '.join(LADDER_METHODS)}) and its peers, HF's Trainer with BertForMaskedLM and "
              "the official RetroMAE model re-stated", 340, 380,
              [Command(ladder, results=str(work / "pretrain_throughput_gpu.json"))]),
        # where the time goes in the engine's step at batch 32 (mlm), beside the floor's
        Stage("profile", f"torch.profiler over BERT-base L512 bf16 mlm at the ladder's {', '.join(PROFILED_RUNGS)} "
              "rung: kernels by device time, the share of GEMMs, attention, elementwise, copies and idle, and the "
              "host's launches, waits, data loading and optimizer steps per step", 80, 110,
              profiled(PROFILED_RUNGS)),
        # the floor's compiled variant first (the one it profiles) beside its bf16 one, then the engine's compile
        # rung: each compiles its layers (~30 s), the profiler's summary ~40 s
        Stage("profile-compile", "torch.profiler over the compiled step of BERT-base L512 bf16 mlm: the floor's "
              f"bf16-compile variant (timed beside bf16) and the ladder's {', '.join(PROFILED_COMPILED)} rung, their "
              "kernels by device time", 170, 220,
              [Command([python, "-m", "benchmarks.step_floor", "--method", "mlm", "--size", "base", "--seq-len", "512",
                        "--batch", "32", "--steps", "10", "--warmup", "3", "--rounds", "1", "--variants",
                        "bf16-compile", "bf16", "--profile", str(work / "profile_floor_bf16-compile.json"),
                        "--out", str(work / "step_floor_compile_gpu.json")],
                       results=str(work / "profile_floor_bf16-compile.json"),
                       also=(str(work / "step_floor_compile_gpu.json"),)),
               *profiled(PROFILED_COMPILED)]),
        # mlm / retromae / dupmae at their defaults, ModernBERT unpadded, a Qwen3-0.6B llama2vec
        Stage("mfu-models", "BERT-base L512 bf16 throughput and MFU of mlm, retromae, dupmae at the defaults; "
              "ModernBERT-base unpadded against padded; a Qwen3-0.6B-shaped llama2vec at L512, full and LoRA r 16",
              250, 300,
              [Command(throughput + ["--method", m], results=str(work / "pretrain_throughput_gpu.json"))
               for m in ("mlm", "retromae", "dupmae")]
              + [Command([python, "-m", "benchmarks.unpadding", "--size", "base",
                          "--out", str(work / "unpadding_gpu.json")], results=str(work / "unpadding_gpu.json"))]
              + [Command(qwen3 + ["--lora", str(rank)], results=str(work / "pretrain_throughput_gpu.json"))
                 for rank in (0, 16)]),
        # the newer methods at the ladder's baseline and top (ends only, no peers), a time box a method;
        # coCondenser's GradCache (chunks of 16 of its 64 spans) encodes each span twice
        Stage("mfu-methods", "the speed ladder's baseline and top rungs at BERT-base L512 bf16 for "
              f"{', '.join(new_methods)} (coCondenser through GradCache, chunks of 16 spans)", 76 * len(new_methods),
              88 * len(new_methods),
              [Command(ladder_ends_of(bert_base, method, work, extra), results=str(work / "pretrain_throughput_gpu.json"))
               for method, extra in new_methods.items()] + ([Command([python, "-c", f"raise SystemExit({unread!r})"])]
                                                            if unread else [])),
        Stage("quality", "the quality study at --scale gpu-short: base -> arms -> the same fine-tuning -> eval", 320,
              380, merge_into + [Command([python, "-m", "pretrieve", "study", "run", "studies/quality/gpu-short.yaml",
                                          "--seeds", quality_seeds, "--data", str(bundle / "data"),
                                          "--out", str(work / "quality"), "--results", str(work / "quality-gpu.json")],
                                         results=str(work / "quality-gpu.json"))]),
        # BGE's recipe on the quality stage's base (the same work folder: a job running both trains it once)
        Stage("recipe", "BGE's recipe at --scale gpu-short: the contrastive budget curve of `none`, or, once the "
              "budget is fixed from it, the arms: pre-training -> contrastive -> fine-tuning -> eval, [CLS] and mean",
              480, 540, recipe),
    ]


def ladder_rungs(names: tuple[str, ...]) -> list[tuple[str, list[str], int]]:
    """(name, overrides, micro-batch) of the named rungs of the ladder's first method, as the default job runs them."""
    return [(name, overrides, batch) for method, name, overrides, batch in
            ladder_plan([LADDER_METHODS[0]], 32, skip=LADDER_SKIP).runs if name in names]


def recipe_commands(python: str, work: Path, bundle: Path, seeds: str,
                    committed: Path = ROOT / "studies" / "recipe" / "results" / "recipe-gpu-short.json") -> list[Command]:
    """`pretrieve study run studies/recipe/gpu-short.yaml`: its budget part until `committed` results hold the
    budget curve, then the arms for `seeds`, merged into the committed seeds' per-query scores."""
    per_query = committed.with_name("recipe-gpu-short-per-query.json")
    results = work / committed.name
    has_budget = committed.is_file() and "budget" in json.loads(committed.read_text())
    copies = [Command(["cp", str(path), str(work / path.name)]) for path in (committed, per_query) if path.is_file()]
    part = ["--part", "arms", "--seeds", seeds] if has_budget else ["--part", "budget"]
    return copies + [Command([python, "-m", "pretrieve", "study", "run", "studies/recipe/gpu-short.yaml", *part,
                              "--data", str(bundle / "data"), "--out", str(work / "quality"), "--results", str(results)],
                             results=str(results), also=(str(work / per_query.name),))]


# --- the node ------------------------------------------------------------------------------------------------------

def sanity(out: Path) -> int:
    """torch.cuda sanity: the device, the versions, a bf16 matmul against fp32. Exit 1 without a CUDA device."""
    import torch

    record = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton
        record["triton"] = triton.__version__
    except ImportError:
        record["triton"] = None
    if record["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        a, b = torch.randn(2048, 2048, device="cuda"), torch.randn(2048, 2048, device="cuda")
        exact = a @ b
        bf16 = (a.bfloat16() @ b.bfloat16()).float()
        record.update(device=props.name, capability=f"{props.major}.{props.minor}",
                      memory_gib=round(props.total_memory / 2**30, 1), devices=torch.cuda.device_count(),
                      bf16_supported=torch.cuda.is_bf16_supported(),
                      nccl=torch.distributed.is_nccl_available(),
                      bf16_matmul_rel_error=float((bf16 - exact).norm() / exact.norm()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record))
    if not record["cuda_available"]:
        print(f"no CUDA device: torch {torch.__version__} sees none", file=sys.stderr)
        return 1
    return 0


# --- running the stages --------------------------------------------------------------------------------------------

def write_json(path: Path, record: dict) -> None:
    """Whole or absent: the job may be killed at any moment."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def pack_logs(logs: Path, out: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for log in sorted(logs.glob("*.log")):
            tar.add(log, arcname=f"logs/{log.name}")
    tmp = out / ".logs.tar.gz.tmp"
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, out / "logs.tar.gz")


def run_command(argv: list[str], log: Path, timeout: float) -> tuple[str, int | None]:
    """Runs `argv` in its own process group with its output to `log`; at the timeout the whole group gets
    SIGTERM, then SIGKILL. Returns (status, exit code)."""
    with open(log, "ab") as sink:
        sink.write(f"$ {' '.join(argv)}\n".encode())
        sink.flush()
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        except OSError as error:
            sink.write(f"{error}\n".encode())
            return "failed", None
        try:
            rc = proc.wait(timeout=max(timeout, 0.1))
            return ("ok" if rc == 0 else "failed"), rc
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            proc.wait()
            sink.write(f"\n[time box of {timeout:.0f} s reached: stopped]\n".encode())
            return "timeout", None


def tail(path: Path) -> str:
    return path.read_text(errors="replace")[-LOG_TAIL:] if path.is_file() else ""


def read_results(path: str | None):
    if path is None or not Path(path).is_file():
        return None
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        return {"unreadable": f"{path}: {error}"}


def run_stage(index: int, stage: Stage, out: Path, logs: Path, deadline: float, skip_why: str | None) -> dict:
    """Runs one stage inside min(its box, what the budget has left) and writes its record."""
    path = out / f"{index}-{stage.name}.json"
    record = {"stage": stage.name, "what": stage.what, "estimate_s": stage.estimate_s, "box_s": stage.box_s,
              "commands": [], "results": {}}
    left = deadline - time.monotonic()
    if skip_why is None and left < 5:
        skip_why = f"the budget is spent ({left:.0f} s left)"
    if skip_why:
        record.update(status="skipped", why=skip_why, seconds=0.0)
        write_json(path, record)
        return record
    box_end = time.monotonic() + min(stage.box_s, left)
    record.update(status="running", started=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
    write_json(path, record)
    start, status = time.monotonic(), "ok"
    log = logs / f"{index}-{stage.name}.log"
    for command in stage.commands:
        remaining = box_end - time.monotonic()
        if remaining < 1:
            record["commands"].append({"argv": command.argv, "status": "skipped", "why": "time box spent"})
            status = "timeout"
            continue
        begin = time.monotonic()
        state, rc = run_command(command.argv, log, remaining)
        entry = {"argv": command.argv, "status": state, "rc": rc, "seconds": round(time.monotonic() - begin, 1)}
        if state != "ok":
            entry["log_tail"] = tail(log)
            status = state if status == "ok" else status
        for written in (command.results, *command.also):
            results = read_results(written)
            if results is not None:
                record["results"][Path(written).name] = results
        record["commands"].append(entry)
        write_json(path, {**record, "seconds": round(time.monotonic() - start, 1)})
    record.update(status=status, seconds=round(time.monotonic() - start, 1))
    write_json(path, record)
    return record


def run(stages: list[Stage], out: Path, work: Path, budget: float, summary: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget
    summary = {**summary, "budget_s": budget, "stages": {}}
    write_json(out / "0-summary.json", summary)
    no_cuda = None
    for index, stage in enumerate(stages, start=1):
        record = run_stage(index, stage, out, logs, deadline, no_cuda if stage.needs_cuda else None)
        summary["stages"][stage.name] = {"status": record["status"], "seconds": record["seconds"]}
        if stage.name == "install":
            summary["node"] = record["results"].get("sanity.json")
            if record["status"] != "ok":
                no_cuda = "the install stage failed or found no CUDA device"
        summary["elapsed_s"] = round(budget - (deadline - time.monotonic()), 1)
        write_json(out / "0-summary.json", summary)
        pack_logs(logs, out)
    return summary


# --- the plan -------------------------------------------------------------------------------------------------------

def tree_mib(path: Path, skip: tuple[str, ...] = ()) -> float:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in skip]
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in filenames
                     if not os.path.islink(os.path.join(dirpath, f)))
    return total / 2**20


def repository_mib() -> float:
    """The repository as a job carries it: the files git tracks (all but the usual untracked folders where
    there is no git, as on the node)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return tree_mib(ROOT, skip=(".git", ".venv", "gpu-bundle", "gpu-check-work", "wheelhouse", "bench-out"))
    files = [ROOT / name.decode() for name in listed.split(b"\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def describe(stages: list[Stage], budget: float, bundle: Path) -> tuple[str, bool]:
    """The dry run's text, and whether the plan fits the budget and the carry limit."""
    lines = [f"make gpu-check: {len(stages)} stages in a budget of {budget:.0f} s", ""]
    total = 0
    for index, stage in enumerate(stages, start=1):
        total += stage.estimate_s
        lines.append(f"{index}. {stage.name:<12} ~{stage.estimate_s:>4} s (box {stage.box_s:>4} s, "
                     f"by then ~{total:>4} s)  {stage.what}")
        lines += [f"     $ {shlex.join(c.argv)}" for c in stage.commands]
    fits = total <= budget
    lines += ["", f"estimated total {total} s of {budget:.0f} s: {'fits' if fits else 'OVER BUDGET'}"]
    files = len(stages) + 2
    fits_files = files <= RETURNED_FILES
    lines.append(f"returned: {files} files of the {RETURNED_FILES} a job returns: "
                 f"{'fits' if fits_files else f'TOO MANY (choose at most {RETURNED_FILES - 2} stages)'}")
    repo = repository_mib()
    if bundle.is_dir():
        size = tree_mib(bundle)
        carried = repo + size
        fits_carry = carried <= CARRY_LIMIT_MIB
        lines.append(f"carried: repository {repo:.1f} MiB + {bundle.name}/ {size:.1f} MiB = {carried:.1f} MiB of "
                     f"{CARRY_LIMIT_MIB}: {'fits' if fits_carry else 'TOO LARGE'}")
        for part in ("wheelhouse", "data.tar.gz"):
            if not (bundle / part).exists():
                lines.append(f"note: {bundle / part} is missing (make gpu-bundle)")
    else:
        fits_carry = True
        lines.append(f"carried: repository {repo:.1f} MiB; no {bundle}/ (make gpu-bundle makes the wheelhouse and the "
                     "study's data): the install then needs network, and the quality and recipe stages fail")
    return "\n".join(lines), fits and fits_carry and fits_files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"),
                   help="where the records go (default $OUT, else gpu-check-out)")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all stages together")
    p.add_argument("--bundle", type=Path, default=ROOT / "gpu-bundle", help="make gpu-bundle's folder")
    p.add_argument("--work", type=Path, default=ROOT / "gpu-check-work", help="logs and the stages' scratch files")
    p.add_argument("--seeds", default="0", help="the seeds this job runs of the quality study and of the recipe's "
                                                   "arms (a later job: 1-2)")
    p.add_argument("--no-install", action="store_true", help="use this Python as it is instead of `make install`")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help="comma-separated stage names to run, at most 6, or all for the dry run's whole plan "
                        "(default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the plan against the budget and exit")
    p.add_argument("--sanity", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sanity:
        return sanity(args.sanity)
    python = sys.executable if args.no_install else str(ROOT / ".venv" / "bin" / "python")
    stages = plan(python, args.work.resolve(), args.bundle.resolve(), not args.no_install, args.seeds)
    if args.stages != "all":
        wanted = args.stages.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            p.error(f"--stages: unknown {', '.join(unknown)} (known: {', '.join(s.name for s in stages)})")
        stages = [s for s in stages if s.name in wanted]
    text, fits = describe(stages, args.budget, args.bundle)
    if args.dry_run:
        print(text)
        return 0 if fits else 1
    print(text, flush=True)
    if len(stages) + 2 > RETURNED_FILES:  # a record would not come back: refused before the allocation is spent
        p.error(f"--stages: {len(stages)} stages, and a job returns the records of {RETURNED_FILES - 2}")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    # changes not yet committed ran too: their files, so that a record says what code it measured
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.split("\n")
    summary = {"started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit or None,
               "uncommitted": sorted(line[3:] for line in changed if line.strip()),
               "plan": [{"stage": s.name, "estimate_s": s.estimate_s, "box_s": s.box_s} for s in stages]}
    summary = run(stages, args.out, args.work, args.budget, summary)
    print(json.dumps({"stages": summary["stages"], "elapsed_s": summary["elapsed_s"], "out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
