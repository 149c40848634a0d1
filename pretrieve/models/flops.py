"""Analytic FLOPs of the model's parts: the building blocks each method's `flops` adds up (engine/flops.py sums
the encoder's and the registered method's).

Counted: the matrix multiplications, 2 FLOPs per multiply-accumulate, on the shapes the hardware computes
(padded batch x length, dense attention scores, masked entries included). Not counted: embeddings lookups,
LayerNorm, softmax, activations, losses (a few % at BERT sizes). With h = hidden, f = FFN width, V = vocab:

    layer(B, q, k)  = 2 B (q (2 h^2 + m h f) + k 2 h^2 + 2 q k h)   Q, O and FFN on q query positions,
                                                                    K and V on k key positions, QK^T and PV;
                                                                    m = 2 FFN matrices (GeGLU: 3)
    encoder         = n_layers x layer(B, L, L) + pooler 2 B h^2 (BERT family) + vocab(masked positions)
    vocab(P)        = 2 P (h^2 + h V)                                  BERT's MLM transform + tied decoder
                                                                    (decoder LLMs: no transform, 2 P h V)
    attention(B, L) = n_layers x 4 B L^2 h                             QK^T and PV of an encoder pass
    adapters(B, L)  = 2 B L r sum(in + out)                            LoRA's A and B on every adapted layer
"""

from __future__ import annotations

import numpy as np
import torch

from pretrieve.models.backbones import backbone_of


def layer_flops(config, batch: int, queries: int, keys: int) -> int:
    """One encoder layer (config: the model's HF config) over `batch` texts, `queries` query and `keys` key
    positions."""
    h, f, m = config.hidden_size, config.intermediate_size, backbone_of(config).ffn_matrices
    return 2 * batch * (queries * (2 * h * h + m * h * f) + keys * 2 * h * h + 2 * queries * keys * h)


def vocab_flops(config, positions: int) -> int:
    """BERT's MLM head (transform + tied decoder to the vocabulary) at `positions` positions; a decoder LLM's
    has no transform (backbones/causal_lm.py)."""
    h = config.hidden_size
    transform = 0 if backbone_of(config).causal else h * h
    return 2 * positions * (transform + h * config.vocab_size)


def vocab_projection_flops(config, positions: int) -> int:
    """A d x |V| projection to the vocabulary at `positions`, the matmul alone (DupMAE's separate linear map
    W^O, eq. 6; the max-pooled projections of DupMAE and LexMAE, whose backward is no matmul)."""
    return 2 * positions * config.hidden_size * config.vocab_size


def labelled(labels: torch.Tensor) -> int:
    """The positions a token loss reads: labels != -100. A batch's FLOPs are counted on the host before its copy
    to the device: numpy's count there dispatches no torch op."""
    if labels.device.type == "cpu":
        return int(np.count_nonzero(labels.numpy() != -100))
    return int((labels != -100).sum())


def encoder_flops(config, batch: dict[str, torch.Tensor]) -> int:
    """The shared encoder on `input_ids`, its pooler and the MLM head at the `mlm_labels` targets."""
    if "input_ids" not in batch:  # pairs: the method counts its encoder passes (heads/contrastive.py)
        return 0
    b, length = batch["input_ids"].shape
    h = config.hidden_size
    pooler = 2 * b * h * h if backbone_of(config).has_pooler else 0
    return (config.num_hidden_layers * layer_flops(config, b, length, length) + pooler
            + vocab_flops(config, labelled(batch["mlm_labels"])))


# the encoder's passes in a batch: the texts (`input_ids`), or a pair batch's queries, positives and negatives
ENCODER_INPUTS = ("input_ids", "q_input_ids", "p_input_ids", "n_input_ids")


def attention_flops(config, batch: dict[str, torch.Tensor]) -> int:
    """QK^T and PV (no weights) of the encoder's passes over `batch`: the part of layer_flops whose backward still
    takes two matmuls when every weight is frozen."""
    return sum(config.num_hidden_layers * 4 * ids.shape[0] * ids.shape[1] ** 2 * config.hidden_size
               for key, ids in batch.items() if key in ENCODER_INPUTS)


def first_projections_flops(config, batch: dict[str, torch.Tensor]) -> int:
    """The first layer's Q, K and V projections over the encoder's passes: with the embeddings frozen (LoRA)
    their input needs no gradient, so their backward is no matmul at all."""
    h, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    width = h + 2 * kv * (getattr(config, "head_dim", None) or h // heads)
    return sum(2 * ids.numel() * h * width for key, ids in batch.items() if key in ENCODER_INPUTS)


def adapter_flops(rank: int, width: int, batch: dict[str, torch.Tensor]) -> int:
    """LoRA's adapters (rank `rank`; `width`: the in + out features of every adapted layer together) over
    every token of the encoder's passes."""
    return sum(2 * ids.numel() * rank * width for key, ids in batch.items() if key in ENCODER_INPUTS)
