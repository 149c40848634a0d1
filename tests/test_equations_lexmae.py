"""LexMAE (Shen et al., ICLR 2023; no equation numbers: the paper's method section was not available, the loss is
the released code's, docs/methods.md "lexmae"), each part against a hand computation: the two maskings, the
lexicon-importance distribution (softmax and saturated), the bottleneck without a gradient into the word
embeddings, the decoder run as the released code runs it (HF BertLayers, HF's attention mask, its own MLM head), the
losses and every gradient, the export, and a resumed DeepSpeed run repeating the uninterrupted one."""

import pytest
import torch
import torch.nn.functional as F

from support import (TINY_CONFIGS, assert_resumed_run_repeats, collated_with_a_pad_sample, exported_after_a_step,
                      pretrain_stopped_and_resumed, tiny_head)

pytestmark = pytest.mark.system


def tiny_lexmae(*overrides):
    return tiny_head("lexmae", *overrides)


def test_the_two_maskings_and_the_targets(vocab, wiki_samples):
    method, options, _ = tiny_lexmae()
    batch, ids = collated_with_a_pad_sample(method, options, vocab, wiki_samples)
    masked, dec_masked = batch["mlm_labels"] != -100, batch["dec_labels"] != -100
    # labels: the original token at each masked position; elsewhere the text is untouched
    assert torch.equal(batch["mlm_labels"][masked], ids[masked])
    assert torch.equal(batch["dec_labels"][dec_masked], ids[dec_masked])
    assert torch.equal(batch["input_ids"][~masked], ids[~masked])
    assert torch.equal(batch["dec_input_ids"][~dec_masked], ids[~dec_masked])
    assert not (masked & ~dec_masked).any()  # the decoder's mask covers the encoder's
    assert not masked[-1].any() and not dec_masked[-1].any()  # the stream's pad sample: no targets
    lengths = batch["attention_mask"].sum(dim=1, keepdim=True)
    position = torch.arange(ids.shape[1])[None]
    tokens = ((position >= 1) & (position < lengths - 1))[:-1].sum().item()
    assert masked.sum().item() / tokens == pytest.approx(0.30, abs=0.02)
    assert dec_masked.sum().item() / tokens == pytest.approx(0.50, abs=0.03)
    # 80/10/10 on each side, the decoder's drawn anew: [MASK] at ~80 % of its masked positions, not the encoder's
    dec_mask_token = batch["dec_input_ids"][dec_masked] == vocab.mask_id
    assert dec_mask_token.double().mean().item() == pytest.approx(0.8, abs=0.04)
    both = masked & dec_masked
    assert not torch.equal(batch["input_ids"][both] == vocab.mask_id, batch["dec_input_ids"][both] == vocab.mask_id)


