"""Every head on every backbone (BERT, RoBERTa, XLM-R, ModernBERT), each with a tokenizer trained by
`pretrieve tokenizer train` on the bundled Wikipedia sample: training steps, the decoders built from the
backbone's own layer class, positions in RetroMAE's query stream, exports that load in AutoModel and
sentence-transformers, pre-training through the engine, and checkpoints written before the backbone interface."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.modernbert.modeling_modernbert import ModernBertEncoderLayer
from transformers.models.roberta.modeling_roberta import RobertaLayer
from transformers.models.xlm_roberta.modeling_xlm_roberta import XLMRobertaLayer

from support import SAMPLES, adamw_steps, old_parameter_name, pretrain_env, result_line, text_methods
from pretrieve.cli import main
from pretrieve.config import ConfigError, load_config
from pretrieve.data.masking import Vocabulary
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions
from pretrieve.data.stream import ShardStream
from pretrieve.models.encoder import Encoder, ModelOptions, load_encoder
from pretrieve.models.export import export
from pretrieve.models.heads import METHODS, get_method
from pretrieve.pretrain_config import experiment

pytestmark = pytest.mark.system

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"
# each backbone with the tokenizer kind of its family, and its layer class
BACKBONES = {"bert": ("wordpiece", BertLayer), "roberta": ("bpe", RobertaLayer),
             "xlm-roberta": ("unigram", XLMRobertaLayer), "modernbert": ("bpe", ModernBertEncoderLayer)}
MAX_LEN = 96
SCIFACT = SAMPLES / "beir" / "scifact-sample"
FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"  # labelled pairs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """kind -> (tokenizer directory, manifest, 8 samples): a 1,000-token tokenizer of each kind and the bundled
    Wikipedia sample prepared with it."""
    out = tmp_path_factory.mktemp("backbones")
    found = {}
    for kind in ("wordpiece", "bpe", "unigram"):
        assert main(["tokenizer", "train", "--source", "wikipedia", "--input", str(SAMPLES / "wikipedia"),
                     "--out", str(out / kind), "--kind", kind, "--vocab-size", "1000"]) == 0
        prepare(PrepareOptions(source="wikipedia", inputs=[str(SAMPLES / "wikipedia")], out=str(out / f"{kind}-shards"),
                               tokenizer=str(out / kind), max_len=MAX_LEN, workers=0))
        manifest = out / f"{kind}-shards" / "manifest.json"
        stream = ShardStream([manifest], seed=0, shuffle_buffer=8, tokenizer=str(out / kind))
        found[kind] = (out / kind, manifest, [sample for sample, _ in zip(stream, range(8))])
    return found


def tiny(backbone: str, tokenizer: Path, **extra) -> ModelOptions:
    # three layers: ModernBERT's layer 0 attends globally, layers 1-2 locally
    pad = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).pad_token_id
    return ModelOptions(backbone=backbone, vocab_size=1000, hidden_size=32, num_layers=3, num_heads=2,
                        intermediate_size=64, max_position_embeddings=MAX_LEN, pad_token_id=pad, **extra)


def head_and_batch(backbone: str, method: str, corpora, seed: int = 0):
    tokenizer, _, samples = corpora[BACKBONES[backbone][0]]
    spec = get_method(method)
    options = spec.options_from({"max_len": MAX_LEN})
    batch = spec.collator.from_options(options, Vocabulary.of_tokenizer(tokenizer), seed=0)(samples)
    if method == "cotmote":  # half the texts through the query experts
        batch["text_type"] = torch.arange(len(batch["input_ids"])) % 2
    return spec.build(options, tiny(backbone, tokenizer), seed=seed), batch


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
@pytest.mark.parametrize("method", text_methods(METHODS))
def test_every_head_trains_on_every_backbone(backbone, method, corpora):
    head, batch = head_and_batch(backbone, method, corpora)
    assert head.encoder.model.config.model_type == backbone
    losses = adamw_steps(head, batch, steps=2, lr=2e-3)  # every weight gets a gradient (the frozen pooler aside)
    assert all(map(torch.isfinite, map(torch.tensor, losses))) and losses[1] < losses[0], losses


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_decoders_are_the_backbones_own_layers(backbone, corpora):
    for method in ("retromae", "dupmae", "seed", "cotmae", "cotmote"):
        head, _ = head_and_batch(backbone, method, corpora)
        assert all(isinstance(layer, BACKBONES[backbone][1]) for layer in head.decoder.layers), method
    head, _ = head_and_batch(backbone, "cotmote", corpora)  # the query experts copy the family's FFN block
    names = {name.split(".")[1] for name, _ in head.encoder.query_experts.named_parameters()}
    assert names == ({"mlp_norm", "mlp"} if backbone == "modernbert" else {"intermediate", "output"})


def test_query_stream_positions_follow_the_backbone(corpora):
    """Eq. 2's h + p_i: BERT's p_i is row i of the position table, RoBERTa's row pad + 1 + i; ModernBERT has no
    table, and RoPE alone tells the decoder's identical query rows apart."""
    bert, _ = head_and_batch("bert", "retromae", corpora)
    table = bert.encoder.model.embeddings.position_embeddings.weight
    assert torch.equal(bert.encoder.position_vectors(4, table.device), table[:4])
    roberta, _ = head_and_batch("roberta", "retromae", corpora)
    pad = roberta.encoder.config.pad_token_id
    table = roberta.encoder.model.embeddings.position_embeddings.weight
    assert pad == 1 and table.shape[0] == MAX_LEN + pad + 1
    assert torch.equal(roberta.encoder.position_vectors(4, table.device), table[pad + 1:pad + 5])

    modern, batch = head_and_batch("modernbert", "retromae", corpora)
    modern.eval()
    assert modern.encoder.position_vectors(4, torch.device("cpu")) is None
    h = torch.randn(2, 32)
    h1 = modern.query_stream(h, 6)
    assert torch.equal(h1, h[:, None].expand(-1, 6, -1))
    h2 = torch.randn(2, 6, 32)  # H2: distinct rows, as [h, e_x1, ...]
    out = modern.decoder(h1, h2, lambda q, k, v, p: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert not torch.allclose(out[:, 1], out[:, 2])  # same input row, other position


@pytest.mark.parametrize("backbone,method", [("roberta", "dupmae"), ("xlm-roberta", "cotmote"),
                                             ("modernbert", "retromae"),
                                             *(("bert", "bow"), ("roberta", "bow"), ("xlm-roberta", "bow"),
                                               ("modernbert", "bow")), ("bert", "condenser"),
                                             ("modernbert", "cocondenser"), ("roberta", "simlm"),
                                             ("modernbert", "simlm"), ("xlm-roberta", "lexmae"),
                                             ("modernbert", "lexmae")])
def test_exports_load_in_automodel_and_sentence_transformers(backbone, method, corpora, tmp_path):
    from sentence_transformers import SentenceTransformer

    tokenizer = corpora[BACKBONES[backbone][0]][0]
    head, batch = head_and_batch(backbone, method, corpora)
    head.eval()
    out = export(head, tmp_path / "export", tokenizer=tokenizer)
    assert json.loads((out / "config.json").read_text())["model_type"] == backbone
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        ours = head.encoder(ids, mask)
        auto = AutoModel.from_pretrained(str(out)).eval()(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(auto, ours, rtol=1e-5, atol=1e-5)
        st = SentenceTransformer(str(out), device="cpu")
        texts = ["the anarchism movement", "a political philosophy of the nineteenth century"]
        encoded = st.tokenizer(texts, padding=True, return_tensors="pt")
        cls = head.encoder(encoded["input_ids"], encoded["attention_mask"])[:, 0]
        torch.testing.assert_close(torch.as_tensor(st.encode(texts)), cls, rtol=1e-4, atol=1e-5)

    again = load_encoder(out)  # eval / fine-tuning's reader: the backbone and the MLM head come back
    assert again.backbone is head.encoder.backbone
    assert torch.equal(again.mlm_bias, head.encoder.mlm_bias) and again.load_report == []
    assert (again.query_experts is not None) == (method == "cotmote")
    resumed = get_method(method).build(head.options, ModelOptions(init_from=str(out)))  # continue pre-training
    for key, value in head.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_a_lexmae_export_encodes_and_fine_tunes_sparse_on_every_backbone(backbone, corpora, tmp_path):
    """The sparse path on each family: eval's VocabEncoder reads a LexMAE export's SPLADE vectors as the head's
    own MLM logits give them over the text between [CLS] and [SEP], and the dual encoder's pooling sparse trains on
    them (loss and gradients)."""
    from pretrieve.eval.encode import EncodeOptions, VocabEncoder
    from pretrieve.finetune.models import DualEncoder
    from pretrieve.models.representation import sparse_representation

    tokenizer = corpora[BACKBONES[backbone][0]][0]
    head, _ = head_and_batch(backbone, "lexmae", corpora)
    out = export(head.eval(), tmp_path / "export", tokenizer=tokenizer)
    texts = ["the anarchism movement", "a political philosophy of the nineteenth century and after"]
    encoder = VocabEncoder(out, EncodeOptions("sparse", 32, 2), top_k=10_000)
    _, vectors = encoder.encode(texts, documents=True, progress=False)
    tokens = AutoTokenizer.from_pretrained(str(out))
    batch = tokens(texts, padding=True, return_tensors="pt")
    ids = batch["input_ids"]  # the family's [CLS] and [SEP] (<s>, </s>) pooled by none
    text = batch["attention_mask"] * (ids != tokens.cls_token_id) * (ids != tokens.sep_token_id)
    with torch.no_grad():
        hidden = head.encoder(ids, batch["attention_mask"])
        expected = sparse_representation(head.encoder.mlm_logits(hidden), text)
    np.testing.assert_allclose(vectors.toarray(), expected.numpy(), rtol=1e-4, atol=1e-5)

    dual = DualEncoder(load_encoder(out).train(), pooling="sparse", flops=(0.1, 0.1))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    loss = dual({"query_input_ids": ids, "query_attention_mask": mask, "passage_input_ids": ids.flip(0),
                 "passage_attention_mask": mask.flip(0)})["loss"]
    loss.backward()
    assert torch.isfinite(loss) and dual.encoder.mlm_transform.dense.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("backbone", sorted(BACKBONES))
def test_a_lexmae_export_loads_in_automodel_for_masked_lm_with_its_own_mlm_head(backbone, corpora, tmp_path, caplog):
    """The MLM head is written where the family's *ForMaskedLM reads it: nothing is missing, so two loads give
    the same logits, pretrieve's own (outside pretrieve, a SPLADE vector is the head's). pretrieve's own loaders
    read the export without a warning (transformers' would call the head's keys unexpected)."""
    from transformers import AutoModelForMaskedLM

    from pretrieve.models.export import load_base_model

    tokenizer = corpora[BACKBONES[backbone][0]][0]
    head, batch = head_and_batch(backbone, "lexmae", corpora)
    with torch.no_grad():
        head.encoder.mlm_bias.normal_()  # a trained head's bias, not its zero start
    out = export(head.eval(), tmp_path / "export", tokenizer=tokenizer)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        expected = head.encoder.mlm_logits(head.encoder(ids, mask))
        logits = []
        for _ in range(2):
            model, info = AutoModelForMaskedLM.from_pretrained(str(out), output_loading_info=True)
            assert not info["missing_keys"] and not info["mismatched_keys"], info
            logits.append(model.eval()(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[0], expected, rtol=1e-5, atol=1e-5)
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_base_model(out), load_encoder(out)
    said = [r for r in caplog.records if "LOAD REPORT" in r.getMessage() or r.name.startswith("pretrieve")]
    assert not said, caplog.text


def test_a_lexmae_card_names_the_sparse_representation_it_is_evaluated_with(corpora, tmp_path):
    from pretrieve.eval.model_card import _pretraining_facts

    head, _ = head_and_batch("bert", "lexmae", corpora)
    out = export(head.eval(), tmp_path / "export", tokenizer=corpora["wordpiece"][0])
    summary = _pretraining_facts(out, {})["summary"]
    assert "its representation is the SPLADE vector of its MLM head" in summary
    assert "`pretrieve eval --pooling sparse` scores it" in summary and "AutoModelForMaskedLM" in summary
    assert "[CLS] vector is the text's representation" not in summary
    head, _ = head_and_batch("bert", "retromae", corpora)  # a dense method's card is as it was
    out = export(head.eval(), tmp_path / "retromae", tokenizer=corpora["wordpiece"][0])
    assert "its [CLS] vector is the text's representation" in _pretraining_facts(out, {})["summary"]


@pytest.mark.parametrize("backbone", ["roberta", "xlm-roberta", "modernbert"])
def test_init_from_a_released_masked_lm_checkpoint_keeps_its_mlm_head(backbone, corpora, tmp_path):
    """Continued pre-training from a released checkpoint, in the form the family's checkpoints are published:
    the family's HF MaskedLM model saved by `save_pretrained`. init_from reads every weight, the MLM head
    included, so the encoder's MLM logits are the checkpoint's own."""
    from transformers import AutoModelForMaskedLM

    tokenizer, _, samples = corpora[BACKBONES[backbone][0]]
    torch.manual_seed(0)
    released = AutoModelForMaskedLM.from_config(tiny(backbone, tokenizer).hf_config()).eval()
    released.save_pretrained(tmp_path / backbone)
    encoder = Encoder.from_pretrained(tmp_path / backbone).eval()
    # all but the [CLS] pooler, which MaskedLM checkpoints leave out and pre-training does not use
    assert all(line.startswith("pooler.") for line in encoder.load_report), encoder.load_report
    assert encoder.backbone.name == backbone
    ids = torch.as_tensor(np.stack([s["ids"][:24] for s in samples if len(s["ids"]) >= 24][:3]).astype(np.int64))
    with torch.no_grad():
        expected = released(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        logits = encoder.mlm_logits(encoder(ids, torch.ones_like(ids)))
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_pretraining_runs_each_backbone_from_its_config(corpora, tmp_path):
    """`model.backbone` and `data.tokenizer` through the engine: two steps, then an export of that family, which
    `pretrieve finetune` and `pretrieve eval` take as they take BERT's."""
    for backbone, method in (("modernbert", "dupmae"), ("xlm-roberta", "seed")):
        tokenizer, manifest, _ = corpora[BACKBONES[backbone][0]]
        run_dir = tmp_path / backbone
        done = subprocess.run(
            [sys.executable, "-m", "pretrieve", "pretrain", str(CONFIGS / f"tiny-{method}.yaml"), f"run_dir={run_dir}",
             f"data.manifests=[{manifest}]", "data.weights=null", f"data.tokenizer={tokenizer}",
             f"model.backbone={backbone}", "model.vocab_size=1000", f"model.max_position_embeddings={MAX_LEN}",
             f"method.max_len={MAX_LEN}", "train.max_steps=2", "train.micro_batch_size=4", "checkpoint.every=2"],
            env=pretrain_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert result_line(done.stdout)["step"] == 2
        config = json.loads((run_dir / "export" / "config.json").read_text())
        pad = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).pad_token_id
        assert (config["model_type"], config["pad_token_id"]) == (backbone, pad)  # the model pads as the shards
        family = {"modernbert": "ModernBERT", "xlm-roberta": "XLM-RoBERTa"}[backbone]
        assert f"A {family} encoder pre-trained with **{method}**" in (run_dir / "export" / "README.md").read_text()
        assert isinstance(Encoder.from_pretrained(run_dir / "export").model, type(AutoModel.from_pretrained(
            str(run_dir / "export"))))
    # downstream, no new flags: fine-tune the ModernBERT export, then evaluate it beside BM25
    finetuned = tmp_path / "finetune"
    subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(CONFIGS.parent / "finetune" / "tiny.yaml"),
                    f"finetune.init_from={tmp_path / 'modernbert' / 'export'}", f"finetune.data=[{FLAG}]",
                    "finetune.passage_max_len=64", "train.micro_batch_size=4", "train.max_steps=2",
                    "checkpoint.every=2", f"run_dir={finetuned}"],
                   check=True, env=pretrain_env(), capture_output=True)
    assert json.loads((finetuned / "export" / "config.json").read_text())["model_type"] == "modernbert"
    assert main(["eval", "--model", str(finetuned / "export"), "--beir", str(SCIFACT), "--max-length", "64",
                 "--bm25", "--out", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["queries"] == 100 and 0 <= metrics["ndcg@10"] <= 1


def test_checkpoints_from_before_the_backbone_interface_still_load(corpora):
    """The base model was `encoder.bert.*`, RetroMAE's decoder layer `decoder.query.weight` and the causal
    decoders' `decoder.layers.i.query.weight`: such state dicts load into today's heads unchanged."""
    for method in ("retromae", "seed"):
        head, _ = head_and_batch("bert", method, corpora)
        old = {old_parameter_name(key, method): value for key, value in head.state_dict().items()}
        assert "encoder.bert.pooler.dense.weight" in old
        assert ("decoder.query.weight" if method == "retromae" else "decoder.layers.0.query.weight") in old
        fresh, _ = head_and_batch("bert", method, corpora, seed=1)
        fresh.load_state_dict(old)  # strict
        for key, value in head.state_dict().items():
            assert torch.equal(fresh.state_dict()[key], value), key


def test_a_universal_checkpoint_from_before_the_backbone_interface_names_todays_parameters(corpora, tmp_path):
    """A universal checkpoint keeps each parameter's weights and optimizer state in zero/<name>/, where DeepSpeed
    looks for today's names; one written with the old ones (`encoder.bert.*`, RetroMAE's `decoder.query`) has
    its folders renamed as the load hook renames state-dict keys, before DeepSpeed loads it."""
    from pretrieve.engine.checkpoint import rename_old_parameters

    head, _ = head_and_batch("bert", "retromae", corpora)
    today = [name for name, _ in head.named_parameters()]
    tag = tmp_path / "step00000002-universal"
    for name in today:  # the folders of a checkpoint written with the old names
        old = old_parameter_name(name, "retromae")
        (tag / "zero" / old).mkdir(parents=True)
        (tag / "zero" / old / "fp32.pt").write_text(name)
    assert (tag / "zero" / "encoder.bert.embeddings.word_embeddings.weight").is_dir()
    assert (tag / "zero" / "decoder.query.weight").is_dir()
    rename_old_parameters(head, tag)
    assert sorted(p.name for p in (tag / "zero").iterdir()) == sorted(today)
    assert all((tag / "zero" / name / "fp32.pt").read_text() == name for name in today)  # each its own state
    rename_old_parameters(head, tag)  # once renamed, nothing to do
    assert sorted(p.name for p in (tag / "zero").iterdir()) == sorted(today)


def test_init_from_grows_the_learnt_position_table(corpora, tmp_path):
    """XLM-R trained at MAX_LEN positions, continued at 3 x MAX_LEN (as BGE-M3 grew XLM-R to 8,192): the new
    rows copy the trained ones in order, a text longer than before trains, and the export keeps the table."""
    import numpy as np

    tokenizer, _, samples = corpora["unigram"]
    head, _ = head_and_batch("xlm-roberta", "retromae", corpora)
    short = export(head, tmp_path / "short", tokenizer=tokenizer)
    spec = get_method("retromae")
    options = spec.options_from({"max_len": 3 * MAX_LEN})
    grown = spec.build(options, ModelOptions(init_from=str(short), extend_positions=3 * MAX_LEN))
    old = head.encoder.model.embeddings.position_embeddings.weight
    table = grown.encoder.model.embeddings.position_embeddings.weight
    offset = head.encoder.config.pad_token_id + 1
    assert table.shape[0] == offset + 3 * MAX_LEN and torch.equal(table[:offset + MAX_LEN], old)
    assert torch.equal(table[offset + 2 * MAX_LEN + 7], old[offset + 7])
    with pytest.raises(ValueError, match="has 96 positions already"):
        spec.build(options, ModelOptions(init_from=str(short), extend_positions=MAX_LEN))
    overrides = [f"model.init_from={short}", f"data.manifests=[{corpora['unigram'][1]}]", "data.weights=null",
                 f"data.tokenizer={tokenizer}", f"method.max_len={3 * MAX_LEN}"]
    with pytest.raises(ConfigError, match="has 96; grow it with model.extend_positions"):
        experiment(load_config(CONFIGS / "tiny-retromae.yaml", overrides))
    experiment(load_config(CONFIGS / "tiny-retromae.yaml", [*overrides, f"model.extend_positions={3 * MAX_LEN}"]))

    long = [dict(samples[i], ids=np.concatenate([samples[i]["ids"], samples[i + 1]["ids"]])) for i in range(4)]
    batch = spec.collator.from_options(options, Vocabulary.of_tokenizer(tokenizer), seed=0)(long)
    assert batch["input_ids"].shape[1] > MAX_LEN
    loss = grown(batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and table.grad[offset + MAX_LEN:].abs().sum() > 0  # the new rows learn
    out = export(grown, tmp_path / "long", tokenizer=tokenizer)
    assert AutoModel.from_pretrained(str(out)).config.max_position_embeddings == offset + 3 * MAX_LEN


def test_scale_plan_counts_each_backbones_parameters():
    """N (Kaplan's non-embedding parameters) per backbone: BERT's layers 4h^2 + 2hf + f + 9h each; ModernBERT's
    4h^2 + 3hf (bias-free QKV, O and GeGLU) and its bias-free norms, layer 0 without one before attention, plus
    the final norm. N_total adds the embeddings (ModernBERT: no position or token-type tables)."""
    from pretrieve.scale.plan import parameter_counts

    h, f, layers, vocab = 64, 256, 3, 1000
    shape = dict(hidden_size=h, num_layers=layers, num_heads=2, intermediate_size=f, vocab_size=vocab,
                 max_position_embeddings=128, pad_token_id=0)
    assert parameter_counts(ModelOptions(backbone="bert", **shape).hf_config()) == (
        layers * (4 * h * h + 2 * h * f + f + 9 * h), layers * (4 * h * h + 2 * h * f + f + 9 * h)
        + (vocab + 128 + 2) * h + 2 * h)
    n = layers * (4 * h * h + 3 * h * f) + (2 * layers - 1) * h + h
    assert parameter_counts(ModelOptions(backbone="modernbert", **shape).hf_config()) == (n, n + vocab * h + h)


def test_scale_plan_memory_counts_the_backbones_feed_forward_activations(corpora):
    """A layer keeps n f-wide tensors for backward: BERT's FFN 2 (the GELU's input and output), ModernBERT's
    GeGLU 4 (W_i's input and gate, the GELU's output, the product W_o takes)."""
    from pretrieve.scale.memory import estimate, layer_activations

    tokenizer, manifest, samples = corpora["bpe"]
    for backbone, ffn in (("bert", 2), ("modernbert", 4)):
        exp = experiment(load_config(CONFIGS / "tiny-mlm.yaml", [
            f"model.backbone={backbone}", "model.vocab_size=1000", f"data.manifests=[{manifest}]",
            "data.weights=null", f"data.tokenizer={tokenizer}"]))
        batch = exp.method.collator.from_options(exp.options, Vocabulary.of_tokenizer(tokenizer), seed=0)(samples)
        m, s = exp.model, batch["input_ids"].shape[1]
        assert estimate(exp, 1, batch)["per_sequence"] == m.num_layers * layer_activations(
            1, s, m.hidden_size, m.intermediate_size, m.num_heads, 4, ffn), backbone


def test_a_padding_id_outside_the_vocabulary_is_named(corpora):
    """ModernBERT's own pad id (50283) in a 30,522-token vocabulary: an error naming the key, not an index error
    in the embedding table. Configs set it from the training tokenizer."""
    with pytest.raises(ValueError, match="model.pad_token_id: 50283 is outside the vocabulary of 30522 tokens"):
        ModelOptions(backbone="modernbert").hf_config()
    tokenizer, manifest, _ = corpora["bpe"]
    exp = experiment(load_config(CONFIGS / "tiny-mlm.yaml", [
        "model.backbone=modernbert", "model.vocab_size=1000", f"data.manifests=[{manifest}]", "data.weights=null",
        f"data.tokenizer={tokenizer}"]))
    pad = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).pad_token_id
    assert pad != 0 and exp.model.hf_config().pad_token_id == pad  # the trained tokenizer's <pad>
