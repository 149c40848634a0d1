"""Pre-training throughput of the real engine: `pretrieve pretrain` (DeepSpeed, the method's head and collator,
the shard stream) on the bundled Wikipedia sample.

    python -m benchmarks.pretrain_throughput --method retromae --size tiny --seq-len 128 --batch 8 [--steps 20]

Prints one JSON line and appends it to benchmarks/results/pretrain_throughput.json: tokens/s (non-padding
tokens), s/step, TFLOP/s and MFU (engine.flops: analytic FLOPs; CPU peak = a measured fp32 matmul), averaged
over the steps after `--warmup`. Sizes: tiny = hidden 64, 2 layers, 2 heads, FFN 256; minilm = 384, 6, 12,
1536; base = BERT-base; vocab 30,522. Decoder LLM methods (llama2vec, ebae, ebar, mntp) take qwen3-0.6b (Qwen3-0.6B's
shape, vocabulary 151,669) or qwen3-tiny, shards made with a byte-level BPE trained here; `--lora R` trains
rank-R adapters instead of every weight. fp32 with `--threads` torch threads on CPU (default 2, as the anchors),
bf16 on a GPU. `--set KEY=VALUE` adds a config override (a speed switch: docs/training.md, "Speed switches") and
`--rung NAME` names the record's settings; every record carries the device, torch, CUDA, the date and the peak
memory. `ratio_to_anchor` compares with the official RetroMAE code measured on this kind of machine
(transformers 4.34, fp32, AdamW, 2 threads; the figures the engine issue gives). `--baseline` also times,
in the same run and on the same batches, the official RetroMAE model re-stated (`OfficialRetroMAE`: HF
BertForMaskedLM with MLM logits over all 30,522 words at every position, the decoder layer with a dense
L x L additive mask and eager attention, logits at every decoder position, torch AdamW, no DeepSpeed; bf16
autocast on a GPU) and reports `ratio_to_baseline` (`--baseline-only`: that model alone); the anchor figures
came from a faster machine than this one can be at times.
`--profile FILE` runs the training under torch.profiler and writes where the time went: the ops by self device
time on a GPU (self CPU time on CPU), their share, the host syncs counted, the package's named regions (RetroMAE's
decoder and its vocabulary loss), and on a GPU the timed steps' device time by kernel kind (GEMM, attention,
elementwise, copies) and idle (docs/benchmarks.md, the MFU work).
`--against M ...` times --method and each M in turns, `--rounds` times over, in one process, and records each one's
median tokens/s and --method's ratio to each (a shared machine's drifting load falls on all alike):
`--method bow --against mlm retromae`.
`--ladder` runs every speed switch one after another, each in its own process, and the peers
(benchmarks/throughput_ladder.py; docs/benchmarks.md, "The speed ladder").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

SIZES = {"tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256},
         "minilm": {"hidden_size": 384, "num_layers": 6, "num_heads": 12, "intermediate_size": 1536},
         "base": {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "intermediate_size": 3072},
         # decoder LLMs (llama2vec, ebae, ebar, mntp): Qwen3-0.6B's width, depth, FFN and vocabulary, and a tiny
         # one of the same family for a CPU run
         "qwen3-tiny": {"backbone": "qwen3", "hidden_size": 64, "num_layers": 2, "num_heads": 2,
                        "intermediate_size": 256, "vocab_size": 8000},
         "qwen3-0.6b": {"backbone": "qwen3", "hidden_size": 1024, "num_layers": 28, "num_heads": 16,
                        "intermediate_size": 3072, "vocab_size": 151669, "max_position_embeddings": 32768}}
LLM_METHODS = ("llama2vec", "ebae", "ebar", "mntp")  # trained on a decoder LLM with its own byte-level BPE
# Official RetroMAE code on CPU, tokens/s, keyed by (size, seq_len, batch).
ANCHORS = {("tiny", 128, 8): 1509.0, ("minilm", 256, 8): 568.0}
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"


class OfficialRetroMAE(torch.nn.Module):
    """RetroMAE's official pre-training model (pretrain/modeling.py, enhancedDecoder.py), re-stated for timing."""

    def __init__(self, config):
        from transformers import BertForMaskedLM

        from pretrieve.models.backbones.bert import BertDecoderLayer

        super().__init__()
        self.lm = BertForMaskedLM(config)
        self.c_head = BertDecoderLayer(config)  # a BertLayer, as the official enhanced decoder
        self.c_head.apply(self.lm._init_weights)

    def forward(self, batch: dict) -> torch.Tensor:
        from pretrieve.kernels.reference import expand_decoder_mask

        out = self.lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      labels=batch["mlm_labels"], output_hidden_states=True)
        cls = out.hidden_states[-1][:, :1]
        ids = batch["dec_input_ids"]
        embeddings = self.lm.bert.embeddings
        keys = torch.cat([cls, embeddings(input_ids=ids)[:, 1:]], dim=1)
        query = embeddings.position_embeddings(torch.arange(ids.shape[1], device=ids.device))[None] + cls
        additive = (~expand_decoder_mask(batch))[:, None].float() * torch.finfo(torch.float32).min

        def attend(q, k, v, dropout_p):  # eager: scores, + mask, softmax, dropout, x V
            scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + additive
            return torch.nn.functional.dropout(scores.softmax(dim=-1), dropout_p, self.training) @ v

        logits = self.lm.cls(self.c_head(query, keys, attend))
        return out.loss + torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]),
                                                            batch["dec_labels"].view(-1))


