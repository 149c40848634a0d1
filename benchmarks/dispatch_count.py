"""The host's work in a training step, counted on CPU: the torch ops the engine's step dispatches (on a GPU each
one a kernel launch, or a view the host still pays for) against the bare loop's (benchmarks/step_floor.py) on the
same head and batches. A GPU step bound by its host's launches (docs/benchmarks.md, "Three H200 jobs") is made
faster by dispatching less; a count does not drift with a machine's load, so a test can hold it.

    python -m benchmarks.dispatch_count --method mlm --set train.optimizer=torch-fused [--set ...]

The model is BERT-base's depth at a tiny width (12 layers, 202 parameter tensors, hidden 64): its op counts are
BERT-base's, its arithmetic negligible. Counted per optimizer step, as the median over the steps after the first
(the optimizer's state is made there) that do not log (train.log_every 2: every other step logs, and its ops and
reads are listed apart); the engine's batches are collated in a loader worker, whose ops are not the step's.
Prints one JSON record: both counts, the engine's extra ops, and those per trainable parameter tensor
(DeepSpeed's per-parameter work shows there), the host reads of a step that does not log and of one that does,
by the line that asks for them (an op whose result the host needs: a value read by item/bool/int/float,
nonzero, a boolean mask's indexing; on a GPU each waits for the device to get there), and each counted step
(`steps`: its number, whether it logs, its ops and reads); `--out` appends it to a JSON list.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.pretrain_throughput import ROOT, append_record, engine_overrides
from benchmarks.step_floor import batches, run_steps, variant

WIDE = {"hidden_size": 64, "num_layers": 12, "num_heads": 2, "intermediate_size": 128}
LOG_EVERY = 2  # of the counted steps (2 .. steps - 1) some log and some do not: their reads are listed apart


aten = torch.ops.aten
# ops whose result the host reads (on a GPU each waits for the device): a value (item, bool(), int(), float()) or
# an output size that depends on the data
READ_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default}
# indexing by a boolean mask: a nonzero inside the kernel, on a GPU the same wait
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
PACKAGES = ("/pretrieve/", "/transformers/", "/deepspeed/", "/benchmarks/")


def reads_device(func, args) -> bool:
    if func in READ_OPS:
        return True
    return func in MASK_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                        for i in args[1] if i is not None)


def site() -> str:
    """The innermost frame of pretrieve, transformers, DeepSpeed or a benchmark: where a read is asked for."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # not this function's frame and the mode's
        for package in PACKAGES:
            if package in frame.filename:
                return f"{package.strip('/')}/{frame.filename.split(package, 1)[1]}:{frame.lineno}"
    return "elsewhere"


class Dispatched(TorchDispatchMode):
    """Counts the ops dispatched in this thread while active, and the host reads among them by site. Reads that
    do not dispatch an op (`tolist`, `numpy` of a CPU tensor) are not seen here."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.reads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if reads_device(func, args):
            self.reads[site()] += 1
        return func(*args, **(kwargs or {}))


def engine_ops(args, work: Path) -> list[dict]:
    """Each optimizer step of `pretrieve pretrain`: its number (1-based), whether it logs (train.log_every), the
    ops it dispatches and its host reads by site; counted between the loop's calls of the job's `at_step` (before
    each step's forward), so neither start-up nor the final checkpoint counts. The host's count and FLOPs of a
    batch run before its `at_step`: they count in the step before, a step that reads nothing of the device."""
    from pretrieve.config import load_config
    from pretrieve.engine.train import run_training
    from pretrieve.pretrain import pretraining_job
    from pretrieve.pretrain_config import experiment

    marks, counter, train = [], Dispatched(), {}

    def marked_job(exp, rank):
        job = pretraining_job(exp, rank)
        schedule = job.at_step
        train["options"] = exp.train

        def at_step(step):
            marks.append((counter.count, collections.Counter(counter.reads), step))
            if schedule is not None:
                schedule(step)
        job.at_step = at_step
        return job

    config = load_config(ROOT / "configs" / "pretrain" / f"{args.method}.yaml",
                         [*engine_overrides(args, work / "shards", None), "data.num_workers=1",
                          f"run_dir={work / 'run'}", f"train.log_every={LOG_EVERY}", *args.set])
    with counter:
        run_training(experiment(config), marked_job)
    options = train["options"]
    return [{"step": step + 1, "logs": (step + 1) % options.log_every == 0 or step + 1 == options.max_steps,
             "ops": b - a, "reads": dict(sorted((reads_b - reads_a).items()))}
            for (a, reads_a, step), (b, reads_b, _) in zip(marks[1:], marks[2:])]


def floor_ops(head_batches) -> tuple[list[int], collections.Counter]:
    """The ops each step of the bare loop dispatches (fp32 on CPU), after its first; the host reads of its last
    step by site."""
    head, on_device, _, _ = head_batches
    module, optimizer, autocast = variant("autocast", head, gpu=False)
    run_steps(module, optimizer, autocast, on_device[:1])
    counts = []
    for batch in on_device[1:]:
        with Dispatched() as counter:
            run_steps(module, optimizer, autocast, [batch])
        counts.append(counter.count)
    return counts, counter.reads


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="mlm")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of the engine")
    p.add_argument("--out", help="also append the record to this JSON list")
    args = p.parse_args(argv)
    # engine_overrides' settings: the wide model at fp32 on ZeRO 0, a step a log line (as the ladder's runs)
    args.size, args.lora, args.activation_checkpointing, args.zero_stage, args.precision = "tiny", 0, False, 0, "fp32"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        args.set = [f"model.{k}={v}" for k, v in WIDE.items()] + args.set
        head_batches = batches(args, work, args.set)  # the sample prepared once, for both
        floor_counts, floor_reads = floor_ops(head_batches)
        steps = engine_ops(args, work)
    quiet, logging = [s for s in steps if not s["logs"]], [s for s in steps if s["logs"]]
    if not quiet or not logging:
        raise SystemExit(f"--steps {args.steps} with train.log_every: the counted steps need one that logs and one "
                         "that does not; give more steps")
    floor, engine = statistics.median(floor_counts), statistics.median(s["ops"] for s in quiet)
    tensors = sum(p.requires_grad for p in head_batches[0].parameters())
    record = {"method": args.method, "overrides": args.set[len(WIDE):], "parameter_tensors": tensors,
              "engine_ops_per_step": engine, "engine_ops_per_log_step": statistics.median(s["ops"] for s in logging),
              "floor_ops_per_step": floor, "extra_ops_per_step": engine - floor,
              "extra_ops_per_parameter": round((engine - floor) / tensors, 2),
              "floor_reads_per_step": dict(sorted(floor_reads.items())),
              # a step that does not log, and one that does: their reads by site (the engine's and the head's)
              "engine_reads_per_step": quiet[-1]["reads"], "engine_reads_per_log_step": logging[-1]["reads"],
              "steps": steps, "torch": torch.__version__}
    if args.out:
        append_record(Path(args.out), record)
    else:
        print(record, flush=True)
    return record


if __name__ == "__main__":
    main()
