"""CoT-MAE as the released code (caskcsg/ir `cotmae/`) trains it: the objective written out in plain torch
(tests/paper_math.py) against the head, loss terms and gradients; the pairs and contexts its collator makes; the
options; a few engine steps and the export."""

import json
from collections import Counter
from itertools import islice

import pytest
import torch

from paper_math import bert_layer, bert_states, embed, hf_layer_weights, key_padding, mean_token_nll
from pretrieve.data.cotmae import KIND_IDS, CoTMAECollator, CoTMoTECollator
from pretrieve.data.stream import ShardStream
from pretrieve.models.heads import get_method
from test_equations_causal import build

pytestmark = pytest.mark.system


def unmasked(batch: dict, row: int, ids="input_ids", labels="mlm_labels", mask="attention_mask") -> list[int]:
    """A row's original text without [CLS] and [SEP]: the label where masked, else the input."""
    text = torch.where(batch[labels][row] != -100, batch[labels][row], batch[ids][row])
    return text[1:int(batch[mask][row].sum()) - 1].tolist()


def jsonl_samples(tmp_path, docs: list[dict]) -> dict[str, dict]:
    """The stream samples of `docs` (JSON-lines records, text in `contents`) after `prepare`, by document id."""
    from pretrieve.data.prepare import prepare
    from pretrieve.data.prepare_options import PrepareOptions

    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    prepare(PrepareOptions(source="jsonl", inputs=[str(src)], out=str(tmp_path / "shards"), workers=0,
                           text_field="contents", progress=False))
    return {s["doc"]: s for s in ShardStream([tmp_path / "shards" / "manifest.json"], shuffle_buffer=1)}


def written_out(head, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_enc, L_head) of the released BertForCotMAE: the MLM loss over every encoded row, and the decoder's:
    row r's last-layer [CLS] state, then the embeddings of the decoder's input after its [CLS], through the
    decoder's BERT layers over the unpadded keys, into the encoder's own MLM head; each a mean over its targets."""
    encoder = head.encoder
    h = bert_states(encoder, batch["input_ids"], batch["attention_mask"])
    l_enc = mean_token_nll(encoder, h, batch["mlm_labels"])
    x = torch.cat([h[:, :1], embed(encoder, batch["dec_input_ids"])[:, 1:]], dim=1)
    visible = key_padding(batch["dec_attention_mask"])
    for layer in head.decoder.layers:
        x = bert_layer(x, x, visible, encoder.config.num_attention_heads, hf_layer_weights(layer))
    return l_enc, mean_token_nll(encoder, x, batch["dec_labels"])


def test_released_objective_loss_and_gradients_are_written_out(wiki_samples, vocab):
    head, batch = build("cotmae", wiki_samples, vocab)
    assert (head.options.decoder_objective, len(head.decoder.layers)) == ("mlm", 2)  # the released recipe
    assert {name.split(".")[0] for name, _ in head.named_parameters()} == {"encoder", "decoder"}  # one MLM head
    rows = batch["input_ids"].shape[0]
    assert rows == 8  # 4 anchors and their 4 contexts, [a0, c0, a1, c1, ...]
    for r in range(rows):  # row r's decoder reads its partner's text, masked anew
        partner = r ^ 1
        assert unmasked(batch, r, "dec_input_ids", "dec_labels", "dec_attention_mask") == unmasked(batch, partner)
        assert torch.equal(batch["dec_attention_mask"][r], batch["attention_mask"][partner])
    assert not torch.equal(batch["dec_labels"] != -100, (batch["mlm_labels"] != -100)[torch.arange(rows) ^ 1])
    out = head(batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    l_enc, l_dec = written_out(head, batch)
    (l_enc + l_dec).backward()
    assert out["mlm"].item() == pytest.approx(l_enc.item(), abs=1e-10)
    assert out["dec"].item() == pytest.approx(l_dec.item(), abs=1e-10)
    assert out["loss"].item() == pytest.approx((l_enc + l_dec).item(), abs=1e-10)  # L = L_enc + L_head
    expected = {n: p.grad for n, p in head.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and len(grads) > 30
    assert any(n.startswith("decoder.layers.1.") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-8, atol=1e-12, msg=name)


def test_decoder_masks_follow_the_released_ratios(wiki_samples, vocab):
    batch = CoTMAECollator(vocab, seed=0)(wiki_samples[:32])
    tokens = batch["attention_mask"].sum() - 2 * len(batch["attention_mask"])
    enc = (batch["mlm_labels"] != -100).sum() / tokens
    dec = (batch["dec_labels"] != -100).sum() / tokens
    assert 0.27 < enc < 0.31 and 0.42 < dec < 0.46, (enc, dec)  # max(1, round(ratio x tokens)) a text


@pytest.fixture(scope="module")
def documents(wiki_shards) -> dict:
    """(shard, source, doc) -> {block: its ids}: a document's blocks as one shard holds them."""
    found = {}
    for s in ShardStream([wiki_shards / "manifest.json"], shuffle_buffer=1):
        found.setdefault((s["shard"], s["source"], s["doc"]), {})[s["block"]] = list(s["ids"])
    return found


