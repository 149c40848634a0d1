"""Fused two-stream masked attention in Triton, FlashAttention-style (RetroMAE eqs. 3 and 5).

softmax(Q K^T / sqrt(d) + M) V for queries from one stream and keys/values from another, with M read on the
fly from the compact decoder mask (docs/design.md): visible(i, j) = bit j of pool row dec_row[i], j != i,
j < length. Online softmax over key blocks keeps memory at O(B H L D); the backward recomputes the
probabilities from the saved log-sum-exp (FlashAttention-2: one kernel for dK/dV over query blocks, one for
dQ over key blocks, no atomics). Inputs fp32, fp16 or bf16 with fp32 accumulation; head dim 16-128 (a power
of two); any L, ragged lengths. No attention-probability dropout (heads refuse the combination).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported):
that is how the test suite checks them on machines without a GPU. On CUDA each kernel launches with one of its
LAUNCHES candidates (tiles, warps, pipeline stages); tests/test_kernels_compile.py compiles every candidate for
sm80 and sm90 and checks its shared memory, registers and spills.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dev/gpu dependency
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _visible(pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len):
        """bool [BLOCK_M, BLOCK_N]: key n visible to query m."""
        key_ok = offs_n[None, :] < length
        byte = tl.load(pool_b + rows[:, None] * stride_pool_row + (offs_n[None, :] >> 3), mask=key_ok, other=0)
        bit = (byte.to(tl.int32) >> (offs_n[None, :] & 7)) & 1
        return (bit != 0) & key_ok & (offs_n[None, :] != offs_m[:, None]) & (offs_m[:, None] < seq_len)

    @triton.jit
    def _tile(ptr, base, offs, seq_len, HEAD_DIM: tl.constexpr):
        """[len(offs), HEAD_DIM]: rows `offs` of one (batch, head) slice of a [B, H, L, D] tensor; 0 past seq_len."""
        offs_d = tl.arange(0, HEAD_DIM)
        return tl.load(ptr + base + offs[:, None] * HEAD_DIM + offs_d[None, :], mask=offs[:, None] < seq_len,
                       other=0.0)

    @triton.jit
    def _store_tile(ptr, base, offs, seq_len, value, HEAD_DIM: tl.constexpr):
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(ptr + base + offs[:, None] * HEAD_DIM + offs_d[None, :], value.to(ptr.dtype.element_ty),
                 mask=offs[:, None] < seq_len)

    @triton.jit
    def _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len):
        """Per query row: the forward's log-sum-exp, rowsum(dO * O), and the row's pool index."""
        row_ok = offs_m < seq_len
        lse = tl.load(LSE + bh * seq_len + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + bh * seq_len + offs_m, mask=row_ok, other=0.0)
        rows = tl.load(ROW + b * seq_len + offs_m, mask=row_ok, other=0).to(tl.int32)
        return lse, delta, rows

    @triton.jit
    def _probabilities(q, k, lse, scale, pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len):
        """The forward's softmax recomputed from its log-sum-exp: exp(Q K^T * scale - lse), 0 where masked."""
        s = tl.dot(q, tl.trans(k)) * scale
        visible = _visible(pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len)
        return tl.where(visible, tl.exp(s - lse[:, None]), 0.0)

    @triton.jit
    def _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b, BLOCK: tl.constexpr):
        """What one program of a kernel works on. Grid axis 1 is its (batch, head) slice bh = b * heads + h, axis 0
        its block of BLOCK rows: returns b, bh, the block's rows, the slice's offset in a [B, H, L, D] tensor, the
        sample's length and its pool of visibility rows."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        b = bh // heads
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        return b, bh, offs, b * stride_b + (bh % heads) * stride_h, tl.load(LEN + b), POOL + b * stride_pool_b

    @triton.jit
    def _forward(Q, K, V, O, LSE, POOL, ROW, LEN, seq_len, heads, scale,
                 stride_b, stride_h, stride_pool_b, stride_pool_row,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        b, bh, offs_m, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b, BLOCK_M)
        row_ok = offs_m < seq_len
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        rows = tl.load(ROW + b * seq_len + offs_m, mask=row_ok, other=0).to(tl.int32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, length, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
            v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(_visible(pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        _store_tile(O, base, offs_m, seq_len, acc / l_safe[:, None], HEAD_DIM)
        tl.store(LSE + bh * seq_len + offs_m, m_i + tl.log(l_safe), mask=row_ok)

    @triton.jit
    def _backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, POOL, ROW, LEN, seq_len, heads, scale,
                     stride_b, stride_h, stride_pool_b, stride_pool_row,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        b, bh, offs_n, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b, BLOCK_N)
        k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
        v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        for start_m in range(0, seq_len, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
            do = _tile(DO, base, offs_m, seq_len, HEAD_DIM)
            lse, delta, rows = _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len)
            p = _probabilities(q, k, lse, scale, pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        _store_tile(DK, base, offs_n, seq_len, dk * scale, HEAD_DIM)
        _store_tile(DV, base, offs_n, seq_len, dv, HEAD_DIM)

    @triton.jit
    def _backward_q(Q, K, V, DO, LSE, DELTA, DQ, POOL, ROW, LEN, seq_len, heads, scale,
                    stride_b, stride_h, stride_pool_b, stride_pool_row,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        b, bh, offs_m, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b, BLOCK_M)
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        do = _tile(DO, base, offs_m, seq_len, HEAD_DIM)
        lse, delta, rows = _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, length, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
            v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
            p = _probabilities(q, k, lse, scale, pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        _store_tile(DQ, base, offs_m, seq_len, dq * scale, HEAD_DIM)


class Launch(NamedTuple):
    """One launch configuration: the tile (BLOCK_M query rows x BLOCK_N key rows), warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The interpreter: small tiles keep the numpy emulation quick (warps and stages mean nothing there).
