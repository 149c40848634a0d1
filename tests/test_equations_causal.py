"""The causal-decoder heads written out from their papers in plain torch (tests/paper_math.py), float64, against
the heads' losses: SEED-Encoder's weak decoder (the SEED-Encoder paper eqs. 9-10), CoT-MAE's context decoder as the
CoT-MoTE paper summarises it (`decoder_objective: clm`, the CoT-MoTE paper eqs. 10-12) and CoT-MoTE's textual experts
(the CoT-MoTE paper eqs. 7-9). The released CoT-MAE objective: tests/test_cotmae_released.py.

Masks are built by loops from each paper's definition, targets from the token ids; nothing here calls
pretrieve's window_mask, decoder layers, attention or token_loss.
"""

import pytest
import torch

from paper_math import (attention_block, bert_layer, bert_states, embed, ffn_block,
                        hf_ffn_weights, hf_layer_weights, key_padding, mean_token_nll)
from test_heads import tiny


def build(method: str, wiki_samples, vocab, **overrides):
    spec, options, model = tiny(method, **{"max_len": 64, **overrides})  # short: vocabulary projections dominate
    model.dropout = 0.0
    head = spec.build(options, model, seed=0).double().eval()
    batch = spec.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    return head, batch


def next_token_targets(ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Teacher forcing over [CLS] y_1 .. y_m [SEP]: position i (holding y_i, or h_0 at i = 0) predicts y_{i+1},
    for the ordinary tokens y_1 .. y_m only (never [SEP] nor padding): -100 elsewhere."""
    targets = torch.full_like(ids, -100)
    for b, n in enumerate(attention_mask.sum(dim=1).tolist()):
        for i in range(n - 2):  # y_{i+1} sits at position i + 1 <= n - 2
            targets[b, i] = ids[b, i + 1]
    return targets


def seed_visibility(lengths: torch.Tensor, width: int, k: int) -> torch.Tensor:
    """Eq. 9's context per layer: the state predicting x_t (position t - 1) reads h_0 (position 0) and
    x_{t-k} .. x_{t-1} (positions t - k .. t - 1), never padding."""
    visible = torch.zeros(len(lengths), width, width, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        for i in range(width):
            t = i + 1
            for j in [0, *range(max(1, t - k), t)]:
                visible[b, i, j] = j < n
    return visible


def causal_visibility(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Eq. 12's CLM context: the state predicting y_t reads h_0 and every y_s with s < t, never padding."""
    visible = torch.zeros(len(lengths), width, width, dtype=torch.bool)
    for b, n in enumerate(lengths.tolist()):
        for i in range(width):
            for j in range(i + 1):
                visible[b, i, j] = j < n
    return visible


def decoder_loss_by_equations(head, h0: torch.Tensor, ids, attention_mask, visible) -> torch.Tensor:
    """Decoder input [h_0, e_y1 + p_1, ...] (h_0 replaces [CLS]), the decoder's BERT layers under `visible`, the
    tied MLM head; -log P(y_t | context, h_0) averaged over the batch's predicted tokens."""
    x = torch.cat([h0[:, None], embed(head.encoder, ids)[:, 1:]], dim=1)
    for layer in head.decoder.layers:
        x = bert_layer(x, x, visible, head.encoder.config.num_attention_heads, hf_layer_weights(layer))
    return mean_token_nll(head.encoder, x, next_token_targets(ids, attention_mask))


def mote_states(encoder, ids, attention_mask, text_type) -> torch.Tensor:
    """Eqs. 7-9 per layer: h' = LN(h + MHA(h)) with the one shared attention; h_q = LN(h' + Q-FFN(h')) for
    queries (text_type 1), h_p = LN(h' + P-FFN(h')) for passages. The P-FFN is the base model's own block."""
    h, visible = embed(encoder, ids), key_padding(attention_mask)
    is_query = text_type.bool()[:, None, None]
    for layer, expert in zip(encoder.model.encoder.layer, encoder.query_experts):
        shared = attention_block(h, h, visible, encoder.config.num_attention_heads, hf_layer_weights(layer))
        h_q = ffn_block(shared, hf_ffn_weights(expert["intermediate"], expert["output"]))
        h_p = ffn_block(shared, hf_ffn_weights(layer.intermediate, layer.output))
        h = torch.where(is_query, h_q, h_p)
    return h


def test_seed_loss_is_equations_9_and_10(wiki_samples, vocab):
    head, batch = build("seed", wiki_samples, vocab)
    window = head.options.decoder_window
    assert (window, len(head.decoder.layers)) == (2, 3)  # §4.1: span k = 2, three layers (the tiny config keeps them)
    ids, mask = batch["dec_input_ids"], batch["attention_mask"]
    unmasked = torch.where(batch["mlm_labels"] != -100, batch["mlm_labels"], batch["input_ids"])
    assert torch.equal(ids, unmasked)  # eq. 9 reconstructs x itself, not the masked input
    assert torch.equal(batch["dec_labels"], next_token_targets(ids, mask))
    with torch.no_grad():
        out = head(batch)
        h = bert_states(head.encoder, batch["input_ids"], mask)  # one pass over the masked text serves both terms
        mlm = mean_token_nll(head.encoder, h, batch["mlm_labels"])
        visible = seed_visibility(mask.sum(dim=1), ids.shape[1], window)
        dec = decoder_loss_by_equations(head, h[:, 0], ids, mask, visible)
    assert out["mlm"].item() == pytest.approx(mlm.item(), abs=1e-10)
    assert out["dec"].item() == pytest.approx(dec.item(), abs=1e-10)
    assert out["loss"].item() == pytest.approx((mlm + dec).item(), abs=1e-10)  # eq. 10


@pytest.mark.parametrize("method", ["cotmae", "cotmote"])
def test_context_decoder_loss_is_equations_10_to_12(method, wiki_samples, vocab):
    head, batch = build(method, wiki_samples, vocab, decoder_objective="clm", decoder_layers=1)
    ids, mask = batch["ctx_input_ids"], batch["ctx_attention_mask"]
    assert not batch["ctx_from_self"].all()  # the decoder does see neighbour blocks here
    assert torch.equal(batch["ctx_labels"], next_token_targets(ids, mask))
    with torch.no_grad():
        out = head(batch)
        h = bert_states(head.encoder, batch["input_ids"], batch["attention_mask"])  # eq. 10: the masked anchor
        mlm = mean_token_nll(head.encoder, h, batch["mlm_labels"])  # eq. 11
        dec = decoder_loss_by_equations(head, h[:, 0], ids, mask, causal_visibility(mask.sum(dim=1), ids.shape[1]))
    assert out["mlm"].item() == pytest.approx(mlm.item(), abs=1e-10)
    assert out["dec"].item() == pytest.approx(dec.item(), abs=1e-10)  # eq. 12
    assert out["loss"].item() == pytest.approx((mlm + dec).item(), abs=1e-10)


def test_mote_encoder_is_equations_7_to_9(wiki_samples, vocab):
    head, batch = build("cotmote", wiki_samples, vocab, decoder_objective="clm")
    encoder = head.encoder
    batch["text_type"] = torch.tensor([1, 0, 1, 0])
    torch.manual_seed(0)
    with torch.no_grad():
        for p in encoder.query_experts.parameters():  # the experts start as copies: make a swap visible
            p.add_(0.05 * torch.randn_like(p))
        ids, mask = batch["input_ids"], batch["attention_mask"]
        out = head(batch)
        got = encoder(ids, mask, batch["text_type"])
        h = mote_states(encoder, ids, mask, batch["text_type"])
        mlm = mean_token_nll(encoder, h, batch["mlm_labels"])
        ctx, ctx_mask = batch["ctx_input_ids"], batch["ctx_attention_mask"]
        dec = decoder_loss_by_equations(head, h[:, 0], ctx, ctx_mask,
                                        causal_visibility(ctx_mask.sum(dim=1), ctx.shape[1]))
        passages_only = mote_states(encoder, ids, mask, torch.zeros(4, dtype=torch.long))
    valid = mask.bool()
    torch.testing.assert_close(got[valid], h[valid], rtol=0, atol=1e-10)
    assert out["mlm"].item() == pytest.approx(mlm.item(), abs=1e-10)
    assert out["dec"].item() == pytest.approx(dec.item(), abs=1e-10)
    # the query rows really went through the other expert, the passage rows did not
    assert (passages_only[0][valid[0]] - h[0][valid[0]]).abs().max() > 1e-3
    torch.testing.assert_close(passages_only[1][valid[1]], h[1][valid[1]], rtol=0, atol=1e-10)


@pytest.mark.parametrize("method,layers,window", [("seed", 1, 2), ("seed", 3, 2), ("seed", 2, 3), ("cotmae", 1, None)])
def test_decoder_reads_only_its_span(method, layers, window, wiki_samples, vocab):
    """Perturb one input token (or h_0) per row and see which of the head's own decoder states move: with
    span k, the state predicting x_t reads x_{t-k..t-1} in each layer, so after L layers x_{t-L(k-1)-1..t-1}
    (eq. 9 exactly for L = 1); CoT-MAE's reads every earlier token (eq. 12). h_0 reaches every position."""
    overrides = {"decoder_layers": layers, "decoder_objective": "clm"} if window is None \
        else {"decoder_layers": layers, "decoder_window": window}
    head, batch = build(method, wiki_samples, vocab, **overrides)
    reach = None if window is None else layers * (window - 1)
    n = 14
    ids = batch["input_ids"][:1, :n].repeat(n + 1, 1)  # row j perturbs the token at position j; row 0 none
    for j in range(1, n):
        ids[j, j] = (ids[j, j] + 1000) % head.encoder.config.vocab_size
    torch.manual_seed(0)
    h0 = torch.randn(1, head.encoder.config.hidden_size, dtype=torch.float64).repeat(n + 1, 1)
    h0[n] += 1.0  # the last row perturbs h_0
    states = []
    hook = head.decoder.layers[-1].register_forward_hook(lambda module, args, output: states.append(output))
    with torch.no_grad():
        head.decoder.loss(head.encoder, h0, ids, torch.ones_like(ids), torch.full_like(ids, -100))
    hook.remove()
    moved = (states[0] - states[0][:1]).abs().amax(dim=-1) > 1e-9  # [row, position]
    for j in range(1, n):
        for i in range(n):
            assert bool(moved[j, i]) == (j <= i and (reach is None or i - j <= reach)), (j, i)
    assert moved[n].all()
