"""Fused two-stream masked attention in Triton, FlashAttention-2-style (RetroMAE eqs. 3 and 5).

softmax(Q K^T / sqrt(d) + M) V for queries from one stream and keys/values from another, with M computed in the
kernel from the compact decoder mask (docs/design.md): visible(i, j) = bit j of pool row dec_row[i], j != i,
j < length. Per tile, each query row loads one 64-bit word of its pool row (two for 128-key tiles), the diagonal
and the length are cleared in that word, and a shift and a mask per element give the tile's bits: no L x L mask
anywhere, and no per-element gather. The mask is the collator's own (pool rows sample whole words, a row per
query): regenerating it from a seed would need the word ids and a hash per element, more work than the load,
and another random stream than the collator's, so the kernel reads the pool.

Online softmax over key blocks, in base 2, keeps memory at O(B H L D); the backward recomputes the probabilities
from the saved log2-sum-exp2 (one kernel for dK/dV over query blocks, one for dQ over key blocks: P is computed
twice, but no atomics, so the gradients are deterministic, which train.deterministic relies on). Dots take the
inputs' type (bf16 / fp16 tensor cores; fp32 inputs: TF32) with fp32 accumulation; head dim 16-128 (a power
of two); any L, ragged lengths. No attention-probability dropout (heads refuse the combination).

On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported):
that is how the test suite checks them on machines without a GPU. On CUDA each kernel launches with one of its
LAUNCHES candidates (tiles, warps, pipeline stages); tests/test_kernels_compile.py compiles every candidate for
sm80 and sm90 and checks its shared memory, registers and spills.
"""
from __future__ import annotations

