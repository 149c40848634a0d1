"""Unpadded batches (`model.unpad`): a padded batch's texts laid end to end in one row of T = sum(lengths) tokens,
as ModernBERT (Warner et al. 2024) and MosaicBERT (Portes et al. 2023) train.

The encoder packs [B, L] into [1, T] with each text's positions 0 .. length-1, runs the stack, and scatters the
states back to [B, L] (zeros at padding). Embeddings, projections, norms and feed-forward blocks then cost T
tokens, not B x L. Attention stays within each text:
- on CUDA in bf16 or fp16, by `cu_seqlens` through torch's FlashAttention varlen kernel
  (`torch.nn.attention.varlen`), which spends nothing on padding in attention either;
- elsewhere, and under attention dropout (which that kernel lacks), each text's queries, keys and values go
  back to its padded row for SDPA under the padded batch's own masks (HF's, the sliding window included), as
  HF's first ModernBERT did without FlashAttention: exact, and attention costs what it costs padded.
Texts must be a prefix of their row (right padding), as every collator writes them. Packing reads the
batch's token count and longest text on the host: one wait for the device a forward, as in every varlen path.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, create_bidirectional_mask, sdpa_mask

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # a torch without the varlen kernel: padded attention everywhere
    varlen_attn = None
# older torch releases' varlen_attn has no sliding window: their local layers take padded attention
VARLEN_WINDOW = varlen_attn is not None and "window_size" in inspect.signature(varlen_attn).parameters

ATTENTION = "pretrieve_unpadded"  # the attention implementation of an unpadding encoder (HF's AttentionInterface)


@dataclass
class Packed:
    """Where the real tokens of a padded batch go in one packed row."""

    real: torch.Tensor  # bool [B, L]: the real tokens
    index: torch.Tensor  # [T]: their places in the flattened [B * L], row by row
    position_ids: torch.Tensor  # [1, T]: each token's position in its text
    cu_seqlens: torch.Tensor  # int32 [B + 1]: where each text starts in the packed row, and T
    max_len: int
    varlen: bool = False  # set when attention took the varlen kernel

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "Packed":
        real = attention_mask.bool()
        rows, width = real.shape
        lengths = real.sum(1)
        index = real.flatten().nonzero().squeeze(1)
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        return cls(real, index, (index % width)[None], cu_seqlens, int(lengths.max()))

    # index_select and index_copy, not boolean indexing: their backward passes are each other, where a boolean
    # index's is an accumulating index_put, slow on CPU
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, ...] -> [1, T, ...]."""
        return x.flatten(0, 1).index_select(0, self.index)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T, ...] -> [B, L, ...], zeros at padding."""
        rows, width = self.real.shape
        flat = x.new_zeros(rows * width, *x.shape[2:]).index_copy(0, self.index, x[0])
        return flat.view(rows, width, *x.shape[2:])


def padded_mask(model, attention_mask: torch.Tensor, build=create_bidirectional_mask,
                ready: bool = False) -> torch.Tensor | None:
    """The padded batch's [B, 1, L, L] mask as `build` (an HF mask function) makes it for `model`, from its
    [B, L] padding mask (None: no padding): what attention takes where it runs padded. A prepared 4D mask is
    passed through by HF's models, so the stack sees it and not a mask of the packed row.

    `ready`: the mask even where there is no padding, in the format the model's attention takes (SDPA: bool;
    eager: 0 / dtype min added to the scores). HF would otherwise read the mask back to find out (a wait for the
    device each forward, on a GPU) and return None; the padded forward passes this one, so that no step waits."""
    shape = torch.empty(*attention_mask.shape, 0, dtype=model.dtype, device=attention_mask.device)
    return build(model.config, shape, attention_mask, allow_is_bidirectional_skip=not ready)


def unpadded_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window: int | None = None, packed: Packed | None = None, **kwargs):
    """HF attention function: [1, heads, T, d] packed in, [1, T, heads, d] out. A call without `packed` (an
    unpadding model given a padded batch) is plain SDPA."""
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if (varlen_attn is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and not dropout
            and (sliding_window is None or VARLEN_WINDOW)):
        packed.varlen = True
        # HF keeps a sliding window as w + 1 for FlashAttention's inclusive bounds: |i - j| <= w, as SDPA's mask
        window = {} if sliding_window is None else {"window_size": (sliding_window - 1, sliding_window - 1)}
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, d]
        out = varlen_attn(q, k, v, packed.cu_seqlens, packed.cu_seqlens, packed.max_len, packed.max_len,
                          scale=scaling, **window)
        return out[None], None
    q, k, v = (packed.unpack(x.transpose(1, 2)).transpose(1, 2) for x in (query, key, value))  # [B, heads, L, d]
    out, _ = sdpa_attention_forward(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling)
    return packed.pack(out), None


AttentionInterface.register(ATTENTION, unpadded_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the padded batch's masks, as SDPA takes them
