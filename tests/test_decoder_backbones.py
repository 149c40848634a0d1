"""Decoder LLM families as encoders (backbones/causal_lm.py): Llama, Qwen2, Qwen3 and Mistral on tiny random
configs. Causal attention by default and both ways under model.bidirectional, padding hidden either way; last-token
pooling under right and left padding; the heads that refuse them, naming the key; a contrastive pre-training
run of a tiny Qwen3 through `pretrieve pretrain`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import SAMPLES, adamw_steps, pretrain_env
from pretrieve.config import ConfigError, load_config
from pretrieve.models.dense_pooling import last_token_pooling, mean_pooling
from pretrieve.models.encoder import Encoder, ModelOptions
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def tiny(backbone: str, bidirectional: bool = False) -> Encoder:
    torch.manual_seed(0)
    options = ModelOptions(backbone=backbone, vocab_size=100, hidden_size=32, num_layers=2, num_heads=2,
                           intermediate_size=64, pad_token_id=0, dropout=0.0, bidirectional=bidirectional)
    return Encoder.build(options).eval()


@pytest.mark.parametrize("backbone", FAMILIES)
def test_causal_by_default_and_both_ways_when_bidirectional(backbone):
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    later = ids.clone()
    later[:, 6] = later[:, 6] % 99 + 1  # another token at position 6
    for bidirectional in (False, True):
        encoder = tiny(backbone, bidirectional)
        assert encoder.backbone.causal and encoder.config.bidirectional == bidirectional
        with torch.no_grad():
            before, after = encoder(ids, mask), encoder(later, mask)
        # causal: positions 0-5 have not seen position 6; bidirectional: they have
        assert torch.equal(before[:, :6], after[:, :6]) != bidirectional


@pytest.mark.parametrize("backbone", FAMILIES)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_padding_is_hidden_and_last_token_pooling_finds_each_texts_end(backbone, bidirectional):
    """A 5-token text alone, right-padded to 8 and left-padded to 8: the same states at its tokens, and last-token
    pooling gives its own last token's state (not a pad's) either way, mean pooling the mean of its own."""
    encoder = tiny(backbone, bidirectional)
    text = torch.tensor([[11, 12, 13, 14, 15]])
    with torch.no_grad():
        alone = encoder(text, torch.ones_like(text))
        right_ids, right_mask = torch.tensor([[11, 12, 13, 14, 15, 0, 0, 0]]), torch.tensor([[1] * 5 + [0] * 3])
        left_ids, left_mask = torch.tensor([[0, 0, 0, 11, 12, 13, 14, 15]]), torch.tensor([[0] * 3 + [1] * 5])
        right, left = encoder(right_ids, right_mask), encoder(left_ids, left_mask)
    torch.testing.assert_close(right[:, :5], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(left[:, 3:], alone, rtol=1e-5, atol=1e-5)
    both = torch.cat([right, left])
    pooled = last_token_pooling(both, torch.cat([right_mask, left_mask]))
    torch.testing.assert_close(pooled, alone[:, -1].expand(2, -1), rtol=1e-5, atol=1e-5)
    averaged = mean_pooling(both, torch.cat([right_mask, left_mask]))
    torch.testing.assert_close(averaged, alone.mean(dim=1).expand(2, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backbone", FAMILIES)
def test_init_from_a_released_checkpoint_of_each_family_computes_what_it_computed(backbone, tmp_path):
    """A checkpoint as the family's models are released (its *ForCausalLM with the LM head, tied or not, and a
    bos/eos the new configs leave out): `init_from` takes its base model and its LM head (nothing missing or
    left unused), the encoder's states under padding equal HF's own model's on the unpadded text, and its token
    logits the *ForCausalLM's."""
    from transformers import AutoModel, AutoModelForCausalLM

    config = tiny(backbone).config.to_dict()
    config.update(bos_token_id=1, eos_token_id=2, tie_word_embeddings=backbone != "mistral", bidirectional=False)
    for key in ("architectures", "transformers_version"):
        config.pop(key, None)
    released = AutoModelForCausalLM.from_config(type(tiny(backbone).config)(**config))
    released.save_pretrained(tmp_path / "released")
    encoder = Encoder.from_pretrained(tmp_path / "released").eval()
    assert encoder.backbone.name == backbone and not encoder.config.bidirectional
    text = torch.tensor([[5, 17, 42, 8, 99, 3]])
    padded, mask = torch.tensor([[5, 17, 42, 8, 99, 3, 0, 0]]), torch.tensor([[1] * 6 + [0] * 2])
    assert encoder.load_report == [] and (encoder.lm_head is None) == (backbone != "mistral")
    with torch.no_grad():
        ours = encoder(padded, mask)[:, :6]
        theirs = AutoModel.from_pretrained(tmp_path / "released").eval()(input_ids=text).last_hidden_state
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "released").eval()(input_ids=text).logits
        torch.testing.assert_close(encoder.mlm_logits(ours), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_init_from_reports_what_a_checkpoint_lacks_and_what_it_holds_unused(tmp_path):
    """A sequence-classification checkpoint (its `score` head, no LM head) of an untied Llama: the load report
    names the LM head it lacks (initialised) and the score head nothing takes (not used)."""
    from transformers import AutoModelForSequenceClassification

    config = tiny("llama").config
    config.tie_word_embeddings = False
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "scorer")
    encoder = Encoder.from_pretrained(tmp_path / "scorer")
    assert encoder.load_report == [f"MLM head (lm_head.weight): not in {tmp_path / 'scorer'}, initialised",
                                   f"score.weight: in {tmp_path / 'scorer'}, not used"]