import functools
import math
import sys
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
    LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)

    @triton.jit
    def _pool_word(pool_b, stride_pool_row, rows, offs_m, row_ok, word, length):
        """int64 [BLOCK_M]: which keys 64 * word .. 64 * word + 63 each query row sees, one bit per key: the word
        of its pool row, less its own position (j != i) and the keys at or past `length`; 0 for rows past L.

        One load per query row instead of one per (query, key): the diagonal and the length are folded into the
        word here, per row, so that the per-element work in _tile_visible is one shift and one mask."""
        bits = tl.load(pool_b + rows * stride_pool_row + word, mask=row_ok, other=0)
        first = word * 64
        own = (offs_m - first).to(tl.int64)
        in_word = (own >= 0) & (own < 64)
        bits = tl.where(in_word, bits & ~(1 << tl.where(in_word, own, 0)), bits)
        keep = tl.minimum(tl.maximum(length - first, 0), 64).to(tl.int64)  # keys of this word below the length
        return bits & tl.where(keep == 64, -1, (1 << tl.minimum(keep, 63)) - 1)

    @triton.jit
    def _tile_visible(lo, hi, start_n, BLOCK_N: tl.constexpr, KEYS_FIRST: tl.constexpr):
        """bool [BLOCK_M, BLOCK_N] (KEYS_FIRST: [BLOCK_N, BLOCK_M], the dK/dV kernel's transposed tile): key
        start_n + n visible to query m, from each query row's word `lo` of _pool_word (`hi`: the next word, read
        only by 128-key tiles, which span two). Tiles of 16-64 keys lie inside one word (start_n is a multiple
        of the tile): the row's word is shifted to the tile once per row, and to 32 bits when the tile fits."""
        keys = tl.arange(0, BLOCK_N)
        if BLOCK_N > 64:
            if KEYS_FIRST:
                bits = tl.where(keys[:, None] < 64, lo[None, :], hi[None, :]) >> (keys[:, None] & 63)
            else:
                bits = tl.where(keys[None, :] < 64, lo[:, None], hi[:, None]) >> (keys[None, :] & 63)
        else:
            row = lo >> (start_n & 63)
            if BLOCK_N <= 32:  # 32-bit shifts are one instruction, 64-bit ones two
                row = row.to(tl.int32)
            if KEYS_FIRST:
                bits = row[None, :] >> keys[:, None]
            else:
                bits = row[:, None] >> keys[None, :]
        return (bits & 1) != 0

    @triton.jit
    def _visible(pool_b, stride_pool_row, rows, offs_m, row_ok, start_n, length, BLOCK_N: tl.constexpr,
                 KEYS_FIRST: tl.constexpr):
        """The tile of keys start_n .. start_n + BLOCK_N - 1 against queries offs_m (rows: their pool rows):
        visible(i, j) = bit j of pool row dec_row[i], j != i, j < length, as kernels/reference.py defines it."""
        word = start_n // 64
        lo = _pool_word(pool_b, stride_pool_row, rows, offs_m, row_ok, word, length)
        hi = lo
        if BLOCK_N > 64:
            hi = _pool_word(pool_b, stride_pool_row, rows, offs_m, row_ok, word + 1, length)
        return _tile_visible(lo, hi, start_n, BLOCK_N, KEYS_FIRST)

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
        """Per query row: the forward's log2-sum-exp2, rowsum(dO * O), and the row's pool index."""
        row_ok = offs_m < seq_len
        lse = tl.load(LSE + bh * seq_len + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + bh * seq_len + offs_m, mask=row_ok, other=0.0)
        rows = tl.load(ROW + b * seq_len + offs_m, mask=row_ok, other=0).to(tl.int32)
        return lse, delta, rows

    @triton.jit
    def _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b, BLOCK: tl.constexpr):
        """What one program of a kernel works on. Grid axis 1 is its (batch, head) slice bh = b * heads + h, axis 0
        its block of BLOCK rows: returns b, bh, the block's first row and rows, the slice's offset in a
        [B, H, L, D] tensor, the sample's length and its pool of visibility words."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        b = bh // heads
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        return (b, bh, pid * BLOCK, offs, b * stride_b + (bh % heads) * stride_h, tl.load(LEN + b),
                POOL + b * stride_pool_b)

    @triton.jit
    def _forward(Q, K, V, O, LSE, POOL, ROW, LEN, seq_len, heads, scale,
                 stride_b, stride_h, stride_pool_b, stride_pool_row,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        b, bh, _, offs_m, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b,
                                                          BLOCK_M)
        row_ok = offs_m < seq_len
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        rows = tl.load(ROW + b * seq_len + offs_m, mask=row_ok, other=0).to(tl.int32)
        # softmax in base 2 (exp2 is the GPU's native instruction): scores scaled by log2(e) / sqrt(d), one
        # multiply per score that the subtraction of the running max fuses with
        qk_scale = scale * LOG2E
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, length, BLOCK_N):  # keys at or past the length are visible to no query
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
            v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
            visible = _visible(pool_b, stride_pool_row, rows, offs_m, row_ok, start_n, length, BLOCK_N, False)
            s = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)  # P in the inputs' type: bf16 / fp16 MMA
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        _store_tile(O, base, offs_m, seq_len, acc / l_safe[:, None], HEAD_DIM)
        tl.store(LSE + bh * seq_len + offs_m, m_i + tl.log2(l_safe), mask=row_ok)

    @triton.jit
    def _backward_kv(Q, K, V, DO, LSE, DELTA, DK, DV, POOL, ROW, LEN, seq_len, heads, scale,
                     stride_b, stride_h, stride_pool_b, stride_pool_row,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        """dK and dV of a block of keys, over the query blocks. Works on the transposed tile (keys x queries):
        S^T = K Q^T gives P^T and dS^T in the layout the dV += P^T dO and dK += dS^T Q products take as their
        first operand, where P and dS would each need a transpose through shared memory."""
        b, bh, start_n, offs_n, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h,
                                                                stride_pool_b, BLOCK_N)
        k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
        v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
        qk_scale = scale * LOG2E
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        # a block of keys at or past the length is seen by no query (padding): its dK, dV are 0 with no loop
        end_m = tl.where(start_n < length, seq_len, 0)
        for start_m in range(0, end_m, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
            do = _tile(DO, base, offs_m, seq_len, HEAD_DIM)
            lse, delta, rows = _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len)
            visible = _visible(pool_b, stride_pool_row, rows, offs_m, offs_m < seq_len, start_n, length, BLOCK_N,
                               True)
            p_t = tl.where(visible, tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
        _store_tile(DK, base, offs_n, seq_len, dk * scale, HEAD_DIM)
        _store_tile(DV, base, offs_n, seq_len, dv, HEAD_DIM)

    @triton.jit
    def _backward_q(Q, K, V, DO, LSE, DELTA, DQ, POOL, ROW, LEN, seq_len, heads, scale,
                    stride_b, stride_h, stride_pool_b, stride_pool_row,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
        b, bh, _, offs_m, base, length, pool_b = _program(LEN, POOL, heads, stride_b, stride_h, stride_pool_b,
                                                          BLOCK_M)
        q = _tile(Q, base, offs_m, seq_len, HEAD_DIM)
        do = _tile(DO, base, offs_m, seq_len, HEAD_DIM)
        lse, delta, rows = _query_rows(LSE, DELTA, ROW, b, bh, offs_m, seq_len)
        qk_scale = scale * LOG2E
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, length, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _tile(K, base, offs_n, seq_len, HEAD_DIM)
            v = _tile(V, base, offs_n, seq_len, HEAD_DIM)
            visible = _visible(pool_b, stride_pool_row, rows, offs_m, offs_m < seq_len, start_n, length, BLOCK_N,
                               False)
            p = tl.where(visible, tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]), 0.0)
            ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        _store_tile(DQ, base, offs_m, seq_len, dq * scale, HEAD_DIM)


class Launch(NamedTuple):
    """One launch configuration: the tile (BLOCK_M query rows x BLOCK_N key rows), warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# The interpreter: small tiles keep the numpy emulation quick (warps and stages mean nothing there). Tests swap