def hand_losses(head, batch, vocab, importance="softmax"):
    """(L_enc, L_dec, p) written out: the full [B, L, vocab] logits, the max over the text's tokens (the released
    text_part_mask: not [CLS], not [SEP], not padding), p, b = p E.detach(), the decoder as HF's BertLayer with
    transformers' extended attention mask, then the decoder's own MLM head."""
    from transformers.models.bert.modeling_bert import BertLayer

    encoder, mask = head.encoder, batch["attention_mask"]
    hidden = encoder(batch["input_ids"], mask)
    logits = encoder.mlm_logits(hidden)
    masked = batch["mlm_labels"] != -100
    enc = F.cross_entropy(logits[masked], batch["mlm_labels"][masked])
    ids = batch["input_ids"]
    text = mask.bool() & (ids != vocab.cls_id) & (ids != vocab.sep_id)
    pooled = logits.masked_fill(~text[..., None], float("-inf")).amax(dim=1)
    if importance == "softmax":
        p = torch.softmax(pooled, dim=-1)
    else:
        saturated = torch.log(torch.relu(pooled) + 1.0)
        p = saturated / (saturated.sum(dim=-1, keepdim=True) + 1e-4)
    bottleneck = p @ encoder.word_embeddings.weight.detach()
    h = torch.cat([bottleneck[:, None], encoder.embeddings(input_ids=batch["dec_input_ids"])[:, 1:]], dim=1)
    extended = (1.0 - mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
    layer = BertLayer(encoder.config).to(h.dtype).eval()
    for ours in head.decoder.layers:  # HF's layer on the decoder's own weights: their gradients are the hand's
        h = torch.func.functional_call(layer, dict(ours.named_parameters()), (h,), {"attention_mask": extended})
        h = h[0] if isinstance(h, tuple) else h
    dec_logits = F.linear(head.decoder_mlm_transform(h), encoder.word_embeddings.weight, head.decoder_mlm_bias)
    dec_masked = batch["dec_labels"] != -100
    dec = F.cross_entropy(dec_logits[dec_masked], batch["dec_labels"][dec_masked])
    return enc, dec, p


@pytest.mark.parametrize("importance", ["softmax", "saturated"])
def test_loss_and_gradients_by_hand(vocab, wiki_samples, importance):
    """The losses and every parameter's gradient equal the hand computation's (float64), whose bottleneck takes no
    gradient into the word embeddings; the decoder's MLM head is its own (a bias the encoder's head lacks)."""
    method, options, head = tiny_lexmae(f"method.importance={importance}", "method.dec_weight=0.5")
    head = head.double().eval()
    with torch.no_grad():
        head.decoder_mlm_bias.normal_(0.0, 0.5)
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    out = head(batch)
    out["loss"].backward()
    ours = {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    enc, dec, p = hand_losses(head, batch, vocab, importance)
    (enc + 0.5 * dec).backward()
    theirs = {name: p.grad for name, p in head.named_parameters() if p.grad is not None}
    assert out["enc"].item() == pytest.approx(enc.item(), rel=1e-10)
    assert out["dec"].item() == pytest.approx(dec.item(), rel=1e-10)
    assert out["loss"].item() == pytest.approx(enc.item() + 0.5 * dec.item(), rel=1e-10)
    entropy = -(p * torch.log(p.clamp(min=1e-30))).sum(dim=-1).mean()
    assert out["entropy"].item() == pytest.approx(entropy.item(), rel=1e-9)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-7, atol=1e-12, msg=name)
    assert ours["decoder_mlm_transform.dense.weight"].abs().sum() > 0


def test_the_bottleneck_is_all_the_decoder_learns_of_the_encoder(vocab, wiki_samples):
    """With the encoder's MLM head pushed to one word everywhere, p puts all its mass there and the bottleneck
    is that word's embedding: the decoder's loss no longer depends on the encoder's input, and changes with the
    word."""
    method, options, head = tiny_lexmae()
    head = head.double().eval()
    word = vocab.tokens.index("the")
    with torch.no_grad():
        head.encoder.mlm_bias[word] = 1e4
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    p = head.lexicon_importance(head.encoder(batch["input_ids"], batch["attention_mask"]), batch["attention_mask"])
    assert torch.allclose(p[:, word], torch.ones(4, dtype=p.dtype))
    other = {**batch, "input_ids": batch["input_ids"].flip(0)}  # each decoder text gets another text's encoding
    with torch.no_grad():
        assert head(other)["dec"].item() == pytest.approx(head(batch)["dec"].item(), rel=1e-9)
        the = head(batch)["dec"].item()
        head.encoder.mlm_bias[word] = 0.0
        head.encoder.mlm_bias[vocab.tokens.index("of")] = 1e4  # another word's embedding: another decoder loss
        assert head(batch)["dec"].item() != pytest.approx(the, rel=1e-12)  # small weights: a small change (~1e-7)


def test_the_export_is_an_hf_encoder_and_keeps_the_decoder(vocab, wiki_samples, tmp_path):
    """After a step: the export loads in transformers' AutoModel as the encoder, and as a head again (further
    pre-training) with every weight, the decoder's layers and its MLM head included."""
    method, options, head = tiny_lexmae()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    again = exported_after_a_step(head, batch, tmp_path / "export")
    assert any(k.startswith("decoder.layers.") for k in again) and "decoder_mlm_bias" in again
    assert any(k.startswith("decoder_mlm_transform.") for k in again)


@pytest.mark.integration
def test_a_resumed_run_repeats_the_uninterrupted_one(tmp_path, wiki_shards):
    """`pretrieve pretrain` of tiny-lexmae at ZeRO 2, 4 steps; a run stopped at step 2 and resumed in a fresh
    process logs the uninterrupted run's losses bit for bit and exports the same weights, the head's included."""
    common = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
              "train.zero_stage=2", "checkpoint.every=2", "train.log_every=1", "train.max_steps=4",
              "tracking.enabled=false"]
    pretrain_stopped_and_resumed(TINY_CONFIGS / "tiny-lexmae.yaml", [f"run_dir={tmp_path / 'full'}", *common],
                                 [f"run_dir={tmp_path / 'split'}", *common, "train.stop_at=2"])
    assert_resumed_run_repeats(tmp_path, ("enc", "dec", "entropy"))


