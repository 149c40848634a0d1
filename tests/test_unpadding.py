"""Unpadded batches (`model.unpad`, models/unpadding.py): each encoder family's stack (BERT, RoBERTa, XLM-R,
ModernBERT) on each batch's texts packed into one row gives every head the padded batch's loss and gradients.
ModernBERT's local (sliding-window) layers get a window shorter than the texts, so that both of its mask kinds
are exercised; RoBERTa's and XLM-R's positions count from padding_idx + 1, so a packed text's positions must
restart there. The packed rows are longer than the position table, as a batch's texts laid end to end are."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from support import SAMPLES, pretrain_env, result_line, text_methods
from pretrieve.cli import main
from pretrieve.config import ConfigError, load_config
from pretrieve.data.masking import Vocabulary
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.stream import ShardStream
from pretrieve.models.encoder import Encoder, ModelOptions
from pretrieve.models.heads import METHODS, get_method
from pretrieve.models.unpadding import Packed
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
MAX_LEN = 96
WINDOW = 16  # ModernBERT's local_attention: 8 tokens each side, much less than the texts
UNPADDING = ("bert", "roberta", "xlm-roberta", "modernbert")  # every encoder family


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokenizer, manifest, 8 samples, {backbone: a checkpoint of it without dropout}; ModernBERT's with a
    16-token local window)."""
    out = tmp_path_factory.mktemp("unpadding")
    assert main(["tokenizer", "train", "--source", "wikipedia", "--input", str(SAMPLES / "wikipedia"),
                 "--out", str(out / "bpe"), "--kind", "bpe", "--vocab-size", "1000"]) == 0
    prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(out / "shards"),
                           tokenizer=str(out / "bpe"), max_len=MAX_LEN, workers=0))
    manifest = out / "shards" / "manifest.json"
    stream = ShardStream([manifest], seed=0, shuffle_buffer=8, tokenizer=str(out / "bpe"))
    samples = [sample for sample, _ in zip(stream, range(8))]
    pad = AutoTokenizer.from_pretrained(str(out / "bpe"), local_files_only=True).pad_token_id
    checkpoints = {}
    for backbone in UNPADDING:
        config = ModelOptions(backbone=backbone, vocab_size=1000, hidden_size=32, num_layers=3, num_heads=2,
                              intermediate_size=64, max_position_embeddings=MAX_LEN, dropout=0.0,
                              pad_token_id=pad).hf_config()
        if backbone == "modernbert":
            config.local_attention = WINDOW
        torch.manual_seed(0)
        Encoder(config).model.save_pretrained(out / backbone)
        checkpoints[backbone] = out / backbone
    return out / "bpe", manifest, samples, checkpoints


def head_and_batch(method: str, corpus, unpad: bool, backbone: str = "modernbert", max_len: int = MAX_LEN):
    tokenizer, _, samples, checkpoints = corpus
    checkpoint = checkpoints[backbone]
    spec = get_method(method)
    options = spec.options_from({"max_len": max_len})
    batch = spec.collator.from_options(options, Vocabulary.of_tokenizer(tokenizer), seed=0)(samples)
    if method == "cotmote":  # half the texts through the query experts
        batch["text_type"] = torch.arange(len(batch["input_ids"])) % 2
    return spec.build(options, ModelOptions(init_from=str(checkpoint), unpad=unpad), seed=0), batch