def time_official(size: dict, seq_len: int, batch_size: int, steps: int, warmup: int, manifest: Path) -> float:
    """Tokens/s of OfficialRetroMAE on the engine's data (collated by the retromae collator): fp32 on CPU, bf16
    autocast on a GPU (as the official code's fp16 / bf16 Trainer runs it)."""
    import time
    from itertools import islice

    from pretrieve.data.masking import Vocabulary
    from pretrieve.data.stream import ShardStream
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.heads import get_method

    method = get_method("retromae")
    options = method.options_from({"max_len": seq_len, "decoder_pool_size": min(seq_len, 256)})
    collate = method.collator.from_options(options, Vocabulary.from_backend(load_backend(DEFAULT_TOKENIZER)))
    samples = list(islice(iter(ShardStream([manifest], seed=0, shuffle_buffer=64)), steps * batch_size))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = OfficialRetroMAE(ModelOptions(**size).hf_config()).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    tokens, started = 0, None
    for step in range(steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            tokens, started = 0, time.perf_counter()
        batch = {k: v.to(device, non_blocking=True) for k, v in
                 collate(samples[step * batch_size:(step + 1) * batch_size]).items()}
        with autocast:
            loss = model(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        tokens += int(batch["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - started)


# the calls that make the host wait for the device, counted in a profile
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item",
         "aten::_local_scalar_dense")
# a device kernel's kind by its name, the first match wins: attention (SDPA's flash / memory-efficient kernels, the
# fused two-stream kernel's _forward / _backward_*), matrix products (cuBLAS, CUTLASS, Hopper's nvjet / wgmma),
# copies; anything else is elementwise (norms, activations, softmax, the optimizer, reductions)
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "_forward", "_backward_kv", "_backward_q")),
                ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "matmul", "mm_", "_mm", "::mm",
                          "::addmm", "::bmm", "::baddbmm")),  # the last: the aten ops that launch them
                ("memcpy", ("memcpy", "memset")))
OPTIMIZER_KERNELS = ("adam", "multi_tensor_apply")  # their last launch ends a step
# the package's named regions of a step (torch.profiler.record_function), as RetroMAE's decoder and its vocabulary
# loss: their kernels share names with others (the encoder's GEMMs), so a region's own line says what they took
REGION = "pretrieve/"


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "elementwise")


def device_shares(kernels: list[tuple[str, float, float]], timed_steps: int) -> dict:
    """The share of the device's time in each kernel kind and idle, over the last `timed_steps` steps (timed_window).
    `kernels`: (name, start, end) in microseconds."""
    kernels = sorted(kernels, key=lambda k: k[1])
    start, stop, window = timed_window(kernels, timed_steps)
    busy = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"elementwise": 0.0}
    covered, cursor = 0.0, start  # the union of kernel intervals: streams may overlap
    for name, begin, end in kernels:
        begin, end = max(begin, start), min(end, stop)
        if end <= begin:
            continue
        busy[kernel_kind(name)] += end - begin
        covered += max(0.0, end - max(begin, cursor))
        cursor = max(cursor, end)
    span = stop - start
    shares = {kind: round(t / span, 4) for kind, t in busy.items()}
    return {"window": window, "span_ms": round(span / 1e3, 3), **shares, "idle": round(1 - covered / span, 4)}