def test_an_export_evaluates_with_sparse_pooling(vocab, wiki_samples, tmp_path):
    """After a few steps, `pretrieve eval --pooling sparse` of the export on a part of the bundled SciFact sample:
    its ranking and scores are the SPLADE products written out, max over the tokens but [CLS] and [SEP] of
    log(1 + relu(MLM logits)) from the MLM head LexMAE trained (documents keeping their top 256 entries), and the
    export holds that head."""
    from support import SAMPLES, write_beir
    from pretrieve.data.retrieval import load_beir
    from pretrieve.eval.evaluate import EvalOptions, run_eval
    from pretrieve.eval.metrics import METRICS
    from pretrieve.models.export import export, load_export

    method, options, head = tiny_lexmae()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:8])
    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
    for _ in range(3):
        optimizer.zero_grad()
        head(batch)["loss"].backward()
        optimizer.step()
    model = export(head.eval(), tmp_path / "export")
    exported = load_export(model).encoder.eval()
    assert torch.equal(exported.mlm_bias, head.encoder.mlm_bias)
    assert torch.equal(exported.mlm_transform.dense.weight, head.encoder.mlm_transform.dense.weight)

    data = load_beir(SAMPLES / "beir" / "scifact-sample")
    query_ids = list(data.queries)[:5]  # and 40 documents: every text projects onto all 30,522 words
    doc_ids = sorted({d for q in query_ids for d in data.qrels[q]} | set(list(data.corpus)[:40]))
    mini = write_beir(tmp_path / "mini", data, query_ids, doc_ids)
    metrics = run_eval(EvalOptions(out=str(tmp_path / "sparse"), model=str(model), beir=str(mini), pooling="sparse",
                                   max_length=48, depth=10, progress=False))
    assert set(METRICS) <= set(metrics) and metrics["retriever"] == "sparse"
    run = {}
    for line in (tmp_path / "sparse" / "run.trec").read_text().splitlines():
        qid, _, doc, _, score, _ = line.split()
        run.setdefault(qid, []).append((doc, float(score)))

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))

    def splade(texts, keep=None):
        tokens = tokenizer(texts, truncation=True, max_length=48, padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = exported.mlm_logits(exported(tokens["input_ids"], tokens["attention_mask"]))
        ids = tokens["input_ids"]  # the released pooling leaves out [CLS] and [SEP] (`keep_special_tokens` off)
        text = tokens["attention_mask"] * (ids != tokenizer.cls_token_id) * (ids != tokenizer.sep_token_id)
        weights = (torch.log1p(torch.relu(logits)) * text[..., None]).amax(dim=1)
        if keep is not None:
            top = weights.topk(keep, dim=1)
            weights = torch.zeros_like(weights).scatter_(1, top.indices, top.values)
        return weights

    scores = splade([data.queries[q] for q in query_ids]) @ splade([data.doc_text(d) for d in doc_ids], 256).T
    for i, qid in enumerate(query_ids):
        ours = run[qid]
        expected = sorted(zip(doc_ids, scores[i].tolist()), key=lambda x: -x[1])[:10]
        assert len(ours) == 10 and [d for d, _ in ours] == [d for d, _ in expected]
        assert [s for _, s in ours] == pytest.approx([s for _, s in expected], rel=1e-4, abs=1e-4)