def _experiment(config: str, *overrides: str):
    return experiment(load_config(CONFIGS / config, ["data.manifests=[]", "data.tokenizer=null", *overrides]))


@pytest.mark.parametrize("config,overrides,says", [
    *[(f"tiny-{method}.yaml", [f"model.backbone={family}"],
       rf"model.backbone: {family} is a decoder LLM; method {method} needs an encoder family")
      for method, family in (("retromae", "qwen3"), ("dupmae", "llama"), ("seed", "mistral"), ("costa", "qwen3"),
                             ("cotmae", "llama"), ("cotmote", "mistral"))],
    ("tiny-mlm.yaml", ["model.backbone=llama"],
     r"model.backbone: llama is a causal decoder LLM; method mlm predicts from both sides: set "
     r"model.bidirectional: true"),
    ("tiny-mntp.yaml", ["model.bidirectional=false"],
     r"model.backbone: qwen3 is a causal decoder LLM; method mntp predicts from both sides"),
    ("tiny-llama2vec.yaml", ["model.backbone=bert", "model.vocab_size=30522"],
     r"model.backbone: bert is an encoder family; method llama2vec adapts a decoder LLM"),
    ("tiny-llama2vec.yaml", ["model.bidirectional=true"],
     r"model.bidirectional: method llama2vec trains the LLM causal, as it was pre-trained"),
    ("tiny-contrastive.yaml", ["model.bidirectional=true"],
     r"model.bidirectional: the BERT backbone attends both ways already"),
    ("tiny-contrastive.yaml", ["model.backbone=qwen3", "method.pooling=cls"],
     r"method.pooling: cls on a causal Qwen3 is its first token's state, which sees nothing of the text"),
])
def test_heads_that_cannot_train_a_decoder_llm_refuse_it_naming_the_key(config, overrides, says):
    with pytest.raises(ConfigError, match=says):
        _experiment(config, *overrides)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_contrastive_head_on_a_tiny_qwen3_reaches_every_weight_and_learns(vocab, bidirectional):
    """InfoNCE with last-token pooling on a fixed batch of 6 pairs: every weight of the model gets a gradient,
    and 8 AdamW steps lower the loss."""
    from test_contrastive import pair_samples, tiny_contrastive

    method, options, model = tiny_contrastive(pooling="last")
    model.backbone, model.bidirectional, model.pad_token_id = "qwen3", bidirectional, 0
    head = method.build(options, model, seed=0)
    batch = method.collator.from_options(options, vocab)(pair_samples(6))
    head.train()
    losses = adamw_steps(head, batch, steps=8, lr=1e-3)
    assert all(p.grad.abs().sum() > 0 for p in head.encoder.model.parameters())  # the last step's, none zero
    assert losses[-1] < losses[0], losses


def test_a_tiny_qwen3_pretrains_contrastively_with_last_token_pooling(tmp_path):
    """`pretrieve pretrain` of tiny-contrastive.yaml on model.backbone=qwen3, pooling last: it trains and exports
    a Qwen3 model whose config records causal attention, and whose sentence-transformers files pool the last
    token."""
    from pretrieve.data.prepare import prepare
    from pretrieve.data.prepare_options import PrepareOptions

    shards = tmp_path / "pairs"
    prepare(PrepareOptions(source="beir", inputs=[str(SAMPLES / "beir" / "scifact-sample")], out=str(shards),
                           pairs=True, qrels_split="test", workers=0))
    done = subprocess.run([sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-contrastive.yaml"),
                           f"run_dir={tmp_path / 'run'}", f"data.manifests=[{shards / 'manifest.json'}]",
                           "model.backbone=qwen3", "method.pooling=last", "train.max_steps=4", "train.log_every=1",
                           "train.micro_batch_size=8", "tracking.enabled=false"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    export = tmp_path / "run" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["bidirectional"] is False
    assert json.loads((export / "1_Pooling" / "config.json").read_text())["pooling_mode_lasttoken"] is True


def test_mntp_predicts_each_masked_token_from_the_state_before_it(vocab):
    """LLM2Vec's loss by hand on a tiny bidirectional Qwen3: for each masked position i, the cross-entropy of
    its token under softmax(h_{i-1} E^T), averaged over the masked positions."""
    from pretrieve.models.heads import get_method

    method = get_method("mntp")
    options = method.options_from({"max_len": 32})
    model = ModelOptions(backbone="qwen3", bidirectional=True, vocab_size=vocab.size, hidden_size=32, num_layers=2,
                         num_heads=2, intermediate_size=64, pad_token_id=0, dropout=0.0)
    head = method.build(options, model, seed=0).eval()
    rng = torch.Generator().manual_seed(3)
    samples = [{"ids": torch.randint(1000, 5000, (n,), generator=rng).numpy()} for n in (20, 13, 30)]
    batch = method.collator.from_options(options, vocab, seed=0)(samples)
    labels = batch["mlm_labels"]
    assert (labels[:, 0] == -100).all() and (labels != -100).sum() > 3
    with torch.no_grad():
        loss = head(batch)["loss"]
        hidden = head.encoder(batch["input_ids"], batch["attention_mask"])
        weight = head.encoder.word_embeddings.weight  # the LM head: tied, no bias
        assert head.encoder.lm_head is None and head.encoder.mlm_bias is None
        terms = [torch.log_softmax(hidden[b, i - 1] @ weight.T, -1)[labels[b, i]].neg()
                 for b, i in (labels != -100).nonzero().tolist()]
    torch.testing.assert_close(loss, torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)
    # not BERT's MLM, which reads the state at i itself
    assert not torch.allclose(loss, head.encoder.token_loss(hidden, labels), rtol=1e-3)
