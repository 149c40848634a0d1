"""Llama2Vec's heads (`llama2vec`, `ebae`, `ebar`: models/heads/llama2vec.py) on tiny decoder LLMs with an llm-kind
tokenizer: the batch (the text, then each prompt ending in its reserved tokens), the losses computed by hand,
the mask and positions that make each prompt read the text alone, every weight learning on each family, and
`pretrieve pretrain` of each head."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from support import adamw_steps, pretrain_env
from pretrieve.data.llama2vec import PREDICT, SUMMARY, TEXT
from pretrieve.data.masking import Vocabulary
from pretrieve.data.spans import STOPWORDS
from pretrieve.data.tokenizer import load_tokenizer
from pretrieve.data.tokenizer_train import LLM_RESERVED
from pretrieve.models.encoder import ModelOptions
from pretrieve.models.heads import get_method
from pretrieve.models.heads.llama2vec import prompt_mask

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "pretrain"
TEXTS = ["The cat sat on the mat while the dog slept near the door. Later the dog woke and chased the cat "
         "across the garden, over the wall and into the field beyond the river.",
         "Rivers carry water from the mountains to the sea.",
         "Paris is the capital of France and its largest city, on the Seine."]


def _setup(llm, name="llama2vec", backbone="qwen3", max_len=96):
    tokenizer = load_tokenizer(llm[0])
    vocab = Vocabulary.of_tokenizer(llm[0])
    method = get_method(name)
    options = method.options_from({"max_len": max_len})
    model = ModelOptions(backbone=backbone, vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                         intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0)
    samples = [{"ids": np.array(tokenizer(text, add_special_tokens=False)["input_ids"])} for text in TEXTS]
    return method, options, model, vocab, samples


def test_a_row_is_the_text_then_each_prompt_ending_in_its_reserved_tokens(llm):
    method, options, _, vocab, samples = _setup(llm)
    batch = method.collator.from_options(options, vocab)([*samples, {**samples[1], "pad": True}])
    ids, segments, positions = batch["input_ids"], batch["segments"], batch["position_ids"]
    reserved = [vocab.tokens.index(token) for token in LLM_RESERVED]
    for b in range(len(ids)):
        assert ids[b, 0] == vocab.cls_id and segments[b, 0] == TEXT
        assert ids[b, batch["ebae_slots"][b]].tolist() == reserved[:8]  # the prompts end in their 8 tokens
        assert ids[b, batch["ebar_slots"][b]].tolist() == reserved[8:]
        summary, predict = (segments[b] == SUMMARY).nonzero()[:, 0], (segments[b] == PREDICT).nonzero()[:, 0]
        assert summary.max() < predict.min() and batch["ebar_slots"][b, -1] == predict.max()
        # EBAR's prompt takes EBAE's positions, right after the text
        assert positions[b, predict].tolist() == positions[b, summary[:len(predict)]].tolist()
        assert positions[b, summary[0]] == (segments[b] == TEXT).sum()
    # the next-token labels are the text's own ids (none on the bos, the quote, the prompts; none on a pad sample)
    text = batch["mlm_labels"][0] != -100
    assert torch.equal(batch["mlm_labels"][0, text], ids[0, text]) and (segments[0, text] == TEXT).all()
    assert (batch["mlm_labels"][3] == -100).all() and (batch["ebae_targets"][3] == -1).all()
    # the block is cut at a word start: the first half is the text, EBAE's bag its words, EBAR's the rest's
    first, rest = samples[0]["ids"][:int(text.sum())], samples[0]["ids"][int(text.sum()):]
    assert torch.equal(ids[0, text], torch.from_numpy(first)) and not vocab.continuation[rest[0]]
    for bag, words in ((batch["ebae_targets"][0], first), (batch["ebar_targets"][0], rest)):
        bag = set(bag[bag >= 0].tolist())
        content = {int(t) for t in words if vocab.tokens[t].lower() not in STOPWORDS
                   and any(c.isalnum() for c in vocab.tokens[t])}
        assert bag == content and len(bag) > 5  # each word once, no stop word, no punctuation
        assert not {vocab.tokens[t].lower() for t in bag} & {"the", "and", "on", "."}

    no_reserved = replace(vocab, tokens=tuple(t.replace("reserved", "kept") for t in vocab.tokens))
    with pytest.raises(ValueError, match="no 16 reserved tokens .* `pretrieve tokenizer train --kind llm`"):
        method.collator.from_options(options, no_reserved)


def test_bags_judge_a_byte_level_token_by_the_text_it_decodes_to(llm):
    """A byte-level vocabulary stores bytes as printable stand-ins that look like letters (a newline is "Ċ",
    "—" is "âĢĶ", "°" is "Â°", a non-breaking space "Âł"): the bags leave those out as punctuation, as LLARA
    removes punctuation from its targets' words; every token of a bag decodes to a letter or digit."""
    from pretrieve.data.spans import word_candidates

    method, options, _, vocab, _ = _setup(llm)
    tokenizer = load_tokenizer(llm[0])
    text = ("The river froze in winter.\nIts banks \u2014 wide and flat \u2014 lay 5\u00b0 below the town\u2019s "
            "old walls.\nMills stood idle\u00a0for weeks.\nThe thaw came late.")
    ids = np.array(tokenizer(text, add_special_tokens=False)["input_ids"])
    stand_ins = {".Ċ", "âĢĶ", "Â°", "âĢĻ", "Âł"}
    assert stand_ins <= {vocab.tokens[i] for i in ids}  # the text has them, as single tokens
    batch = method.collator.from_options(options, vocab)([{"ids": ids}])
    decoded = {int(i): vocab.backend.decode([int(i)]) for i in ids}
    for task in ("ebae", "ebar"):
        bag = [int(t) for t in batch[f"{task}_targets"][0] if t >= 0]
        assert len(bag) >= 3 and all(any(c.isalnum() for c in decoded[t]) for t in bag), [decoded[t] for t in bag]
    candidates = word_candidates(vocab)
    assert not any(candidates[vocab.tokens.index(token)] for token in stand_ins)
    assert candidates[[vocab.tokens.index(token) for token in ("wide", "weeks", "late")]].all()


