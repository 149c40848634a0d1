"""The fused attention kernels compiled ahead of time for real GPU targets, no GPU needed: every kernel of
pretrieve/kernels/fused.py at every launch candidate of fused.LAUNCHES (so every head dim), for sm80 (A100) and
sm90 (H100), in bf16, fp16 and fp32. Each must compile (the interpreter of test_kernels.py accepts programs the
compiler rejects, and the reverse), fit the target's shared memory per block, and in fp16 / bf16 run without
register spills (registers and spills read from the cubin with cuobjdump). Two deliberately over-large tiles
show the checks catch a configuration that does not fit. The mask pool reaches the kernels as int64 words
(fused.pool_words).

The suite imports triton in interpreter mode (conftest.py), where @triton.jit yields interpreter functions, so
the compiler runs in subprocesses without TRITON_INTERPRET: this file is also their script."""

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

triton = pytest.importorskip("triton")

from pretrieve.kernels import fused  # noqa: E402

CAPABILITIES = (80, 90)
DTYPES = ("bf16", "fp16", "fp32")
# cudaDevAttrMaxSharedMemoryPerBlockOptin, what triton checks before a launch: the SM's 164 / 228 KB less the
# 1 KB the driver reserves per block
SHARED_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
REGISTERS_PER_BLOCK = 64 * 1024
# the element types FusedTwoStreamAttention passes besides q/k/v and their gradients
POINTEE = {"LSE": "fp32", "DELTA": "fp32", "POOL": "i64", "ROW": "i16", "LEN": "i32"}
# tiles that cannot fit: fp32 128x128 needs over twice the A100's shared memory; bf16 64x128 spills on sm80
OVERSIZED = ("_forward", 80, "fp32", 128, fused.Launch(128, 128, 8, 3))
SPILLING = ("_backward_q", 80, "bf16", 64, fused.Launch(64, 128, 8, 2))

CANDIDATES = [(kernel, head_dim, launch) for kernel, by_dim in fused.LAUNCHES.items()
              for head_dim, launches in by_dim.items() for launch in launches]
JOBS = [(kernel, cap, dtype, head_dim, launch) for kernel, head_dim, launch in CANDIDATES
        for cap in CAPABILITIES for dtype in DTYPES] + [OVERSIZED, SPILLING]


def _cuobjdump() -> str | None:
    try:
        from triton.backends import backends
        return backends["nvidia"] and triton.knobs.nvidia.cuobjdump.path
    except Exception:  # no CUDA backend or no cuobjdump in this triton build
        return None


def _compile(kernel: str, cap: int, dtype: str, head_dim: int, launch) -> dict:
    """Compile one kernel for sm{cap}; its shared memory (bytes per block), registers and spills (bytes per
    thread). Runs in a process that imported triton without the interpreter."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(fused, kernel)
    signature = {name: "constexpr" if name in ("BLOCK_M", "BLOCK_N", "HEAD_DIM") else "fp32" if name == "scale"
                 else "*" + POINTEE.get(name, dtype) if name.isupper() else "i32" for name in fn.arg_names}
    # as the launcher specializes them: torch's pointers are 16-byte aligned, and the row strides are multiples
    # of the head dim
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or name in ("stride_b", "stride_h")}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={"BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n, "HEAD_DIM": head_dim})
    compiled = triton.compile(source, target=GPUTarget("cuda", cap, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    registers, stack, static_shared, local = map(int, found.groups())
    # Triton kernels have no calls or local arrays: the stack frame is spill space (ptxas -v counts the same)
    return {"shared": compiled.metadata.shared + static_shared, "registers": registers, "spills": stack + local}


def _run_jobs() -> None:
    """The subprocess: compile the jobs of argv[1] (JSON), print each one's resources or error (JSON)."""
    results = []
    for kernel, cap, dtype, head_dim, launch in json.loads(sys.argv[1]):
        try:
            results.append(_compile(kernel, cap, dtype, head_dim, fused.Launch(*launch)))
        except Exception as e:  # reported by that configuration's test
            results.append({"error": f"{type(e).__name__}: {e}"[-2000:]})
    json.dump(results, sys.stdout)


@pytest.fixture(scope="module")
def resources() -> dict:
    """Every job's resources, compiled by a few subprocesses in parallel (compilation is single-threaded)."""
    if _cuobjdump() is None:
        pytest.skip("triton's CUDA backend or its cuobjdump is not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    workers = max(1, min(4, len(os.sched_getaffinity(0))))
    chunks = [JOBS[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(chunk)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for chunk in chunks]
    found = {}
    for proc, chunk in zip(procs, chunks):
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-4000:]
        found.update(zip(chunk, json.loads(out)))
    return found


def _fits(job, usage) -> list[str]:
    """What about this compiled configuration breaks the target's limits (empty: it fits)."""
    kernel, cap, dtype, head_dim, launch = job
    problems = []
    if usage["shared"] > SHARED_PER_BLOCK[cap]:
        problems.append(f"{usage['shared']} B shared memory > {SHARED_PER_BLOCK[cap]} B on sm{cap}")
    if usage["registers"] * launch.num_warps * 32 > REGISTERS_PER_BLOCK:
        problems.append(f"{usage['registers']} registers x {launch.num_warps} warps exceed the block's")
    if dtype != "fp32" and usage["spills"]:  # fp32 tiles hold twice the operand registers; spills tolerated
        problems.append(f"{usage['spills']} B of register spills per thread")
    return problems


def _id(launch) -> str:
    return "{}x{}w{}s{}".format(*launch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda cap: f"sm{cap}")
@pytest.mark.parametrize("kernel,head_dim,launch", CANDIDATES,
                         ids=[f"{k}-d{d}-{_id(launch)}" for k, d, launch in CANDIDATES])
def test_launch_candidate_compiles_and_fits(resources, kernel, head_dim, launch, cap, dtype):
    job = (kernel, cap, dtype, head_dim, launch)
    usage = resources[job]
    assert "error" not in usage, usage.get("error")
    assert not _fits(job, usage), f"{_fits(job, usage)}: {usage}"


def test_the_checks_catch_what_does_not_fit(resources):
    assert any("shared memory" in problem for problem in _fits(OVERSIZED, resources[OVERSIZED])), \
        resources[OVERSIZED]
    assert any("spills" in problem for problem in _fits(SPILLING, resources[SPILLING])), resources[SPILLING]


def test_every_kernel_and_head_dim_has_candidates():
    """The table covers what FusedTwoStreamAttention accepts, and the autotuner launches exactly its entries."""
    assert set(fused.LAUNCHES) == {"_forward", "_backward_kv", "_backward_q"}
    for kernel, by_dim in fused.LAUNCHES.items():
        assert sorted(by_dim) == [16, 32, 64, 128]
        for head_dim, launches in by_dim.items():
            # BLOCK_N is the key side in all three: a tile the 64-bit mask words cover (one, or two at 128)
            assert all(launch.block_n in fused.KEY_TILES for launch in launches), (kernel, head_dim)
            for first_only in (False, True):  # torch's deterministic mode: the first candidate, untimed
                configs = fused._tuned(kernel, head_dim, first_only).configs
                assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs] \
                    == [tuple(launch) for launch in launches[:1 if first_only else None]]


if __name__ == "__main__":
    _run_jobs()