# the host's calls in a profile: kernel launches, and the calls in which it waits for the device
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def host_shares(events: list[tuple[str, float, float]], kernels: list[tuple[str, float, float]],
                timed_steps: int) -> dict:
    """What the host did in the timed steps' window (timed_window), per step: kernels launched, milliseconds in
    launches, waiting for the device (syncs and copies to the host), in the data loader and in optimizer steps.
    A device idle while the host neither waits nor loads data is a host that launches too slowly.
    `events`: the host's (name, start, end) in microseconds."""
    start, stop, window = timed_window(sorted(kernels, key=lambda k: k[1]), timed_steps)
    inside = [(name, end - begin) for name, begin, end in events if begin >= start and end <= stop]
    steps = timed_steps if window == "the timed steps" else 1

    def per_step_ms(match) -> float:
        return round(sum(t for name, t in inside if match(name)) / 1e3 / steps, 3)

    return {"window": window, "per": "step" if steps > 1 else "profiled span",
            "launches": round(sum(name in LAUNCHES for name, _ in inside) / steps, 1),
            "launch_ms": per_step_ms(lambda n: n in LAUNCHES), "wait_ms": per_step_ms(lambda n: n in WAITS),
            "data_loader_ms": per_step_ms(lambda n: n.startswith("enumerate(DataLoader)")),
            "optimizer_step_ms": per_step_ms(lambda n: n.startswith("Optimizer.step#")),
            "step_ms": round((stop - start) / 1e3 / steps, 3)}


def timed_window(kernels: list[tuple[str, float, float]], timed_steps: int) -> tuple[float, float, str]:
    """(start, stop, what) of the last `timed_steps` steps in time-sorted `kernels`: from the end of the
    optimizer's launches `timed_steps` steps before the last to the end of the last. Steps are told apart by the
    optimizer's kernels; without them (no step found), the whole profiled span, said so."""
    step_ends: list[float] = []  # a step's optimizer launches run back to back: the step ends with the run's last
    in_run = False
    for name, _, end in kernels:
        optimizer = any(m in name.lower() for m in OPTIMIZER_KERNELS)
        if optimizer and in_run:
            step_ends[-1] = max(step_ends[-1], end)
        elif optimizer:
            step_ends.append(end)
        in_run = optimizer
    if len(step_ends) > timed_steps:
        return step_ends[-timed_steps - 1], step_ends[-1], "the timed steps"
    return kernels[0][1], kernels[-1][2], "the whole profiled span (no optimizer steps found)"