def test_ebae_asks_for_the_words_of_the_text_as_read(llm):
    """A block longer than the row's room: the text is cut, and EBAE's bag holds the words of what the LLM read,
    not those cut off (LLARA's targets reach past the cut; the paper's EBAE reconstructs the input: why pretrieve
    differs, docs/methods.md)."""
    method, _, _, vocab, samples = _setup(llm, name="ebae", max_len=64)
    collate = method.collator.from_options(method.options_from({"max_len": 64}), vocab)
    block = np.concatenate([samples[0]["ids"], samples[2]["ids"]])
    batch = collate([{"ids": block}])
    read = batch["input_ids"][0, batch["mlm_labels"][0] != -100].numpy()
    assert len(read) == collate.room < len(block)
    bag = set(batch["ebae_targets"][0, batch["ebae_targets"][0] >= 0].tolist())
    cut = {int(t) for t in block[len(read):] if collate.candidates[t]} - set(read.tolist())
    assert bag == {int(t) for t in read if collate.candidates[t]} and cut and not bag & cut


def test_the_losses_by_hand(llm):
    """L = L_lm + (L_ebae + L_ebar) / 2 on a tiny Qwen3, each computed here from states under a mask built
    entry by entry: L_lm the mean cross-entropy of each text token from the state before it; L_task 0.1 x the
    mean over texts of -mean_{w in bag} log softmax(max over the 8 special states' logits)[w]."""
    method, options, model, vocab, samples = _setup(llm)
    head = method.build(options, model, seed=0).eval()
    batch = method.collator.from_options(options, vocab)(samples)
    ids, segments = batch["input_ids"], batch["segments"].tolist()
    size, width = ids.shape
    visible = torch.zeros(size, width, width, dtype=torch.bool)
    for b in range(size):
        for i in range(width):
            for j in range(i + 1):
                visible[b, i, j] = segments[b][j] != -1 and not (segments[b][i] == PREDICT
                                                                  and segments[b][j] == SUMMARY)
            visible[b, i, i] = True
    with torch.no_grad():
        out = head(batch)
        hidden = head.encoder.model(input_ids=ids, attention_mask=visible[:, None],
                                    position_ids=batch["position_ids"]).last_hidden_state
        logits = F.linear(hidden, head.encoder.word_embeddings.weight, head.encoder.mlm_bias)
    labels = batch["mlm_labels"]
    lm = torch.stack([F.cross_entropy(logits[b, i - 1], labels[b, i]) for b, i in (labels != -100).nonzero().tolist()])
    torch.testing.assert_close(out["lm"], lm.mean(), rtol=1e-5, atol=1e-6)
    tasks = []
    for task in ("ebae", "ebar"):
        per_text = []
        for b in range(size):
            pooled = logits[b, batch[f"{task}_slots"][b]].max(dim=0).values.log_softmax(-1)
            bag = batch[f"{task}_targets"][b]
            per_text.append(-pooled[bag[bag >= 0]].mean())
        tasks.append(0.1 * torch.stack(per_text).mean())
        torch.testing.assert_close(out[task], tasks[-1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loss"], lm.mean() + (tasks[0] + tasks[1]) / 2, rtol=1e-5, atol=1e-6)


def test_each_prompt_reads_the_text_alone(llm):
    """Under Llama2Vec's mask and positions, the text's states are a plain causal pass over it, EBAE's special
    states those of the text followed by EBAE's prompt alone (ebae), and EBAR's those of the text followed by
    EBAR's prompt alone (ebar): neither prompt sees the other."""
    method, options, model, vocab, samples = _setup(llm)
    head = method.build(options, model, seed=0).eval()

    def states(name, samples):
        spec = get_method(name)
        batch = spec.collator.from_options(spec.options_from({"max_len": 96}), vocab)(samples)
        with torch.no_grad():
            hidden = head.encoder.backbone.masked_forward(head.encoder.model, batch["input_ids"],
                                                          prompt_mask(batch["segments"]), batch["position_ids"])
        return batch, hidden

    both, hidden = states("llama2vec", samples)
    halves = [{"ids": both["input_ids"][b, both["mlm_labels"][b] != -100].numpy()} for b in range(len(samples))]
    ebae, alone = states("ebae", halves)
    ebar, after = states("ebar", samples)
    for b in range(len(samples)):
        torch.testing.assert_close(hidden[b, both["ebae_slots"][b]], alone[b, ebae["ebae_slots"][b]])
        torch.testing.assert_close(hidden[b, both["ebar_slots"][b]], after[b, ebar["ebar_slots"][b]])
    text = (both["segments"] == TEXT).long()
    with torch.no_grad():
        plain = head.encoder(both["input_ids"] * text, text)
    torch.testing.assert_close(hidden[text.bool()], plain[text.bool()])


@pytest.mark.parametrize("backbone", ["llama", "qwen2", "qwen3", "mistral"])
def test_every_weight_learns_on_each_family(llm, backbone):
    method, options, model, vocab, samples = _setup(llm, backbone=backbone)
    head = method.build(options, replace(model, backbone=backbone), seed=0).train()
    batch = method.collator.from_options(options, vocab)(samples)
    losses = adamw_steps(head, batch, steps=4, lr=2e-3)  # every weight gets a gradient on the first step
    assert losses[-1] < losses[0], losses


@pytest.mark.integration  # 24 short runs, one process (about a minute)
def test_every_decoder_head_trains_on_every_family_through_pretrain(tmp_path):
    """benchmarks/llm_heads.py: llama2vec, ebae, ebar, mntp and contrastive through `pretrieve pretrain` on Llama,
    Qwen2, Qwen3 and Mistral from one init_from each, weight decay off: each logs its own parts, lowers its loss, moves
    every base weight (a gradient reached it) and exports its family and method with last-token pooling; with
    LoRA the base weights stay bit-identical (ebar on Llama with activation checkpointing)."""
    out = tmp_path / "llm_heads.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.llm_heads", "--steps", "40", "--work",
                           str(tmp_path / "work"), "--out", str(out)], env=pretrain_env(), capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    heads = ("llama2vec", "ebae", "ebar", "mntp", "contrastive", "llama2vec-lora")
    assert sorted(runs) == sorted(f"{head}-{family}" for head in heads for family in ("llama", "qwen2", "qwen3", "mistral"))
    own = {"llama2vec": {"ebae", "ebar", "lm"}, "ebae": {"ebae", "lm"}, "ebar": {"ebar", "lm"}, "mntp": {"mntp"},
           "contrastive": {"qd", "accuracy"}}
    for name, run in runs.items():
        head = name.rsplit("-", 1)[0]
        assert run["ok"] and run["loss_last_quarter"] < run["loss_first_quarter"], (name, run)
        assert own[head.removesuffix("-lora")] <= set(run["parts"]), (name, run["parts"])
        assert not {"ebae", "ebar"} - own[head.removesuffix("-lora")] & set(run["parts"]), (name, run["parts"])
        assert run["moved"] == (0 if head.endswith("-lora") else run["base_weights"]), (name, run)


def test_eval_pools_a_llama2vec_export_after_its_prompts(llm, tmp_path):
    """`--pooling llama2vec`: a passage is read as training read it, <bos> " text + EBAE's prompt (the ebae
    collator's row), a query with EBAR's prompt; its vector is the mean of the prompt's 8 special states,
    normalised. Checked against the states of the exported head."""
    from pretrieve.eval.encode import DenseEncoder, EncodeOptions
    from pretrieve.models.export import export

    method, options, model, vocab, samples = _setup(llm)
    head = method.build(options, model, seed=0).eval()
    export(head, tmp_path / "export", tokenizer=llm[0])
    encoder = DenseEncoder(tmp_path / "export", EncodeOptions("llama2vec", max_length=96, batch_size=2,
                                                              normalize=True))
    tokenizer = load_tokenizer(llm[0])
    for queries, task in ((False, "ebae"), (True, "ebar")):
        spec = get_method(task)
        collate = spec.collator.from_options(spec.options_from({"max_len": 96}), vocab)
        rows = [collate.row(np.array(tokenizer(text, add_special_tokens=False)["input_ids"]))[0] for text in TEXTS]
        expected = []
        with torch.no_grad():
            for ids in rows:
                ids = torch.from_numpy(ids)[None]
                states = head.encoder(ids, torch.ones_like(ids))[0, -8:]
                assert (ids[0, -8:] == torch.tensor([vocab.tokens.index(t) for t in LLM_RESERVED])[
                    slice(0, 8) if task == "ebae" else slice(8, 16)]).all()
                expected.append(F.normalize(states.mean(dim=0), dim=-1))
        np.testing.assert_allclose(encoder.encode(TEXTS, progress=False, queries=queries),
                                   torch.stack(expected).numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no export of llama2vec, ebae, ebar"):
        DenseEncoder(llm[0], EncodeOptions("llama2vec"))


def released_checkpoint(llm, out: Path, family: str, tied: bool) -> Path:
    """A tiny `*ForCausalLM` of `family` saved as such models are released: the LM head tied to the word
    embeddings (not saved) or untied (`lm_head.weight`, as LLaMA-2-7B, Mistral-7B and Qwen3 >= 4B ship it)."""
    from transformers import AutoModelForCausalLM

    vocab = Vocabulary.of_tokenizer(llm[0])
    config = ModelOptions(backbone=family, vocab_size=vocab.size, hidden_size=32, num_layers=2, num_heads=2,
                          intermediate_size=64, pad_token_id=vocab.pad_id, dropout=0.0).hf_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def llara_loss(lm, batch: dict, pad_id: int) -> torch.Tensor:
    """LLARA's loss (FlagEmbedding research/LLARA/pretrain/modeling.py, PreLlamaModel.forward) restated on the
    released `lm` (its own LM head) for pretrieve's `batch`, laid out as LLARA lays it out: each row left-padded,
    ending in the EBAE prompt (S tokens) then the EBAR prompt (P tokens); position ids counted from the row's
    first column, the last P copied from the S + P before the last S; a causal mask over real tokens whose last
    P rows do not see the S columns before them. Logits are the LM head's, in fp32. L_ar: the mean next-token
    cross-entropy over the labelled tokens. Per task: the 8 special logits (EBAE: the 8 before the last P
    columns, EBAR: the last 8) max-pooled, log-softmax, minus the mean over the bag's distinct ids; averaged over
    the rows with a bag, / 10; a task with no bag in the batch is 0. L = L_ar + the mean of the tasks that are
    not 0, or L_ar alone. (LLARA's bags are its targets' ids > 2, Llama 2's specials left out; pretrieve's
    bags are given here.)"""
    real = batch["attention_mask"].bool()
    size, width = len(real), int(real.sum(1).max())
    summary, predict = int((batch["segments"][0] == SUMMARY).sum()), int((batch["segments"][0] == PREDICT).sum())
    ids = torch.full((size, width), pad_id)
    labels = torch.full((size, width), -100)
    attention = torch.zeros(size, width, dtype=torch.long)
    for b in range(size):
        n = int(real[b].sum())
        ids[b, width - n:], labels[b, width - n:] = batch["input_ids"][b, :n], batch["mlm_labels"][b, :n]
        attention[b, width - n:] = 1
    positions = torch.arange(width).repeat(size, 1)
    positions[:, -predict:] = positions[:, -predict - summary:-summary].clone()
    low = torch.finfo(torch.float32).min
    mask = torch.full((width, width), low).triu(1)[None, None].repeat(size, 1, 1, 1)
    mask = mask.masked_fill(attention[:, None, None, :] == 0, low)
    mask[:, :, -predict:, -predict - summary:-predict] = low
    hidden = lm.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    logits = lm.lm_head(hidden).float()
    ar = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    bows = []
    for task, special in (("ebae", logits[:, -predict - 8:-predict]), ("ebar", logits[:, -8:])):
        logp = special.max(dim=1).values.log_softmax(dim=1)
        loss, rows = 0, 0
        for p, bag in zip(logp, batch[f"{task}_targets"]):
            bag = torch.unique(bag[bag >= 0])
            if len(bag) > 0:
                loss, rows = loss - p[bag].mean(), rows + 1
        bows.append(loss / rows / 10 if rows else 0)
    bow = [loss for loss in bows if torch.is_tensor(loss) and loss > 0]
    return ar + sum(bow) / len(bow) if bow else ar


@pytest.mark.parametrize("family,tied", [("llama", False), ("mistral", False), ("qwen3", True)])
@pytest.mark.parametrize("targets", ["both", "ebae", "ebar"])
def test_loss_and_gradients_are_llaras_on_a_released_checkpoint(llm, tmp_path, family, tied, targets):
    """`llama2vec` from `model.init_from` a released-style checkpoint, tied or untied (LLaMA-2-7B's kind), on
    batches whose bags are all there or hold one task's targets only (the other's emptied): its loss and every
    gradient equal LLARA's loss restated above on HF's own *ForCausalLM of the same checkpoint."""
    from transformers import AutoModelForCausalLM

    path = released_checkpoint(llm, tmp_path / "released", family, tied)
    method, options, _, vocab, samples = _setup(llm)
    head = method.build(options, ModelOptions(init_from=str(path)), seed=0).eval()
    assert (head.encoder.lm_head is None) == tied and head.encoder.mlm_bias is None
    batch = method.collator.from_options(options, vocab)(samples)
    for task in {"ebae": ["ebar"], "ebar": ["ebae"], "both": []}[targets]:
        batch[f"{task}_targets"] = torch.full_like(batch[f"{task}_targets"], -1)  # a batch without that task's
    ours = head(batch)["loss"]
    ours.backward()
    lm = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (lm.lm_head.weight is lm.model.embed_tokens.weight) == tied
    theirs = llara_loss(lm, batch, vocab.pad_id)
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=2e-6, atol=2e-6)
    grads = {f"model.{name}": p.grad for name, p in lm.model.named_parameters()}
    if not tied:
        grads["lm_head.weight"] = lm.lm_head.weight.grad
    mine = {name: p.grad for name, p in head.encoder.named_parameters()}
    assert sorted(mine) == sorted(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(mine[name], grad, rtol=1e-4, atol=2e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_an_untied_lm_head_survives_training_checkpoint_export_and_init_from(llm, tmp_path):
    """The untied LM head a checkpoint ships is read by init_from (the load report names nothing), trained,
    kept by a run's checkpoint (read back into the head rebuilt from the run's encoder config, as `pretrieve
    export RUN` does), exported beside the base model, and read again by init_from of the export: the same
    weights and the same loss at each stage."""
    from pretrieve.engine.checkpoint import load_checkpoint_weights
    from pretrieve.models.encoder import HEAD_WEIGHTS, Encoder, read_weights
    from pretrieve.models.export import export

    path = released_checkpoint(llm, tmp_path / "released", "llama", tied=False)
    released = read_weights(path)["lm_head.weight"]
    method, options, _, vocab, samples = _setup(llm)
    head = method.build(options, ModelOptions(init_from=str(path)), seed=0)
    assert head.encoder.load_report == [] and torch.equal(head.encoder.lm_head.weight, released)
    batch = method.collator.from_options(options, vocab)(samples)
    head.train()
    adamw_steps(head, batch, steps=2, lr=1e-2)
    trained = head.encoder.lm_head.weight.detach().clone()
    assert not torch.equal(trained, released)
    head.eval()
    with torch.no_grad():
        loss = head(batch)["loss"]

    head.encoder.config.to_json_file(tmp_path / "encoder_config.json")  # a run's checkpoint, ZeRO 0's layout
    (tmp_path / "checkpoints" / "step2").mkdir(parents=True)
    torch.save({"module": head.state_dict()}, tmp_path / "checkpoints" / "step2" / "mp_rank_00_model_states.pt")
    rebuilt = method.head(Encoder.from_config_file(tmp_path / "encoder_config.json"), options)
    load_checkpoint_weights(rebuilt, tmp_path / "checkpoints", "step2")
    assert torch.equal(rebuilt.encoder.lm_head.weight, trained)
    export(rebuilt.eval(), tmp_path / "export", tokenizer=llm[0])
    assert torch.equal(read_weights(tmp_path / "export", HEAD_WEIGHTS)["encoder.lm_head.weight"], trained)
    again = method.build(options, ModelOptions(init_from=str(tmp_path / "export")), seed=1).eval()
    assert again.encoder.load_report == [] and torch.equal(again.encoder.lm_head.weight, trained)
    with torch.no_grad():
        torch.testing.assert_close(again(batch)["loss"], loss, rtol=1e-6, atol=1e-6)


def test_lora_keeps_an_untied_lm_head_frozen_as_tied_embeddings_are(llm, tmp_path):
    """With LoRA, the base model's weights are frozen, the word embeddings with them; an untied LM head is the
    checkpoint's too, and stays frozen: only the adapters train."""
    from pretrieve.models.lora import LoraOptions

    path = released_checkpoint(llm, tmp_path / "released", "mistral", tied=False)
    method, options, _, _, _ = _setup(llm)
    head = method.build(options, ModelOptions(init_from=str(path), lora=LoraOptions(r=4)), seed=0)
    trained = {name for name, p in head.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained) and not head.encoder.lm_head.weight.requires_grad
