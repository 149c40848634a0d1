"""RetroMAE's decoder (RetroMAE v2 (arXiv) eqs. 2-5) and DupMAE's OT decoding (RetroMAE-2 (ACL 2023)
eqs. 6-8) written out in plain torch from the heads' weights, in float64, against the heads' losses.

Nothing here calls pretrieve's attention, masks, decoder layer or loss code: the mask is unpacked from the
batch by its docs/design.md definition, the layer is BERT's written out, and both official conventions for the
query stream H1 are spelled out (RetroMAE: h + p_i; DupMAE: the embedding module's LayerNorm over h + p_i + t_0).
"""

import numpy as np
import pytest
import torch

from paper_math import bert_layer, bert_states, embed, hf_layer_weights, layer_norm, mean_token_nll, mlm_logits
from test_heads import tiny


def build(method: str, wiki_samples, vocab, **overrides):
    spec, options, model = tiny(method, **overrides)
    model.dropout = 0.0
    head = spec.build(options, model, seed=0).double().eval()
    batch = spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:2])
    return head, batch


def visibility(batch) -> torch.Tensor:
    """M of eq. 5 as a bool [B, L, L]: the pool row of query i, never i itself, never padding (docs/design.md)."""
    width = batch["dec_row"].shape[1]
    pool = np.unpackbits(batch["dec_pool"].numpy(), axis=-1, bitorder="little")[..., :width].astype(bool)
    lengths = batch["attention_mask"].sum(dim=1)
    visible = torch.zeros(len(pool), width, width, dtype=torch.bool)
    for b in range(len(pool)):
        for i in range(width):
            visible[b, i] = torch.from_numpy(pool[b, int(batch["dec_row"][b, i])])
            visible[b, i, i] = False
            visible[b, i, int(lengths[b]):] = False
    return visible


def decoder_loss_by_equations(head, h, batch, query_stream: str) -> torch.Tensor:
    """Eqs. 2-4 for the [CLS] states h [B, d]: streams, masked attention, the layer's FFN, the MLM head."""
    emb, layer = head.encoder.model.embeddings, head.decoder.layers[0]
    ids = batch["dec_input_ids"]
    width = ids.shape[1]
    p = emb.position_embeddings.weight[:width]
    t0 = emb.token_type_embeddings.weight[0]
    if query_stream == "position":  # RetroMAE: H1 = [h + p_0, ..., h + p_N] exactly
        h1 = h[:, None] + p
    else:  # DupMAE: h through the embedding module
        h1 = layer_norm(h[:, None] + p + t0, emb.LayerNorm)
    h2 = torch.cat([h[:, None], embed(head.encoder, ids)[:, 1:]], dim=1)  # H2 = [h, e_x1 + p_1, ..., e_xN + p_N]
    heads = head.encoder.config.num_attention_heads
    x = bert_layer(h1, h2, visibility(batch), heads, hf_layer_weights(layer))  # eq. 3: + M
    return mean_token_nll(head.encoder, x, batch["dec_labels"])


@pytest.mark.parametrize("method,query_stream", [("retromae", "position"), ("retromae", "embeddings"),
                                                 ("dupmae", "embeddings")])
def test_decoder_loss_is_equations_2_to_5(method, query_stream, wiki_samples, vocab):
    head, batch = build(method, wiki_samples, vocab, query_stream=query_stream)
    out = head(batch)
    h = bert_states(head.encoder, batch["input_ids"], batch["attention_mask"])
    mlm = mean_token_nll(head.encoder, h, batch["mlm_labels"])
    by_eq = {s: decoder_loss_by_equations(head, h[:, 0], batch, s) for s in ("position", "embeddings")}
    assert out["mlm"].item() == pytest.approx(mlm.item(), abs=1e-10)
    assert out["dec"].item() == pytest.approx(by_eq[query_stream].item(), abs=1e-10)
    # the two conventions differ on the same weights: the option is not a no-op
    assert abs(by_eq["position"] - by_eq["embeddings"]).item() > 1e-4

    # the gradients agree too: the head's own backward (fused cross-entropy, attention) against eqs. 1-5's
    hidden = head.encoder(batch["input_ids"], batch["attention_mask"])
    head_loss = head.encoder.token_loss(hidden, batch["mlm_labels"]) + head.decoder_loss(hidden[:, 0], batch)
    named = [(name, p) for name, p in head.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    got = torch.autograd.grad(head_loss, params, allow_unused=True)
    want = torch.autograd.grad(mlm + by_eq[query_stream], params, allow_unused=True)
    for (name, p), g, w in zip(named, got, want):
        torch.testing.assert_close(torch.zeros_like(p) if g is None else g, torch.zeros_like(p) if w is None else w,
                                   rtol=1e-7, atol=1e-12, msg=name)


def test_query_stream_defaults_follow_each_official_code():
    assert tiny("retromae")[1].query_stream == "position"  # eq. 2, official RetroMAE modeling.py
    assert tiny("dupmae")[1].query_stream == "embeddings"  # official DupMAE modeling_duplex.py
    with pytest.raises(ValueError, match="method.query_stream"):
        tiny("retromae", query_stream="layernorm")


def bow_loss_official(head, h, batch, ordinary_unmasked: bool) -> torch.Tensor:
    """Eqs. 6-8 as the official code computes them: MLM-head logits of the masked input's positions after [CLS]
    (`all`), max-pooled per vocabulary entry, -sum over set(X) of log softmax / len(X), mean over texts.
    `ordinary_unmasked` drops [SEP] and the encoder-masked positions from the pool (the paper's §3.3)."""
    logits = mlm_logits(head.encoder, h)  # eq. 6 with the tied MLM head as W^O, [B, L, V]
    lengths = batch["attention_mask"].sum(dim=1)
    losses = []
    for b in range(len(h)):
        pooled = range(1, int(lengths[b]) - 1) if ordinary_unmasked else range(1, int(lengths[b]))
        pooled = [i for i in pooled if not ordinary_unmasked or batch["mlm_labels"][b, i] == -100]
        mu = logits[b, pooled].max(dim=0).values  # eq. 7
        ordinary = batch["dec_input_ids"][b, 1:int(lengths[b]) - 1]
        weight = torch.zeros_like(mu)
        weight[ordinary] = 1.0 / len(ordinary)  # the official bag_word_weight
        losses.append(-(weight * mu.log_softmax(dim=-1)).sum())  # eq. 8
    return torch.stack(losses).mean()


@pytest.mark.parametrize("ot_positions", ["all", "unmasked"])
def test_bow_loss_is_equations_6_to_8(ot_positions, wiki_samples, vocab):
    head, batch = build("dupmae", wiki_samples, vocab, ot_positions=ot_positions)
    with torch.no_grad():
        bow = head(batch)["bow"]
        h = bert_states(head.encoder, batch["input_ids"], batch["attention_mask"])
        expected = bow_loss_official(head, h, batch, ordinary_unmasked=ot_positions == "unmasked")
    assert bow.item() == pytest.approx(expected.item(), abs=1e-10)
