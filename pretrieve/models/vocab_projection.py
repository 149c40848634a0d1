"""Vocabulary projections without keeping the [positions, vocab] logits tensor.

The vocabulary projection of MLM, decoder and bag-of-words heads is most of a small encoder's step, and on
CPU it is memory-bound: each pass over positions x 30,522 floats costs more than the matmul that made them.

`linear_cross_entropy(x, weight, bias, labels)` = F.cross_entropy(F.linear(x, weight, bias), labels), computed
chunk by chunk of positions: each chunk's logits are made, turned into the loss and into the gradients
(softmax - one-hot), multiplied back into grad_x, grad_weight, grad_bias, and dropped. Backward only scales
the stored gradients: the "fused linear cross-entropy" of Liger-Kernel and Megatron, one cache-sized pass
per chunk instead of logits, log_softmax, its backward and zero-filled gradients.

`max_pooled_linear(x, weight, bias, mask)` = the masked max over positions of F.linear(x, weight, bias)
(DupMAE's eq. 7), computed vocabulary chunk by vocabulary chunk; only the winning position per entry is kept,
and backward sends each entry's gradient to its winner (a gather, not a [B, L, vocab] scatter and matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 26}  # logits per chunk: ~8 MB (CPU caches), ~256 MB (GPU)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, labels):
        n, vocab = x.shape[0], weight.shape[0]
        acc = torch.promote_types(weight.dtype, torch.float32)  # softmax and sums in fp32 at least
        # rows per chunk: logits of ~CHUNK_ELEMENTS, but at least `hidden` rows, or re-reading the [vocab, hidden]
        # gradient once per chunk costs more than the logits (MiniLM: 4.1 instead of 5.2 s/step on 2 cores)
        rows = max(1, CHUNK_ELEMENTS.get(x.device.type, 1 << 24) // vocab, x.shape[1])
        grad_x = torch.empty_like(x)
        # [grad_weight | grad_bias] in one matmul: grad^T @ [x, 1] (the bias gradient is the column sums); a frozen
        # weight (LoRA's tied embeddings) gets none: the column sums alone, no [vocab, hidden] matmul
        trains_weight = ctx.needs_input_grad[1]
        grad_weight_bias = torch.zeros(vocab, x.shape[1] + 1 if trains_weight else 1, dtype=acc, device=x.device)
        x_one = torch.cat([x.to(acc), torch.ones(n, 1, dtype=acc, device=x.device)], dim=1) if trains_weight else None
        total = torch.zeros((), dtype=acc, device=x.device)
        for start in range(0, n, rows):
            xc, yc = x[start:start + rows], labels[start:start + rows]
            picked = torch.arange(len(yc), device=x.device)
            grad = F.linear(xc, weight, bias).to(acc).log_softmax(dim=-1)
            total -= grad[picked, yc].sum()
            grad.exp_()[picked, yc] -= 1.0  # d(-log softmax[y]) / d logits = softmax - one-hot
            grad_x[start:start + rows] = (grad.to(weight.dtype) @ weight).to(x.dtype)
            if trains_weight:
                grad_weight_bias.addmm_(grad.t(), x_one[start:start + rows])
            else:
                grad_weight_bias[:, 0] += grad.sum(dim=0)
        grad_weight = grad_weight_bias[:, :-1].to(weight.dtype) if trains_weight else None
        grad_bias = None if bias is None else grad_weight_bias[:, -1].to(bias.dtype)
        ctx.save_for_backward(grad_x, grad_weight, grad_bias)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_loss / grad_x.shape[0]  # the mean over positions
        return (grad_x * scale.to(grad_x.dtype), None if grad_weight is None else grad_weight * scale,
                None if grad_bias is None else grad_bias * scale, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of logits x @ weight.T + bias [N, V] against labels [N] (every label a real class); bias
    None: none (a decoder LLM's LM head)."""
    trains = x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if not torch.is_grad_enabled() or not trains:
        logits = F.linear(x, weight, bias)  # evaluation: no gradients to keep; fp32 at least, as below
        return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), labels)
    return _LinearCrossEntropy.apply(x, weight, bias, labels)


class _MaxPooledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mask):
        batch, vocab = x.shape[0], weight.shape[0]
        columns = max(1, CHUNK_ELEMENTS.get(x.device.type, 1 << 24) // max(1, x.shape[0] * x.shape[1]))
        pooled = torch.empty(batch, vocab, dtype=x.dtype, device=x.device)
        winner = torch.empty(batch, vocab, dtype=torch.long, device=x.device)
        # Two extra input columns, one matmul: [x, mask offset, 1] @ [W, 1, b]^T = x W^T + b, with -1e30 at the
        # positions outside `mask` (no masked_fill pass over the logits; finite, so no inf * 0 = nan)
        offset = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, -1e30)
        x_aug = torch.cat([x, offset[..., None], torch.ones_like(offset)[..., None]], dim=-1)
        for start in range(0, vocab, columns):
            w = weight[start:start + columns]
            w_aug = torch.cat([w, torch.ones_like(w[:, :1]), bias[start:start + columns, None].to(w.dtype)], dim=1)
            torch.max(x_aug @ w_aug.t(), dim=1, out=(pooled[:, start:start + columns], winner[:, start:start + columns]))
        empty = ~mask.any(dim=1)
        pooled[empty] = 0.0  # a text without positions: a zero vector, no gradient
        ctx.save_for_backward(x, weight, winner, empty)
        return pooled

    @staticmethod
    def backward(ctx, grad):
        x, weight, winner, empty = ctx.saved_tensors
        grad = grad.masked_fill(empty[:, None], 0.0)
        grad_x = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight)
        # products in the weight's dtype: under autocast with bf16 states (train.low_precision_norm) x is bf16
        # and the weight fp32
        grad = grad.to(weight.dtype)
        for b in range(x.shape[0]):  # per text: O(vocab x hidden) memory, never batch x vocab x hidden
            grad_x[b].index_add_(0, winner[b], (grad[b, :, None] * weight).to(x.dtype))
            grad_weight += grad[b, :, None] * x[b].index_select(0, winner[b]).to(weight.dtype)
        return grad_x, grad_weight, grad.sum(dim=0), None


def max_pooled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, V]: max over the positions where `mask` [B, L] holds of x [B, L, h] @ weight.T + bias; 0 where none."""
    return _MaxPooledLinear.apply(x, weight, bias, mask)