INTERPRETER = Launch(16, 16, 1, 1)

# CUDA candidates per kernel and head dim, for sm80 and sm90 and fp32 / fp16 / bf16 alike. triton.autotune times
# both at the first call per head dim and dtype and keeps the faster: tile shape trades reloads of the streamed
# operands against registers and occupancy, which only the GPU can weigh. Under torch's deterministic mode
# (train.deterministic) the first runs untimed, as cuDNN stops benchmarking there: another tile sums in another
# order, so a resumed run could drift. tests/test_kernels_compile.py compiles each for sm80 and sm90: it fits in
# shared memory (fp32 at head dim 128 with ~35 KB to spare on an A100) and does not spill in fp16 / bf16. The
# bit-mask gather in _visible costs registers like a third dot, hence 8 warps for 64x64 tiles or a 32-wide side:
# 4-warp 64x64 tiles spill on sm80.
LAUNCHES = {
    "_forward": {
        16: (Launch(128, 32, 8, 3), Launch(64, 32, 4, 3)),
        32: (Launch(128, 32, 8, 3), Launch(64, 32, 4, 3)),
        64: (Launch(64, 64, 8, 3), Launch(64, 32, 8, 3)),
        128: (Launch(64, 32, 8, 3), Launch(32, 64, 8, 2)),
    },
    "_backward_kv": {
        16: (Launch(64, 64, 8, 3), Launch(64, 32, 4, 3)),
        32: (Launch(32, 64, 8, 3), Launch(64, 32, 4, 3)),
        64: (Launch(64, 32, 8, 3), Launch(64, 32, 4, 3)),
        128: (Launch(32, 64, 8, 3), Launch(32, 32, 4, 3)),
    },
    "_backward_q": {
        16: (Launch(128, 32, 8, 3), Launch(64, 32, 4, 3)),
        32: (Launch(128, 32, 8, 3), Launch(64, 32, 4, 3)),
        64: (Launch(32, 64, 8, 3), Launch(64, 32, 8, 3)),
        128: (Launch(64, 32, 8, 3), Launch(32, 64, 8, 2)),
    },
}


@functools.lru_cache(maxsize=None)
def _tuned(name: str, head_dim: int, first_only: bool):
    """Kernel `name` autotuned over its candidates at this head dim; first_only: just the first (not timed)."""
    launches = LAUNCHES[name][head_dim][:1] if first_only else LAUNCHES[name][head_dim]
    configs = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                             num_stages=c.num_stages) for c in launches]
    return triton.autotune(configs, key=["HEAD_DIM"])(globals()[name])


def _launch(name: str, tile: str, seq_len: int, batch_heads: int, *args, head_dim: int) -> None:
    """Run kernel `name` on a grid of (seq_len / tile, batch * heads); tile: "BLOCK_M" or "BLOCK_N", the side of
    the tile each program owns."""
    kernel = globals()[name]
    if not isinstance(kernel, triton.runtime.JITFunction):  # the interpreter
        blocks = {"BLOCK_M": INTERPRETER.block_m, "BLOCK_N": INTERPRETER.block_n}
        kernel[(triton.cdiv(seq_len, blocks[tile]), batch_heads)](*args, **blocks, HEAD_DIM=head_dim)
        return
    tuned = _tuned(name, head_dim, torch.are_deterministic_algorithms_enabled())
    tuned[lambda meta: (triton.cdiv(seq_len, meta[tile]), batch_heads)](*args, HEAD_DIM=head_dim)


class FusedTwoStreamAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dec_pool, dec_row, lengths):
        batch, heads, seq_len, head_dim = q.shape
        if head_dim not in (16, 32, 64, 128):
            raise ValueError(f"fused two-stream attention supports head dims 16, 32, 64, 128, not {head_dim}")
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        pool, rows = dec_pool.contiguous(), dec_row.contiguous()
        lengths = lengths.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(batch, heads, seq_len, device=q.device, dtype=torch.float32)
        scale = 1.0 / math.sqrt(head_dim)
        _launch("_forward", "BLOCK_M", seq_len, batch * heads, q, k, v, out, lse, pool, rows, lengths, seq_len,
                heads, scale, q.stride(0), q.stride(1), pool.stride(0), pool.stride(1), head_dim=head_dim)
        ctx.save_for_backward(q, k, v, out, lse, pool, rows, lengths)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, pool, rows, lengths = ctx.saved_tensors
        batch, heads, seq_len, head_dim = q.shape
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # [B, H, L]: rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        # the backward's tiles need not match the forward's: it recomputes the probabilities from the log-sum-exp
        args = (pool, rows, lengths, seq_len, heads, ctx.scale, q.stride(0), q.stride(1), pool.stride(0), pool.stride(1))
        _launch("_backward_kv", "BLOCK_N", seq_len, batch * heads, q, k, v, grad_out, lse, delta, dk, dv, *args,
                head_dim=head_dim)
        _launch("_backward_q", "BLOCK_M", seq_len, batch * heads, q, k, v, grad_out, lse, delta, dq, *args,
                head_dim=head_dim)
        return dq, dk, dv, None, None, None


def fused_two_stream_attention(q, k, v, dec_pool, dec_row, lengths) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the fused kernel needs triton (pip install triton, or pretrieve[gpu])")
    return FusedTwoStreamAttention.apply(q, k, v, dec_pool, dec_row, lengths)
