"""Fused two-stream masked attention in Triton, FlashAttention-style (RetroMAE eqs. 3 and 5).

softmax(Q K^T / sqrt(d) + M) V for queries from one stream and keys/values from another, with M read on the
fly from the compact decoder mask (DESIGN.md): visible(i, j) = bit j of pool row dec_row[i], j != i,
j < length. Online softmax over key blocks keeps memory at O(B H L D); the backward recomputes the
probabilities from the saved log-sum-exp (FlashAttention-2: one kernel for dK/dV over query blocks, one for
dQ over key blocks, no atomics). Inputs fp32, fp16 or bf16 with fp32 accumulation; head dim 16-128 (a power
of two); any L, ragged lengths. No attention-probability dropout (heads refuse the combination).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported):
that is how the test suite checks them on machines without a GPU.
"""

from __future__ import annotations

import math

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
    def _forward(Q, K, V, O, LSE, POOL, ROW, LEN, seq_len, heads, scale,
                 stride_b, stride_h, stride_pool_b, stride_pool_row,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        base = b * stride_b + h * stride_h
        row_ok = offs_m < seq_len
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        rows = tl.load(ROW + b * seq_len + offs_m, mask=row_ok, other=0).to(tl.int32)
        length = tl.load(LEN + b)
        pool_b = POOL + b * stride_pool_b
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
        pid_n, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        base = b * stride_b + h * stride_h
        k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
        v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
        length = tl.load(LEN + b)
        pool_b = POOL + b * stride_pool_b
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
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        base = b * stride_b + h * stride_h
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        do = _tile(DO, base, offs_m, seq_len, HEAD_DIM)
        lse, delta, rows = _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len)
        length = tl.load(LEN + b)
        pool_b = POOL + b * stride_pool_b
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, length, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
            v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
            p = _probabilities(q, k, lse, scale, pool_b, stride_pool_row, rows, offs_m, offs_n, length, seq_len)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        _store_tile(DQ, base, offs_m, seq_len, dq * scale, HEAD_DIM)


def _blocks(device: torch.device, head_dim: int) -> tuple[int, int]:
    if device.type != "cuda":
        return 16, 16  # the interpreter: small tiles keep the numpy emulation quick
    return (64, 64) if head_dim <= 64 else (64, 32)


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
        block_m, block_n = _blocks(q.device, head_dim)
        scale = 1.0 / math.sqrt(head_dim)
        grid = (triton.cdiv(seq_len, block_m), batch * heads)
        _forward[grid](q, k, v, out, lse, pool, rows, lengths, seq_len, heads, scale,
                       q.stride(0), q.stride(1), pool.stride(0), pool.stride(1),
                       BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim)
        ctx.save_for_backward(q, k, v, out, lse, pool, rows, lengths)
        ctx.scale, ctx.blocks = scale, (block_m, block_n)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, pool, rows, lengths = ctx.saved_tensors
        batch, heads, seq_len, head_dim = q.shape
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(dim=-1)  # [B, H, L]: rowsum(dO * O)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        block_m, block_n = ctx.blocks
        args = (pool, rows, lengths, seq_len, heads, ctx.scale, q.stride(0), q.stride(1), pool.stride(0), pool.stride(1))
        _backward_kv[(triton.cdiv(seq_len, block_n), batch * heads)](
            q, k, v, grad_out, lse, delta, dk, dv, *args, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim)
        _backward_q[(triton.cdiv(seq_len, block_m), batch * heads)](
            q, k, v, grad_out, lse, delta, dq, *args, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim)
        return dq, dk, dv, None, None, None


def fused_two_stream_attention(q, k, v, dec_pool, dec_row, lengths) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the fused kernel needs triton (pip install triton, or pretrieve[gpu])")
    return FusedTwoStreamAttention.apply(q, k, v, dec_pool, dec_row, lengths)
