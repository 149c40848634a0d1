"""BERT written out in plain torch from a model's weights, for the tests that check heads against their papers.

Nothing here calls pretrieve's attention, masks, decoder layer or loss code, nor a module's forward: each step
is the textbook formula over the weight tensors, so a test compares a head with the math, not with itself.
Masks are bool [B, L_query, L_key], True = visible; each test builds its own from its paper's definition.
"""

from __future__ import annotations

import math

import torch


def linear(x: torch.Tensor, module) -> torch.Tensor:
    return x @ module.weight.T + module.bias


def layer_norm(x: torch.Tensor, module) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # biased, as LayerNorm
    return (x - mean) / torch.sqrt(var + module.eps) * module.weight + module.bias


def gelu(x: torch.Tensor) -> torch.Tensor:
    """BERT's exact GELU, x Phi(x)."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def embed(encoder, ids: torch.Tensor) -> torch.Tensor:
    """BERT's input embeddings: LN(word + position + token type 0)."""
    emb = encoder.model.embeddings
    x = emb.word_embeddings.weight[ids] + emb.position_embeddings.weight[: ids.shape[1]] \
        + emb.token_type_embeddings.weight[0]
    return layer_norm(x, emb.LayerNorm)


def attention(h_query, h_context, visible, heads: int, query, key, value) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d) over the visible keys) V per head, heads concatenated: [B, Lq, hidden]."""
    split = lambda x: x.view(*x.shape[:2], heads, -1).transpose(1, 2)  # noqa: E731  [B, heads, L, d]
    q, k, v = split(linear(h_query, query)), split(linear(h_context, key)), split(linear(h_context, value))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(h_query.shape)


def attention_block(h_query, h_context, visible, heads: int, w: dict) -> torch.Tensor:
    """BERT's attention sub-layer: LN(H_q + W_o A + b_o)."""
    a = attention(h_query, h_context, visible, heads, w["query"], w["key"], w["value"])
    return layer_norm(h_query + linear(a, w["attention_output"]), w["attention_norm"])


def ffn_block(x: torch.Tensor, w: dict) -> torch.Tensor:
    """BERT's feed-forward sub-layer: LN(x + W_2 gelu(W_1 x + b_1) + b_2)."""
    return layer_norm(x + linear(gelu(linear(x, w["intermediate"])), w["output"]), w["output_norm"])


def bert_layer(h_query, h_context, visible, heads: int, w: dict) -> torch.Tensor:
    """A post-LN BERT layer; queries from h_query, keys/values from h_context (the same tensor for self-attention)."""
    return ffn_block(attention_block(h_query, h_context, visible, heads, w), w)


def hf_layer_weights(layer) -> dict:
    """The modules of a HF `BertLayer` under `bert_layer`'s names."""
    return {"query": layer.attention.self.query, "key": layer.attention.self.key,
            "value": layer.attention.self.value, "attention_output": layer.attention.output.dense,
            "attention_norm": layer.attention.output.LayerNorm, **hf_ffn_weights(layer.intermediate, layer.output)}


def hf_ffn_weights(intermediate, output) -> dict:
    """A HF feed-forward block (BertIntermediate + BertOutput: two linears and the LayerNorm after them)."""
    return {"intermediate": intermediate.dense, "output": output.dense, "output_norm": output.LayerNorm}


def key_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """The encoder's mask: every query position sees every key of its text, no padding."""
    width = attention_mask.shape[1]
    return attention_mask.bool()[:, None, :].expand(-1, width, -1)


def mlm_logits(encoder, hidden: torch.Tensor) -> torch.Tensor:
    """BERT's MLM head: LN(gelu(W_t h + b_t)) E^T + b, output weights tied to the word embeddings E."""
    t = layer_norm(gelu(linear(hidden, encoder.mlm_transform.dense)), encoder.mlm_transform.LayerNorm)
    return t @ encoder.model.embeddings.word_embeddings.weight.T + encoder.mlm_bias


def mean_token_nll(encoder, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax(logits)[label], averaged over the positions whose label is not -100."""
    keep = labels != -100
    logits = mlm_logits(encoder, hidden[keep])
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return -log_p.gather(-1, labels[keep][:, None]).mean()


def bert_states(encoder, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The encoder's last hidden states [B, L, hidden]: embeddings, then every layer over the unpadded keys."""
    h, visible = embed(encoder, ids), key_padding(attention_mask)
    for layer in encoder.model.encoder.layer:
        h = bert_layer(h, h, visible, encoder.config.num_attention_heads, hf_layer_weights(layer))
    return h
