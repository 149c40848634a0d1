"""SimLM (Wang et al., ACL 2023, §3.1 eqs. 1-2; where the paper leaves details open, the released code's,
docs/methods.md "simlm"), each part against a hand computation: the two maskings and the generator's draws of eq. 1
(from its own distribution, at the masked positions only), the encoder's and the decoder's token losses of eq. 2 at
every ordinary position and their sum L_pt, the decoder run as the released code runs it (the encoder's own last
layers, HF's attention mask), the generator frozen or trained, and a resumed DeepSpeed run at ZeRO 3 repeating the
uninterrupted one."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from support import (TINY_CONFIGS, assert_resumed_run_repeats, collated_with_a_pad_sample, exported_after_a_step,
                      pretrain_stopped_and_resumed, save_tiny_bert, tiny_head)
from pretrieve.engine.flops import forward_flops, train_flops
from pretrieve.models.flops import encoder_flops
from pretrieve.models.heads.simlm import generator_config

pytestmark = pytest.mark.system


def tiny_simlm(*overrides):
    return tiny_head("simlm", *overrides)


@pytest.fixture(scope="module")
def generator_dir(tmp_path_factory) -> Path:
    """A random tiny BERT (hidden 64) with the default tokenizer: a generator to load and freeze."""
    return save_tiny_bert(tmp_path_factory.mktemp("generator"), hidden=64, intermediate=128)


def test_the_two_maskings_and_the_targets(vocab, wiki_samples):
    """Eq. 1's Mask(x, p_enc) and Mask(x, p_dec) at 0.30 and 0.50 (§5.2, appendix B), the decoder's covering the
    encoder's (§3.1), all [MASK]; eq. 2's targets: the original token at every ordinary position (the paper's every
    position of x, less the special tokens, as the released labels)."""
    method, options, _ = tiny_simlm()
    batch, ids = collated_with_a_pad_sample(method, options, vocab, wiki_samples)
    masked, dec_masked = batch["mlm_labels"] != -100, batch["dec_masked"]
    # every masked position is [MASK] (no 80/10/10), every other keeps its token; the labels are the originals
    assert torch.equal(batch["input_ids"], torch.where(masked, vocab.mask_id, ids))
    assert torch.equal(batch["mlm_labels"][masked], ids[masked])
    assert torch.equal(batch["dec_input_ids"], torch.where(dec_masked, vocab.mask_id, ids))
    assert not (masked & ~dec_masked).any()  # the decoder's mask covers the encoder's
    lengths = batch["attention_mask"].sum(dim=1, keepdim=True)
    position = torch.arange(ids.shape[1])[None]
    ordinary = (position >= 1) & (position < lengths - 1) & ~torch.from_numpy(vocab.special)[ids]
    ordinary[-1] = False  # the stream's pad sample: no targets, nothing masked
    assert torch.equal(batch["rlm_labels"], torch.where(ordinary, ids, -100))
    assert not masked[-1].any() and not dec_masked[-1].any()
    tokens = ordinary[:-1].sum().item()
    assert masked[:-1].sum().item() / tokens == pytest.approx(0.30, abs=0.02)
    assert dec_masked[:-1].sum().item() / tokens == pytest.approx(0.50, abs=0.03)
    # a decoder ratio at or below the encoder's: the decoder is masked where the encoder is
    method, options, _ = tiny_simlm("method.decoder_mask_ratio=0.2")
    same = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:8])
    assert torch.equal(same["dec_masked"], same["mlm_labels"] != -100)


def nll(head, states, labels):
    """Mean over the labelled positions of -log softmax(MLM head)[original token], the full softmax written out."""
    log_p = torch.log_softmax(head.encoder.mlm_logits(states), dim=-1)
    picked = log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return -picked[labels != -100].mean()


def test_loss_by_hand(vocab, wiki_samples):
    """A generator that always says "the": both texts hold "the" at their masked positions (eq. 1), and the losses
    are eq. 2's L_enc and L_dec, summed as L_pt (§3.1) + 0.2 L_gen (the released weight of a trained generator), the
    decoder being the encoder's own last two BertLayers (the decoder's copies) run through HF's forward with its
    extended attention mask, as the released ReplaceLM runs its deep copies."""
    method, options, head = tiny_simlm()
    head = head.double().eval()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    the = vocab.tokens.index("the")
    with torch.no_grad():
        head.generator.mlm_bias[the] = 1e4
        out = head(batch)
        mask, labels = batch["attention_mask"], batch["rlm_labels"]
        masked = batch["mlm_labels"] != -100
        x_enc = torch.where(masked, the, batch["input_ids"])
        x_dec = torch.where(batch["dec_masked"], the, batch["dec_input_ids"])
        states = head.encoder(x_enc, mask)
        enc = nll(head, states, labels)
        h = torch.cat([states[:, :1], head.encoder.embeddings(input_ids=x_dec)[:, 1:]], dim=1)
        # the additive [B, 1, 1, L] mask of transformers 4's get_extended_attention_mask, which ReplaceLM calls
        extended = (1.0 - mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
        for layer in head.encoder.model.encoder.layer[-2:]:
            h = layer(h, attention_mask=extended)
            h = h[0] if isinstance(h, tuple) else h
        dec = nll(head, h, labels)
        g_logits = head.generator.mlm_logits(head.generator(batch["input_ids"], mask))
        gen = F.cross_entropy(g_logits[masked], batch["mlm_labels"][masked])
    assert out["enc"].item() == pytest.approx(enc.item(), rel=1e-10)
    assert out["dec"].item() == pytest.approx(dec.item(), rel=1e-10)
    assert out["gen"].item() == pytest.approx(gen.item(), rel=1e-10) and gen.item() > 100
    assert out["loss"].item() == pytest.approx(enc.item() + dec.item() + 0.2 * gen.item(), rel=1e-10)
    replaced = (batch["mlm_labels"][masked] != the).double().mean()
    assert out["replaced"].item() == pytest.approx(replaced.item()) and 0.8 < replaced.item() < 1.0


def test_the_draws_follow_the_generators_distribution(vocab, wiki_samples):
    """Eq. 1's Sample(g, .): two tokens with equal, overwhelming logits: every masked position gets one of them,
    each about half the time (the padding token, with a larger logit still, never); no other position changes.
    The draws are the batch's: its collator's seed fixes them, in training and eval mode alike, and torch's global
    random state is neither read nor moved."""
    method, options, head = tiny_simlm()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:16])
    a, b = vocab.tokens.index("the"), vocab.tokens.index("of")
    with torch.no_grad():
        head.generator.mlm_bias[[a, b]] = 1e4
        head.generator.mlm_bias[vocab.pad_id] = 1e5
    masked = batch["mlm_labels"] != -100
    with torch.no_grad():
        ids, _ = head.replace(batch["input_ids"], batch["attention_mask"], masked, torch.Generator().manual_seed(0))
    assert torch.equal(ids[~masked], batch["input_ids"][~masked])
    drawn = ids[masked]
    assert set(drawn.tolist()) == {a, b} and (drawn == a).double().mean().item() == pytest.approx(0.5, abs=0.1)

    def replaced(seed, train):
        head.train(train)
        torch.manual_seed(seed)  # the global state: read by nothing here
        state = torch.get_rng_state()
        with torch.no_grad():
            out = head(method.collator.from_options(options, vocab, seed=seed)(wiki_samples[:16]))
        assert torch.equal(torch.get_rng_state(), state)
        return out["replaced"].item()

    assert replaced(1, True) == replaced(1, False) != replaced(2, True)


def test_a_loaded_generator_is_frozen_and_a_new_one_learns(vocab, wiki_samples, generator_dir, tmp_path):
    """A loaded generator is frozen and the loss is L_pt = L_enc + L_dec, as §3.1 and appendix B pre-train; a new
    one trains with the encoder (appendix C's "joint train w/ random init"), its MLM loss in the total."""
    method, options, head = tiny_simlm(f"method.generator_init={generator_dir}")
    assert not any(p.requires_grad for p in head.generator.parameters())
    assert head.train().training and not head.generator.training  # the frozen generator keeps no dropout
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    out = head(batch)
    assert out["loss"].item() == pytest.approx(out["enc"].item() + out["dec"].item(), rel=1e-6)
    out["loss"].backward()
    assert all(p.grad is None for p in head.generator.parameters())
    forward = forward_flops(method, options, head.encoder.config, batch)
    generator = sum(encoder_flops(head.generator.config, {"input_ids": ids, "mlm_labels": labels}) for ids, labels in
                    ((batch["input_ids"], batch["mlm_labels"]),
                     (batch["dec_input_ids"], torch.where(batch["dec_masked"], 0, -100))))
    assert train_flops(method, options, head.encoder.config, batch) == 3 * forward - 2 * generator

    _, options, head = tiny_simlm()  # new: trained with the encoder, its MLM loss in the total
    assert all(p.requires_grad for name, p in head.generator.named_parameters() if "pooler" not in name)
    out = head(batch)
    out["loss"].backward()
    assert head.generator.mlm_transform.dense.weight.grad.abs().sum() > 0
    config = generator_config(options, head.encoder.config)
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (32, 1, 128)
    assert head.generator.config.hidden_size == 32

    with pytest.raises(ValueError, match="method.freeze_generator: a frozen generator needs method.generator_init"):
        tiny_simlm("method.freeze_generator=true")
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                         intermediate_size=64)).save_pretrained(str(tmp_path / "small-vocab"))
    with pytest.raises(ValueError, match="small-vocab predicts 100 tokens, the encoder 30522"):
        tiny_simlm(f"method.generator_init={tmp_path / 'small-vocab'}")


