"""LoRA through peft (`model.lora`, models/lora.py): the adapters and the head's own weights train, the base
model's weights stay bit-identical; an export merges the adapters (or keeps them apart, in peft's files) and
computes what the adapted model computed; bad options name their key; and on two ranks, ZeRO 3 with parameters
and optimizer offloaded and activation checkpointing, a LoRA run stopped and resumed equals the uninterrupted
run and exports."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from support import adamw_steps, free_port, pretrain_env
from pretrieve.config import load_config
from pretrieve.data.masking import Vocabulary
from pretrieve.data.tokenizer import load_tokenizer
from pretrieve.eval.encode import DenseEncoder, EncodeOptions
from pretrieve.models.encoder import Encoder, ModelOptions, load_encoder
from pretrieve.models.export import export
from pretrieve.models.heads import get_method
from pretrieve.models.lora import ADAPTER_DIR, LoraOptions, has_lora
from pretrieve.pretrain_config import experiment
from pretrieve.utils.options import ConfigError

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
TEXTS = ["The cat sat on the mat while the dog slept near the door, and later chased it over the wall.",
         "Rivers carry water from the mountains to the sea.",
         "Paris is the capital of France and its largest city, on the Seine."]
LORA = LoraOptions(r=4, alpha=8.0, dropout=0.0)


def _head(llm, backbone="qwen3", lora=LORA):
    """A tiny llama2vec head with LoRA, its batch of TEXTS."""
    tokenizer, vocab = load_tokenizer(llm[0]), Vocabulary.of_tokenizer(llm[0])
    method = get_method("llama2vec")
    options = method.options_from({"max_len": 96})
    model = ModelOptions(backbone=backbone, vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0, lora=lora)
    head = method.build(options, model, seed=0)
    samples = [{"ids": np.array(tokenizer(text, add_special_tokens=False)["input_ids"])} for text in TEXTS]
    return head, method.collator.from_options(options, vocab)(samples)


@pytest.mark.parametrize("backbone", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_adapters_learn_and_the_base_model_stays_as_it_was(llm, backbone):
    head, batch = _head(llm, backbone)
    trained = {name for name, p in head.named_parameters() if p.requires_grad}
    # every linear layer of every block is adapted: 7 in a Llama block, A and B each
    assert len([n for n in trained if ".lora_" in n]) == 2 * 7 * 2
    assert trained == {n for n in trained if ".lora_" in n}  # nothing else: the LM head is the base model's, no bias
    base = {name: p.detach().clone() for name, p in head.encoder.model.named_parameters() if ".lora_" not in name}
    before = {name: p.detach().clone() for name, p in head.named_parameters() if p.requires_grad}
    losses = adamw_steps(head.train(), batch, steps=4, lr=1e-2)  # every trainable weight gets a gradient
    assert losses[-1] < losses[0], losses
    after = dict(head.encoder.model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in base.items())  # bit for bit
    moved = dict(head.named_parameters())
    assert [name for name, value in before.items() if torch.equal(moved[name], value)] == []


def test_an_export_merges_the_adapters_or_keeps_them_apart(llm, tmp_path):
    """Merged: a plain HF model (no peft names) whose states are the adapted model's. Kept apart: the base
    weights exactly as they were, the adapter in peft's files, which PeftModel loads and pretrieve merges when it
    loads the export."""
    from peft import PeftModel
    from transformers import AutoModel

    head, batch = _head(llm)
    base = {n.replace(".base_layer", ""): p.detach().clone() for n, p in head.encoder.model.named_parameters()
            if ".lora_" not in n}
    adamw_steps(head.train(), batch, steps=3, lr=1e-2)
    head.eval()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        adapted = head.encoder(ids, mask)
    kept = export(head.__class__(_copy_encoder(head), head.options), tmp_path / "kept", tokenizer=llm[0],
                  keep_adapter=True)
    merged = export(head, tmp_path / "merged", tokenizer=llm[0])
    assert not has_lora(head.encoder.model)  # merged in place
    weights = load_file(merged / "model.safetensors")
    assert not [k for k in weights if "lora_" in k or "base_layer" in k] and not (merged / ADAPTER_DIR).exists()
    with torch.no_grad():
        np.testing.assert_allclose(Encoder.from_pretrained(merged)(ids, mask), adapted, rtol=1e-4, atol=1e-5)

    assert sorted(p.name for p in (kept / ADAPTER_DIR).iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
    plain = load_file(kept / "model.safetensors")
    assert plain.keys() == base.keys() and all(torch.equal(plain[k], base[k]) for k in base)
    peft_model = PeftModel.from_pretrained(AutoModel.from_pretrained(kept), str(kept / ADAPTER_DIR)).eval()
    with torch.no_grad():
        np.testing.assert_allclose(Encoder(peft_model.config, model=peft_model.merge_and_unload())(ids, mask),
                                   adapted, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(load_encoder(kept)(ids, mask), adapted, rtol=1e-4, atol=1e-5)
    # evaluation reads the kept-apart export as the merged one: the same vectors
    vectors = [DenseEncoder(out, EncodeOptions("last", max_length=64, batch_size=2)).encode(TEXTS, progress=False)
               for out in (kept, merged)]
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=1e-4, atol=1e-5)


def _copy_encoder(head):
    import copy

    return copy.deepcopy(head.encoder)


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=-1", "model.lora.r: must be >= 0 (0: no LoRA), got -1"),
    ("model.lora.rank=8", "model.lora.rank: unknown key (known: alpha, dropout, keep_adapter, r, targets)"),
    ("model.lora.dropout=1.5", "model.lora.dropout: must be in [0, 1), got 1.5"),
    ("model.lora.targets=[]", "model.lora.targets: empty: null adapts every linear layer"),
    ("model.lora=8", "model.lora: expected a mapping of r, alpha, dropout, targets, keep_adapter; got 8"),
    # r 0 trains every weight: the adapters' other settings would do nothing, and are refused by name
    ("model.lora.alpha=8", "model.lora.alpha: set, but model.lora.r is 0: no LoRA, every weight of the model "
                           "trains; give model.lora.r > 0 for adapters, or leave alpha out (model.lora=null: no LoRA)"),
    ("model.lora={r: 0, keep_adapter: true}", "model.lora.keep_adapter: set, but model.lora.r is 0: no LoRA, every "
                                              "weight of the model trains; give model.lora.r > 0 for adapters, or "
                                              "leave keep_adapter out (model.lora=null: no LoRA)"),
])
def test_bad_lora_options_name_their_key(llm, override, message):
    with pytest.raises(ConfigError, match=f"^{_escaped(message)}$"):
        experiment(load_config(str(CONFIGS / "tiny-llama2vec.yaml"), [override, f"data.tokenizer={llm[0]}",
                                                                     f"data.manifests=[{llm[1] / 'manifest.json'}]"]))


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_targets_that_name_no_layer_are_named(llm):
    with pytest.raises(ValueError, match=r"model.lora.targets: \['query'\] adapt no layer of this model \(its "
                                         r"linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
                                         r"v_proj\)"):
        _head(llm, lora=replace(LORA, targets=["query"]))
    with pytest.raises(ValueError, match=r"^model.lora.targets: \['v_prj'\] adapt no layer of this model"):
        _head(llm, lora=replace(LORA, targets=["q_proj", "v_prj"]))  # a typo beside a valid name: not dropped
    head, _ = _head(llm, lora=replace(LORA, targets=["q_proj", "v_proj"]))
    assert sorted({n.split(".")[-4] for n, p in head.named_parameters() if ".lora_" in n}) == ["q_proj", "v_proj"]


@pytest.mark.integration  # three runs
def test_pretrain_with_lora_at_zero_0_1_2_exports(llm, tmp_path):
    """`pretrieve pretrain` with LoRA at ZeRO 0, 1 and 2 (one process, 3 steps each, from one init_from): each
    lowers its loss; the exports keep the base weights bit for bit (ZeRO 1 and 2: the frozen weights come from
    the module states, the adapters from the optimizer's partitions), or merge them (ZeRO 0)."""
    head, _ = _head(llm, lora=LoraOptions())
    start = export(head, tmp_path / "start", tokenizer=llm[0])
    common = [f"data.tokenizer={llm[0]}", f"data.manifests=[{llm[1] / 'manifest.json'}]", f"model.init_from={start}",
              "method.max_len=96", "train.micro_batch_size=4", "train.max_steps=3", "train.log_every=1",
              "checkpoint.every=3", "tracking.enabled=false", "model.lora.r=4", "train.lr=1e-2"]
    runs = [[f"run_dir={tmp_path / f'zero{stage}'}", f"train.zero_stage={stage}", *common,
             f"model.lora.keep_adapter={str(stage > 0).lower()}"] for stage in (0, 1, 2)]
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "train_many.py"),
                           str(CONFIGS / "tiny-llama2vec.yaml"), json.dumps(runs)],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    initial = load_file(start / "model.safetensors")
    for stage in (0, 1, 2):
        run = tmp_path / f"zero{stage}"
        losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert losses[-1] < losses[0], (stage, losses)
        exported = load_file(run / "export" / "model.safetensors")
        assert exported.keys() == initial.keys()
        same = [torch.equal(exported[k], initial[k]) for k in initial]
        if stage == 0:  # merged: every adapted weight moved, the rest (embeddings, norms) did not
            assert not (run / "export" / ADAPTER_DIR).exists()
            assert {k for k, equal in zip(initial, same) if not equal} == {k for k in initial if "proj" in k}
        else:
            assert all(same) and (run / "export" / ADAPTER_DIR / "adapter_config.json").is_file()