def contexts(samples, vocab, context: str, epoch: int) -> list[tuple[list[int], list[int], int]]:
    """(anchor, context, kind id) of each sample, collated in `epoch` (another epoch draws anew)."""
    batch = CoTMAECollator(vocab, seed=3, context=context)([{**s, "epoch": epoch} for s in samples])
    return [(unmasked(batch, 2 * i), unmasked(batch, 2 * i + 1), int(batch["ctx_kind"][i]))
            for i in range(len(samples))]


def test_contexts_are_the_three_released_kinds_each_fixed_per_anchor(wiki_shards, documents, vocab):
    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=1, shuffle_buffer=64)), 24))
    room = 126
    seen = {kind: {} for kind in ("random", "neighbour", "overlap")}
    for kind in seen:
        for epoch in range(3):
            for sample, (anchor, context, kind_id) in zip(samples, contexts(samples, vocab, kind, epoch)):
                assert kind_id == KIND_IDS[kind] and anchor == list(sample["ids"][:room])
                seen[kind].setdefault(sample["index"] + 1000 * sample["shard"], set()).add(tuple(context))
    for kind, by_anchor in seen.items():  # the same context for an anchor in every epoch
        assert all(len(found) == 1 for found in by_anchor.values()), kind
    for sample in samples:
        key = sample["index"] + 1000 * sample["shard"]
        doc = documents[(sample["shard"], sample["source"], sample["doc"])]
        own, block = list(sample["ids"][:room]), sample["block"]
        (near,), (rand,), (over,) = (seen[k][key] for k in ("neighbour", "random", "overlap"))
        if len(doc) == 1:  # a one-block document: its halves (test_a_one_block_document_never_decodes_itself)
            continue
        assert list(near) in [doc[b][:room] for b in (block - 1, block + 1) if b in doc]
        assert list(rand) in [doc[b][:room] for b in doc if b != block]
        after = sum((doc[b] for b in sorted(doc) if b > block), [])
        before = sum((doc[b] for b in sorted(doc) if b < block), [])
        if after:  # the anchor's end, then the text after it
            made = [own[-k:] + after[:room - k] for k in range(1, len(own) // 2 + 1)]
        else:  # the document's last block: the text before it, then the anchor's start
            made = [before[-(room - k):] + own[:k] for k in range(1, len(own) // 2 + 1)]
        assert list(over) in made, sample["doc"]

    kinds = Counter(kind for epoch in range(12) for *_, kind in contexts(samples, vocab, "mixed", epoch))
    assert set(kinds) == {0, 1, 2} and all(70 < n < 125 for n in kinds.values()), kinds  # 1/3 of 288 each


def test_a_one_block_document_never_decodes_itself(tmp_path, vocab):
    samples = jsonl_samples(tmp_path, [{"id": "short", "contents": "A single block about the moon and the tides."},
                                       {"id": "one", "contents": "moon"}])
    ids = list(samples["short"]["ids"])
    halves = {tuple(ids[:(len(ids) + 1) // 2]), tuple(ids[(len(ids) + 1) // 2:])}
    anchors = set()
    for epoch in range(4):
        for kind in ("mixed", "random", "neighbour", "overlap"):
            batch = CoTMAECollator(vocab, context=kind)([{**samples["short"], "epoch": epoch}, samples["one"]])
            anchor, context = tuple(unmasked(batch, 0)), tuple(unmasked(batch, 1))
            assert anchor in halves and anchor != context and set(context) - set(anchor)
            anchors.add(anchor)
            assert batch["ctx_kind"].tolist()[1] == KIND_IDS["self"]  # one token: nothing else to decode
    assert len(anchors) == 1  # the anchor's half is fixed


def test_cotmote_routes_decoded_pseudo_queries_through_the_query_experts(tmp_path, vocab):
    samples = jsonl_samples(tmp_path, [
        {"id": "d1", "contents": "A passage about tides. The moon pulls the sea.", "queries": ["what causes tides"]},
        {"id": "d2", "contents": "Another passage without any queries at all."}])
    batch = CoTMoTECollator(vocab)([samples["d1"], samples["d2"]])
    assert batch["ctx_kind"].tolist()[0] == KIND_IDS["query"] and batch["ctx_kind"].tolist()[1] != KIND_IDS["query"]
    assert batch["text_type"].tolist() == [0, 1, 0, 0]  # d1, its query, d2, its other half
    assert unmasked(batch, 1) == samples["d1"]["queries"][0]


def test_options_say_what_each_objective_reads():
    method = get_method("cotmae")
    released = method.options_from({})
    assert (released.max_len, released.decoder_layers, released.mlm_ratio, released.decoder_mask_ratio,
            released.context) == (128, 2, 0.30, 0.45, "mixed")
    assert method.options_from({"decoder_objective": "clm"}).decoder_mask_ratio is None
    with pytest.raises(Exception, match="method.decoder_mask_ratio: decoder_objective clm"):
        method.options_from({"decoder_objective": "clm", "decoder_mask_ratio": 0.5})
    with pytest.raises(Exception, match="method.decoder_objective: 'causal' is not one of mlm, clm"):
        method.options_from({"decoder_objective": "causal"})
    assert (get_method("cotmote").options_from({}).context, get_method("cotmote").options_from({}).max_len) == \
        ("auto", 144)


def test_engine_trains_the_released_objective_and_its_export_loads(tmp_path, wiki_shards):
    """Three optimizer steps under DeepSpeed (ZeRO 2) of cotmae and cotmote, then the export: the encoder in
    AutoModel, and the whole head (its 2 decoder layers, CoT-MoTE's query experts) in load_export."""
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModel

    from support import json_lines, pretrain_env
    from pretrieve.models.export import load_export

    script = Path(__file__).resolve().parent / "one_step.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(wiki_shards / "manifest.json"),
                           "cotmae,cotmote", "2"], env=pretrain_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json_lines(done.stdout)
    assert [r["method"] for r in records] == ["cotmae", "cotmote"]
    for record in records:
        assert record["step"] == 3 and record["finite"] and record["changed"] == record["trainable"] > 0, record
        export = tmp_path / f"{record['method']}-zero2" / "export"
        AutoModel.from_pretrained(export)
        head = load_export(export)
        assert head.options.decoder_objective == "mlm" and len(head.decoder.layers) == 2
        assert (head.encoder.query_experts is not None) == (record["method"] == "cotmote")


def test_an_export_from_before_the_option_continues_with_the_clm_decoder(tmp_path):
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export, load_export
    from pretrieve.models.heads.decoder import CausalDecoder

    method = get_method("cotmae")
    options = method.options_from({"decoder_objective": "clm", "decoder_layers": 1, "max_len": 64})
    out = export(method.build(options, ModelOptions(hidden_size=32, num_layers=1, num_heads=2,
                                                    intermediate_size=64)), tmp_path / "export")
    meta_path = out / "pretrieve_head.json"
    meta = json.loads(meta_path.read_text())
    del meta["options"]["decoder_objective"], meta["options"]["decoder_mask_ratio"]  # as such exports were
    meta_path.write_text(json.dumps(meta))
    head = load_export(out)
    assert head.options.decoder_objective == "clm" and isinstance(head.decoder, CausalDecoder)