@contextlib.contextmanager
def profiled(path: str | None, gpu: bool, timed_steps: int, top: int = 40):
    """torch.profiler around the block when `path` is given; the summary goes to `path` as JSON: the ops by self
    device time, the host syncs, the package's named regions (REGION), and on a GPU the timed steps' device time by
    kernel kind and idle."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        yield
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    timed = sorted(((getattr(e, key), e) for e in prof.key_averages()), key=lambda pair: pair[0], reverse=True)
    total = sum(us for us, _ in timed) or 1
    rows = [{"name": e.key, "kind": kernel_kind(e.key), "calls": e.count, "self_ms": round(us / 1e3, 3),
             "share": round(us / total, 4), "cpu_total_ms": round(e.cpu_time_total / 1e3, 3)}
            for us, e in timed[:top]]
    summary = {"sorted_by": key, "scope": "the whole training call: start-up and warm-up steps included",
               "total_ms": round(total / 1e3, 3), "top": rows,
               "syncs": {e.key: e.count for _, e in timed if e.key in SYNCS},
               # the forward of each: backward runs outside the region (the chunked loss makes its gradients there)
               "regions": {e.key: {"calls": e.count, "device_ms": round(e.device_time_total / 1e3, 3),
                                   "cpu_ms": round(e.cpu_time_total / 1e3, 3)}
                           for _, e in timed if e.key.startswith(REGION)}}
    if gpu:
        from torch.autograd import DeviceType

        events = prof.events()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        if kernels:
            summary["device_time"] = device_shares(kernels, timed_steps)
            summary["host_time"] = host_shares([(e.name, e.time_range.start, e.time_range.end) for e in events
                                                if e.device_type == DeviceType.CPU], kernels, timed_steps)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(summary, indent=1) + "\n")


def llm_tokenizer(out: Path) -> str:
    """A decoder LLM's byte-level BPE (`tokenizer train --kind llm`, with Llama2Vec's reserved tokens) of the
    Wikipedia sample: the shards' tokenizer. The model's vocabulary may be larger (Qwen3's 151,669 rows)."""
    from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    train_tokenizer(TokenizerTrainOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(out),
                                          kind="llm", vocab_size=8000, progress=False))
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="retromae")
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the averages")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R (model.lora.r)")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override of the run (repeatable): a speed switch, e.g. model.vocab_loss=plain")
    p.add_argument("--rung", help="the record's name for this run's settings (the ladder names its rungs)")
    p.add_argument("--baseline", action="store_true", help="also time OfficialRetroMAE in this run")
    p.add_argument("--baseline-only", action="store_true", help="time OfficialRetroMAE alone (a ladder's peer)")
    p.add_argument("--ladder", action="store_true",
                   help="every speed switch one after another, each in its own process, and the peers "
                        "(benchmarks/throughput_ladder.py); --methods, --ends-only, --no-peers")
    p.add_argument("--methods", nargs="+", default=["mlm", "retromae", "dupmae"],
                   help="--ladder: the first climbs every rung, the others take the baseline and the top")
    p.add_argument("--ends-only", action="store_true", help="--ladder: every method takes the baseline and the top")
    p.add_argument("--no-peers", dest="peers", action="store_false", help="--ladder: without the peers")
    p.add_argument("--skip", nargs="+", default=(), metavar="RUNG", help="--ladder: leave out these rungs")
    p.add_argument("--top-only", nargs="+", default=(), metavar="METHOD",
                   help="--ladder: these of --methods (not the first) take the top rung alone")
    p.add_argument("--against", nargs="+", default=(), metavar="METHOD",
                   help="also time these methods in this process, in turns with --method, and give its ratio to each")
    p.add_argument("--rounds", type=int, default=3, help="--against: the turns of every method")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pretrain_throughput.json"))
    p.add_argument("--profile", metavar="FILE", help="also profile the run (torch.profiler) into this JSON summary")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    # a rung's train.zero_stage and train.precision (--set, after the defaults) are what the run trains at and records
    args.zero_stage = int(last_set(args.set, "train.zero_stage", args.zero_stage))
    args.precision = last_set(args.set, "train.precision", "bf16" if torch.cuda.is_available() else "fp32")
    if args.ladder:
        from benchmarks.throughput_ladder import run_ladder

        shared = ["--size", args.size, "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup",
                  str(args.warmup), "--out", args.out]
        sys.exit(run_ladder(args, shared + ["--threads", str(args.threads), "--zero-stage", str(args.zero_stage)]))
    if args.against and (args.baseline or args.baseline_only or args.profile or args.method in args.against
                         or {args.method, *args.against} & set(LLM_METHODS) or args.rounds < 1):
        p.error("--against: other encoder methods than --method, without --baseline, --baseline-only or --profile, "
                "and --rounds >= 1")
    from pretrieve.data.prepare import PrepareOptions, prepare

    torch.set_num_threads(args.threads)
    gpu = torch.cuda.is_available()
    llm = args.method in LLM_METHODS
    if llm != ("backbone" in SIZES[args.size]):
        p.error(f"--method {args.method} takes {'a qwen3' if llm else 'an encoder'} --size")
    with tempfile.TemporaryDirectory() as work:
        shards = Path(work) / "shards"
        tokenizer = llm_tokenizer(Path(work) / "tokenizer") if llm else None
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(shards), workers=0,
                               progress=False, **({"tokenizer": tokenizer} if llm else {})))
        size = SIZES[args.size]
        if args.baseline_only:
            record(args, gpu, {"peer": "official-retromae", "tokens_per_s": round(time_official(
                size, args.seq_len, args.batch, args.steps, args.warmup, shards / "manifest.json"), 1)})
            return
        overrides = engine_overrides(args, shards, tokenizer)
        if args.against:
            record(args, gpu, interleaved(args, overrides + args.set, Path(work)))
            return
        # the baseline first: train() tunes this process's allocator (engine.allocator); the official code did not
        baseline = (time_official(size, args.seq_len, args.batch, args.steps, args.warmup, shards / "manifest.json")
                    if args.baseline else None)
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        with profiled(args.profile, gpu, args.steps - args.warmup):
            result = engine_run(args, args.method, overrides + args.set, Path(work) / "run")
    tokens_per_s = result["tokens_per_s"]
    if baseline:
        result.update(baseline_tokens_per_s=round(baseline, 1), ratio_to_baseline=round(tokens_per_s / baseline, 3))
    anchor = None if gpu else ANCHORS.get((args.size, args.seq_len, args.batch))
    if anchor:
        result.update(anchor_tokens_per_s=anchor, ratio_to_anchor=round(tokens_per_s / anchor, 3))
    record(args, gpu, result)


def last_set(overrides: list[str], key: str, default):
    """The value the last `key=value` of `overrides` gives, else `default`."""
    return next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{key}=")), default)