def test_the_decoder_starts_as_the_encoders_last_layers():
    """§4.1: the 2-layer decoder is initialised with the encoder's last two layers; `decoder_init: new` is not."""
    _, _, copied = tiny_simlm()
    _, _, new = tiny_simlm("method.decoder_init=new")
    for head, equal in ((copied, True), (new, False)):
        source = head.encoder.model.encoder.layer
        for target, layer in zip(head.decoder.layers, source[-2:]):
            theirs = layer.state_dict()
            assert all(torch.equal(v, theirs[k]) for k, v in target.state_dict().items()) is equal
    with pytest.raises(ValueError, match="method.decoder_layers: 3 layers cannot be copied from an encoder of 2"):
        tiny_simlm("method.decoder_layers=3")


def test_the_export_is_an_hf_encoder_and_keeps_the_generator(vocab, wiki_samples, tmp_path):
    """After a step: the export loads in transformers' AutoModel as the encoder, and as a head again (further
    pre-training) with every weight, the generator's and the decoder's included."""
    method, options, head = tiny_simlm()
    batch = method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])
    again = exported_after_a_step(head, batch, tmp_path / "export")
    assert any(k.startswith("generator.model.") for k in again) and any(k.startswith("decoder.") for k in again)


@pytest.mark.integration
def test_a_resumed_zero3_run_with_a_frozen_generator_repeats_the_uninterrupted_one(tmp_path, wiki_shards,
                                                                                   generator_dir):
    """`pretrieve pretrain` of tiny-simlm at ZeRO 3 with a loaded, frozen generator, 4 steps; a run stopped at step
    2 and resumed in a fresh process logs the uninterrupted run's losses bit for bit and exports the same
    weights, the generator's (in pretrieve_head.safetensors) included and unchanged."""
    common = [f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null", "method.max_len=64",
              f"method.generator_init={generator_dir}", "train.zero_stage=3", "checkpoint.every=2",
              "train.log_every=1", "train.max_steps=4", "tracking.enabled=false"]
    pretrain_stopped_and_resumed(TINY_CONFIGS / "tiny-simlm.yaml", [f"run_dir={tmp_path / 'full'}", *common],
                                 [f"run_dir={tmp_path / 'split'}", *common, "train.stop_at=2"])

    assert_resumed_run_repeats(tmp_path, ("enc", "dec", "replaced"))
    from safetensors.torch import load_file

    head = load_file(tmp_path / "full" / "export" / "pretrieve_head.safetensors")
    initial = load_file(generator_dir / "model.safetensors")
    generator = {k[len("generator.model."):]: v for k, v in head.items() if k.startswith("generator.model.")}
    assert generator and all(np.array_equal(v.numpy(), initial[k].numpy()) for k, v in generator.items()
                             if k in initial)