def assert_same_step(padded, unpadded, batch) -> None:
    """One forward and backward of each head on `batch`: losses within 1e-5, gradients close."""
    losses = []
    for head in (padded, unpadded):
        loss = head(batch)["loss"]
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5, losses
    for (name, p), q in zip(padded.named_parameters(), unpadded.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("backbone", UNPADDING)
@pytest.mark.parametrize("method", text_methods(METHODS))
def test_unpadded_loss_and_gradients_equal_the_padded(method, backbone, corpus):
    """Issue: loss equal to the padded batch's within 1e-5; every head reads the re-padded states."""
    padded, batch = head_and_batch(method, corpus, unpad=False, backbone=backbone)
    unpadded, _ = head_and_batch(method, corpus, unpad=True, backbone=backbone)
    assert unpadded.encoder.unpad and unpadded.encoder.config.model_type == backbone
    assert backbone != "modernbert" or unpadded.encoder.config.local_attention == WINDOW
    for key, value in padded.state_dict().items():
        assert torch.equal(unpadded.state_dict()[key], value), key
    assert batch["attention_mask"].float().mean() < 1  # the batch holds padding to skip
    assert_same_step(padded, unpadded, batch)


@pytest.mark.parametrize("backbone", UNPADDING)
def test_unpadded_with_activation_checkpointing_equals_the_padded(backbone, corpus):
    """The packing travels into the recomputed layers (HF checkpointing replays each layer's call)."""
    padded, batch = head_and_batch("retromae", corpus, unpad=False, backbone=backbone)
    unpadded, _ = head_and_batch("retromae", corpus, unpad=True, backbone=backbone)
    unpadded.encoder.enable_activation_checkpointing()
    assert_same_step(padded, unpadded, batch)


@pytest.mark.parametrize("padding", [True, False], ids=["padded", "no-padding"])
@pytest.mark.parametrize("backbone", UNPADDING)
def test_packed_states_are_the_padded_states_at_real_tokens(backbone, padding, corpus):
    """fp32, no dropout: the states at real tokens within 1e-5 (measured: equal, or within 1e-6), zeros at
    padding. Without padding, HF drops the mask: attention must still stay within each packed text."""
    padded, batch = head_and_batch("mlm", corpus, unpad=False, backbone=backbone)
    unpadded, _ = head_and_batch("mlm", corpus, unpad=True, backbone=backbone)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if not padding:  # the texts cut to the shortest one
        width = int(mask.sum(1).min())
        ids, mask = ids[:, :width], mask[:, :width]
    assert bool(mask.all()) != padding and int(mask.sum()) > MAX_LEN  # a packed row longer than the positions
    with torch.no_grad():
        a = padded.encoder(ids, mask)
        b = unpadded.encoder(ids, mask)
    real = mask.bool()
    torch.testing.assert_close(b[real], a[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(b[~real], torch.zeros_like(b[~real]))


def test_packing_of_a_batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    packed = Packed.of(mask)
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 9] and packed.max_len == 4
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    x = torch.arange(12.0).view(3, 4, 1)
    assert packed.pack(x).flatten().tolist() == [0, 1, 2, 4, 5, 8, 9, 10, 11]
    assert torch.equal(packed.unpack(packed.pack(x)), x * mask[..., None])


def test_unpad_on_a_backbone_without_a_varlen_path_is_refused(corpus):
    """The decoder LLMs have none: refused in the config check, and by the encoder itself (init_from)."""
    tokenizer, manifest, _, _ = corpus
    with pytest.raises(ConfigError, match="model.unpad: the llama backbone has no unpadded path "
                                          r"\(bert, roberta, xlm-roberta, modernbert have\)"):
        experiment(load_config(CONFIGS / "tiny-mlm.yaml", [
            "model.backbone=llama", "model.bidirectional=true", "model.unpad=true", f"data.manifests=[{manifest}]",
            "data.weights=null"]))
    llama = ModelOptions(backbone="llama", vocab_size=1000, hidden_size=32, num_layers=1, num_heads=2,
                         intermediate_size=64, bidirectional=True)
    with pytest.raises(ValueError, match="the Llama backbone has no unpadded path"):
        Encoder.build(ModelOptions(**{**llama.__dict__, "unpad": True}))


@pytest.mark.parametrize("method,backbone", [("cotmote", "modernbert"), ("retromae", "roberta")])
def test_pretraining_with_unpadded_batches(method, backbone, corpus, tmp_path):
    """`model.unpad=true` through the engine: two steps of CoT-MoTE (its experts routed per packed token) or
    RetroMAE; the export is a plain model of the family that loads padded."""
    tokenizer, manifest, _, _ = corpus
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / f"tiny-{method}.yaml"),
         f"run_dir={run_dir}", f"data.manifests=[{manifest}]", "data.weights=null", f"data.tokenizer={tokenizer}",
         f"model.backbone={backbone}", "model.unpad=true", "model.vocab_size=1000",
         f"model.max_position_embeddings={MAX_LEN}", f"method.max_len={MAX_LEN}", "train.max_steps=2",
         "train.micro_batch_size=4", "checkpoint.every=2"],
        env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert result_line(done.stdout)["step"] == 2
    export = Encoder.from_pretrained(run_dir / "export")
    assert not export.unpad and export.config.model_type == backbone