def engine_overrides(args, shards: Path, tokenizer: str | None) -> list[str]:
    """The config overrides of a benchmark run: --size's shape, the prepared `shards`, the length, batch and steps
    (then a stop, no export), a log line every step, no checkpoint before the end, `args.precision`; `tokenizer` for
    a decoder LLM's shards."""
    return [f"model.{k}={v}" for k, v in SIZES[args.size].items()] + [
        *([f"data.tokenizer={tokenizer}"] if tokenizer else []), f"model.lora.r={args.lora}",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"data.manifests=[{shards / 'manifest.json'}]", "data.weights=null",
        # ends at --steps with its checkpoint, not the export: the export (consolidating the weights and writing
        # them, 2-3 s at BERT-base on CPU) is no part of the speed, and a GPU job runs a dozen of these
        f"method.max_len={args.seq_len}", f"train.micro_batch_size={args.batch}", f"train.max_steps={args.steps + 1}",
        f"train.stop_at={args.steps}",
        "train.global_batch_size=null", "train.grad_accum=1", "train.log_every=1", "checkpoint.every=1000000",
        f"train.zero_stage={args.zero_stage}", f"train.precision={args.precision}",
        "tracking.enabled=false", "model.init_from=null"]


def engine_run(args, method: str, overrides: list[str], run_dir: Path) -> dict:
    """`pretrieve pretrain` of `method` for --steps in `run_dir`: tokens/s, s/step, TFLOP/s and MFU averaged over
    the steps after --warmup."""
    from pretrieve.config import load_config
    from pretrieve.pretrain import train
    from pretrieve.pretrain_config import experiment

    if method in ("retromae", "dupmae"):
        overrides = [*overrides, f"method.decoder_pool_size={min(args.seq_len, 256)}"]
    train(experiment(load_config(ROOT / "configs" / "pretrain" / f"{method}.yaml", [*overrides, f"run_dir={run_dir}"])))
    from statistics import median

    timed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    samples_per_s = sum(r["samples_per_s"] for r in timed) / len(timed)
    # the median beside the mean: a one-off stall in the timed steps (with compile on a GPU) moves only the mean
    return {"tokens_per_s": round(sum(r["tokens_per_s"] for r in timed) / len(timed), 1),
            "tokens_per_s_median": round(median(r["tokens_per_s"] for r in timed), 1),
            "s_per_step": round(args.batch / samples_per_s, 4),
            "tflops_per_device": round(sum(r["tflops_per_device"] for r in timed) / len(timed), 4),
            "mfu": round(sum(r.get("mfu", 0.0) for r in timed) / len(timed), 4)}


def interleaved(args, overrides: list[str], work: Path) -> dict:
    """--method and each of --against, one run each in turn, --rounds times over, in this process (a shared
    machine's load drifts: turns spread it over every method alike). Each method's tokens/s of every round, their
    median, and --method's median over each other's."""
    from statistics import median

    methods = [args.method, *args.against]
    runs = {m: [] for m in methods}
    for round_ in range(args.rounds):
        for method in methods:
            runs[method].append(engine_run(args, method, overrides, work / f"{method}-{round_}")["tokens_per_s"])
    medians = {m: median(runs[m]) for m in methods}
    return {"rounds": args.rounds, "tokens_per_s": medians[args.method],
            "tokens_per_s_by_round": runs[args.method],
            "against": {m: {"tokens_per_s": medians[m], "tokens_per_s_by_round": runs[m],
                            "ratio": round(medians[args.method] / medians[m], 3)} for m in args.against}}


def record(args, gpu: bool, measured: dict) -> None:
    """Print the run's record and append it to --out, with what it ran: method, shape, switches, device, versions,
    date, peak memory (the device's allocator on a GPU, the process's resident set on CPU)."""
    import datetime as dt
    import resource

    peak = (torch.cuda.max_memory_allocated() if gpu
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    result = {
        "method": args.method, "size": args.size, "seq_len": args.seq_len, "batch": args.batch,
        "steps": args.steps, "warmup": args.warmup, "zero_stage": args.zero_stage, "lora": args.lora,
        "activation_checkpointing": args.activation_checkpointing,
        **({"rung": args.rung} if args.rung else {}), **({"overrides": args.set} if args.set else {}),
        "device": torch.cuda.get_device_name() if gpu else f"cpu x{args.threads} threads ({platform.processor() or platform.machine()})",
        "precision": args.precision, "torch": torch.__version__, "cuda": torch.version.cuda,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **measured, "peak_memory_gib": round(peak / 2**30, 3),
    }
    append_record(Path(args.out), result)


def append_record(out: Path, result: dict) -> None:
    """Print `result` as one JSON line and append it to the JSON list in `out`, written whole (a ladder's job may
    be killed at any moment)."""
    print(json.dumps(result), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    history = json.loads(out.read_text()) if out.is_file() else []
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(history + [result], indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