# in others to run each path of _tile_visible (16, 32, 64 and 128 keys a tile).
INTERPRETER = Launch(16, 16, 1, 1)

# Key tiles of 16, 32 or 64 keys lie inside one 64-bit mask word, 128-key tiles span two (_tile_visible); other
# widths would straddle words.
KEY_TILES = (16, 32, 64, 128)

# CUDA candidates per kernel and head dim, for sm80 and sm90 and fp32 / fp16 / bf16 alike; triton.autotune times
# them at the first call per head dim and dtype and keeps the fastest. Tile shape trades reloads of the streamed
# operands against registers and occupancy, which only a GPU can weigh, so each kernel gets FlashAttention-2's
# shapes for sm80 / sm90 (the forward and dQ: 128 query rows a program, 8 warps to hold its accumulator, 64 or 32
# keys streamed; dK/dV: 128 keys a program, narrow 32-row query blocks streamed, as FA-2 and Triton's fused
# attention tutorial do) plus a 64 x 64 tile as the fallback. Head dim 128 halves a side (64 keys for dK/dV, 64
# query rows for dQ): its two fp32 accumulators of 128 x 128 spill in bf16 even with 8 warps. 3 stages: Hopper's
# and Ampere's asynchronous copies keep two tiles of the streamed operands in flight while one is computed on;
# 2 where a third fp32 stage would not fit an A100's shared memory (head dim 128).
# Under torch's deterministic mode (train.deterministic) the first candidate runs untimed, as cuDNN stops
# benchmarking there: another tile sums in another order, so a resumed run could drift.
# tests/test_kernels_compile.py compiles each for sm80 and sm90: it fits in shared memory and does not spill in
# fp16 / bf16. The mask costs a load per query row and tile and a shift per element (_pool_word), not the
# per-element byte gather of the earlier kernel, which needed 8 warps on every 64 x 64 tile to avoid spills.
LAUNCHES = {
    "_forward": {
        16: (Launch(128, 64, 4, 3), Launch(64, 64, 4, 3)),
        32: (Launch(128, 64, 4, 3), Launch(64, 64, 4, 3)),
        64: (Launch(128, 64, 8, 3), Launch(128, 32, 4, 3), Launch(64, 64, 4, 3)),
        128: (Launch(128, 64, 8, 2), Launch(64, 64, 4, 2)),
    },
    "_backward_kv": {
        16: (Launch(32, 128, 4, 3), Launch(64, 64, 4, 3)),
        32: (Launch(32, 128, 4, 3), Launch(64, 64, 4, 3)),
        64: (Launch(32, 128, 8, 3), Launch(32, 64, 4, 3), Launch(64, 64, 8, 3)),
        128: (Launch(32, 64, 8, 3), Launch(32, 64, 4, 3)),
    },
    "_backward_q": {
        16: (Launch(128, 32, 4, 3), Launch(64, 64, 4, 3)),
        32: (Launch(128, 32, 4, 3), Launch(64, 64, 4, 3)),
        64: (Launch(128, 32, 8, 3), Launch(128, 64, 8, 3), Launch(64, 64, 4, 3)),
        128: (Launch(64, 32, 8, 3), Launch(64, 64, 4, 2)),
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
        if INTERPRETER.block_n not in KEY_TILES:
            raise ValueError(f"key tiles of {INTERPRETER.block_n}: the mask words cover {KEY_TILES}")
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
        pool, rows = pool_words(dec_pool), dec_row.contiguous()
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


def pool_words(dec_pool: torch.Tensor) -> torch.Tensor:
    """The bit-packed uint8 pool [B, P, ceil(L / 8)] as int64 words [B, P, W], W even (a 128-key tile reads two
    words) and zero-padded: on a little-endian machine (every CUDA host) bit j of a pool row is bit j % 64 of word
    j // 64, the layout _pool_word reads. A copy of B * P * L / 8 bytes per forward, reused by the backward."""
    if sys.byteorder != "little":
        raise RuntimeError("the fused kernel reads the mask pool as little-endian 64-bit words")
    *lead, nbytes = dec_pool.shape
    padded = torch.zeros(*lead, nbytes + -nbytes % 16, dtype=torch.uint8, device=dec_pool.device)
    padded[..., :nbytes] = dec_pool  # a fresh tensor: its rows start 8-byte aligned, whatever dec_pool's offset
    return padded.view(torch.int64)


def fused_two_stream_attention(q, k, v, dec_pool, dec_row, lengths) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("the fused kernel needs triton (pip install triton, or pretrieve[gpu])")
    return FusedTwoStreamAttention.apply(q, k, v, dec_pool, dec_row, lengths)