@pytest.mark.integration  # three two-rank runs
def test_zero3_offload_lora_resumes_exactly_and_exports(llm, tmp_path):
    """Two gloo ranks, ZeRO 3 with parameters and optimizer on the CPU, activation checkpointing, LoRA r 4 on a
    tiny Qwen3 (init_from an export): stopped after step 2 and resumed, the logged losses equal the uninterrupted
    run's bit for bit; its export keeps the adapter apart, with the base weights bit-identical to init_from's,
    and merged when loaded it equals the uninterrupted run's merged export."""
    head, _ = _head(llm, lora=LoraOptions())
    start = export(head, tmp_path / "start", tokenizer=llm[0])

    def run(run_dir, *overrides):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
               "-m", "pretrieve", "pretrain", str(CONFIGS / "tiny-llama2vec.yaml"), f"run_dir={run_dir}",
               f"data.tokenizer={llm[0]}", f"data.manifests=[{llm[1] / 'manifest.json'}]", f"model.init_from={start}",
               "method.max_len=96", "train.micro_batch_size=2", "train.max_steps=4", "train.log_every=1",
               "checkpoint.every=2", "tracking.enabled=false", "train.zero_stage=3", "train.offload_params=true",
               "train.offload_optimizer=true", "train.activation_checkpointing=true", "model.lora.r=4",
               "model.lora.alpha=8", "train.lr=1e-2", *overrides]
        done = subprocess.run(cmd, env=pretrain_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], done.stderr

    full, log = run(tmp_path / "full")
    assert log.count("pretrieve: LoRA r=4: ") == 1, log
    run(tmp_path / "split", "train.stop_at=2", "model.lora.keep_adapter=true")
    split, _ = run(tmp_path / "split", "resume=auto", "model.lora.keep_adapter=true")
    assert [(r["step"], r["loss"]) for r in split] == [(r["step"], r["loss"]) for r in full]
    assert full[-1]["loss"] < full[0]["loss"], [r["loss"] for r in full]

    kept, merged = tmp_path / "split" / "export", tmp_path / "full" / "export"
    plain, initial = load_file(kept / "model.safetensors"), load_file(start / "model.safetensors")
    assert plain.keys() == initial.keys() and all(torch.equal(plain[k], initial[k]) for k in initial)
    assert (kept / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    assert "last token's state" in (merged / "README.md").read_text()  # the model card says where the adapters went
    assert "LoRA (r 4, alpha 8) on a frozen base model; the adapters are merged into these weights" in \
        (merged / "README.md").read_text()
    assert "the adapters are kept apart in `adapter/`" in (kept / "README.md").read_text()
    # the merged run's checkpoint exported again with its adapter apart: the base weights are init_from's
    apart = tmp_path / "apart"
    subprocess.run([sys.executable, "-m", "pretrieve", "export", str(tmp_path / "full"), str(apart), "--keep-adapter"],
                   env=pretrain_env(), check=True, capture_output=True)
    plain = load_file(apart / "model.safetensors")
    assert all(torch.equal(plain[k], initial[k]) for k in initial) and (apart / ADAPTER_DIR).is_dir()
    ours = load_encoder(kept).model.state_dict()
    reference = load_file(merged / "model.safetensors")
    assert ours.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-6, atol=1e-7)
