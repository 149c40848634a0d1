"""Fine-tuning: example readers and their errors, group batches (resume, ranks), the losses of eqs. 13-15 and
SEED's triplet loss against their formulas, cross-device negatives on two gloo ranks, CoT-MoTE routing, and
the three stages end to end (each lowers its loss; the result evaluates)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from support import SAMPLES
from transformers import AutoTokenizer, BertConfig

from pretrieve.config import ConfigError
from pretrieve.data.retrieval import RetrievalDataError, load_beir
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
from pretrieve.finetune.batches import GroupLoader
from pretrieve.finetune.config import finetune_experiment
from pretrieve.finetune.examples import examples_from_ids, read_examples
from pretrieve.finetune.models import DualEncoder, contrastive_loss
from pretrieve.models.encoder import Encoder

pytestmark = pytest.mark.system

FLAG = SAMPLES / "finetune" / "embedder_retrieval_msmarco.jsonl"
SCIFACT = SAMPLES / "beir" / "scifact-sample"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER)


def test_example_readers_and_their_errors(tmp_path):
    flag = read_examples(FLAG)
    assert len(flag) == 10 and all(len(e.pos) == 1 and len(e.neg) == 25 and len(e.neg_scores) == 25 for e in flag)

    triples = tmp_path / "triples.tsv"
    triples.write_text("q1\tp1\tn1\nq1\tp1\tn2\nq2\tp2\tn3\n")
    assert [(e.query, e.pos, e.neg) for e in read_examples(triples)] == [("q1", ["p1"], ["n1", "n2"]),
                                                                        ("q2", ["p2"], ["n3"])]
    bad = {
        '{"query": "q", "pos": ["p"]}\n{"query": "q", "pos": [\n': "bad.jsonl:2: not JSON",
        '{"pos": ["p"]}\n': 'bad.jsonl:1: no "query" string',
        '{"query": "q", "pos": []}\n': 'bad.jsonl:1: "pos" is empty',
        '{"query": "q", "pos": ["p"], "neg": ["n"], "pos_scores": [1.0], "neg_scores": [1, 2]}\n':
            'bad.jsonl:1: "neg_scores" must be 1 numbers',
        '{"query": "q", "pos": ["p"], "pos_scores": [1.0]}\n': "bad.jsonl:1: give both",
    }
    for text, message in bad.items():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(RetrievalDataError, match=message):
            read_examples(tmp_path / "bad.jsonl")
    (tmp_path / "bad.tsv").write_text("q\tp\tn\nq\tp\n")
    with pytest.raises(RetrievalDataError, match="bad.tsv:2: expected query<TAB>positive<TAB>negative"):
        read_examples(tmp_path / "bad.tsv")

    data = load_beir(SCIFACT)
    qid, judged = next(iter(data.qrels.items()))
    other = next(d for d in data.corpus if d not in judged)
    (tmp_path / "hard.tsv").write_text(f"{qid}\t{next(iter(judged))},{other}\n")
    example = next(e for e in examples_from_ids(data, tmp_path / "hard.tsv") if e.query == data.queries[qid])
    assert example.neg == [data.doc_text(other)]  # the judged document left out
    (tmp_path / "hard.tsv").write_text(f"{qid}\tnot-a-doc\n")
    with pytest.raises(RetrievalDataError, match="hard.tsv:1: document not-a-doc is not in the corpus"):
        examples_from_ids(data, tmp_path / "hard.tsv")


def _texts(batch, tokenizer, key="query"):
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in batch[f"{key}_input_ids"]]


def test_group_loader_resumes_and_splits_global_batches_over_ranks(tokenizer):
    examples = read_examples(FLAG)

    def loader(**kw):
        args = dict(batch_size=2, negatives=3, query_max_len=16, passage_max_len=16, seed=7, teacher_scores=True)
        return GroupLoader(examples, tokenizer, **{**args, **kw})

    full = loader()
    straight = [b for _ in range(2) for b in full]  # two epochs of 5 batches
    assert len(straight) == 10 and full.state_dict() == {"epoch": 1, "examples": 10}
    assert straight[0]["passage_input_ids"].shape[0] == 2 * 4 and straight[0]["teacher_scores"].shape == (2, 4)
    first = loader()
    head = [b for _, b in zip(range(3), first)]
    second = loader()
    second.load_state_dict(first.state_dict())
    assert second.describe_position() == "epoch 0, 6 of its 10 examples read"  # the line a resumed run prints
    resumed = head + list(second) + list(second)
    for a, b in zip(straight, resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    epochs = [sorted(t for b in straight[i:i + 5] for t in _texts(b, tokenizer)) for i in (0, 5)]
    assert epochs[0] == epochs[1] and _texts(straight[0], tokenizer) != _texts(straight[5], tokenizer)  # reshuffled

    wide = loader(batch_size=4)
    ranks = [loader(rank=r, world=2) for r in (0, 1)]
    for global_batch, *parts in zip(wide, *ranks):
        assert _texts(global_batch, tokenizer) == [t for part in parts for t in _texts(part, tokenizer)]
        assert _texts(global_batch, tokenizer, "passage") == [t for p in parts for t in _texts(p, tokenizer, "passage")]
    one_rank = loader(rank=0, world=2)  # a checkpoint at 2 ranks, resumed at 1 rank with the same global batch
    next(iter(one_rank))
    alone = loader(batch_size=4)
    alone.load_state_dict(one_rank.state_dict())
    assert _texts(next(iter(alone)), tokenizer) == _texts(list(loader(batch_size=4))[1], tokenizer)

    short = read_examples(FLAG)[:2]
    short[0].neg = short[0].neg[:1]
    query, passages, _ = GroupLoader(short, tokenizer, 2, 3, 16, 16, seed=0).group(0)
    assert passages[1:] == [short[0].neg[0]] * 3  # too few negatives: repeated to the group size
    short[1].neg = []
    with pytest.raises(ValueError, match="no negatives, but finetune.negatives is 3"):
        GroupLoader(short, tokenizer, 2, 3, 16, 16, seed=0)


def _tiny_encoder(experts: bool = False) -> Encoder:
    torch.manual_seed(0)
    encoder = Encoder(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    if experts:
        encoder.add_query_experts()
        with torch.no_grad():
            for p in encoder.query_experts.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    return encoder.eval()


def test_losses_follow_their_equations(tokenizer):
    batch = next(iter(GroupLoader(read_examples(FLAG), tokenizer, 3, 2, 16, 24, seed=0, teacher_scores=True)))
    encoder = _tiny_encoder()
    for options in ({}, {"in_batch": False}, {"temperature": 0.05, "normalize": True}):
        model = DualEncoder(encoder, **options)
        q = model.embed(batch["query_input_ids"], batch["query_attention_mask"], queries=True)
        p = model.embed(batch["passage_input_ids"], batch["passage_attention_mask"], queries=False)
        t = options.get("temperature", 1.0)
        if options.get("in_batch", True):  # eq. 13 / 14: every passage of the batch, positives at 0, 3, 6
            expected = F.cross_entropy(q @ p.T / t, torch.tensor([0, 3, 6]))
        else:
            expected = F.cross_entropy(torch.stack([p[3 * i:3 * i + 3] @ q[i] for i in range(3)]) / t,
                                       torch.zeros(3, dtype=torch.long))
        torch.testing.assert_close(model(batch)["loss"], expected)
        if options.get("normalize"):
            torch.testing.assert_close(q.norm(dim=-1), torch.ones(3))
    model = DualEncoder(encoder, loss="triplet", margin=0.5)
    q = model.embed(batch["query_input_ids"], batch["query_attention_mask"], queries=True)
    p = model.embed(batch["passage_input_ids"], batch["passage_attention_mask"], queries=False)
    own = torch.stack([p[3 * i:3 * i + 3] @ q[i] for i in range(3)])
    triplet = torch.stack([F.relu(0.5 - (own[i, 0] - own[i, j])) for i in range(3) for j in (1, 2)]).mean()
    torch.testing.assert_close(model(batch)["loss"], triplet)
    sigma = torch.softmax(batch["teacher_scores"], dim=-1)  # eq. 15
    distill = -(sigma * torch.log_softmax(own, dim=-1)).sum(dim=-1).mean()
    torch.testing.assert_close(DualEncoder(encoder, loss="distill")(batch)["loss"], distill)


def test_text_experts_route_queries_and_passages(tokenizer):
    encoder = _tiny_encoder(experts=True)
    ids = tokenizer(["what causes tides"], return_tensors="pt")
    routed, plain = DualEncoder(encoder), DualEncoder(encoder, text_experts=False)
    as_query = routed.embed(ids["input_ids"], ids["attention_mask"], queries=True)
    as_passage = routed.embed(ids["input_ids"], ids["attention_mask"], queries=False)
    assert not torch.allclose(as_query, as_passage)  # the query experts differ from the passage FFNs
    torch.testing.assert_close(plain.embed(ids["input_ids"], ids["attention_mask"], queries=True), as_passage)


def _cross_device_worker(rank, world, port, q, p, results):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mine_q = q[2 * rank:2 * rank + 2].clone().requires_grad_(True)
    mine_p = p[6 * rank:6 * rank + 6].clone().requires_grad_(True)
    loss, _, target = contrastive_loss(mine_q, mine_p)
    loss.backward()
    results[rank] = (loss.item(), mine_q.grad, mine_p.grad, target.tolist())
    dist.destroy_process_group()


def test_cross_device_negatives_on_two_gloo_ranks():
    """Two ranks with two queries (groups of 3) each: every query scores all 12 passages, its positive at its
    global position; the ranks' mean loss and gradients are those of the one-process loss over the batch."""
    import socket

    import torch.multiprocessing as mp

    torch.manual_seed(1)
    q, p = torch.randn(4, 8, dtype=torch.float64), torch.randn(12, 8, dtype=torch.float64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_cross_device_worker, args=(2, port, q, p, results), nprocs=2, join=True, start_method="spawn")
    assert results[0][3] == [0, 3] and results[1][3] == [6, 9]
    full_q, full_p = q.clone().requires_grad_(True), p.clone().requires_grad_(True)
    full, _, _ = contrastive_loss(full_q, full_p)
    full.backward()
    assert (results[0][0] + results[1][0]) / 2 == pytest.approx(full.item(), rel=1e-6)  # the loss is fp32
    # each rank's gradient of its own loss, summed over ranks by the gathered backward, averaged by DeepSpeed
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]]) / 2, full_q.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([results[0][2], results[1][2]]) / 2, full_p.grad, rtol=1e-5, atol=1e-6)


def test_finetune_config_errors_name_the_key(tmp_path):
    base = {"finetune": {"init_from": str(tmp_path), "data": [str(FLAG)]}}
    for change, message in (({"finetune": {"loss": "hinge"}}, "finetune.loss: 'hinge'"),
                            ({"finetune": {"model": "tri"}}, "finetune.model: 'tri'"),
                            ({"finetune": {"model": "cross", "loss": "distill"}}, "is for the dual encoder"),
                            ({"finetune": {"beir": str(SCIFACT)}}, "give exactly one of"),
                            ({"finetune": {"data": ["missing.jsonl"]}}, r"finetune.data\[0\]: missing.jsonl"),
                            ({"finetune": {"init_from": "nowhere"}}, "finetune.init_from: 'nowhere'"),
                            ({"finetune": {"negatives": -1}}, "finetune.negatives"),
                            ({"finetune": {"negatives": "three"}}, "finetune.negatives: expected int, got 'three'"),
                            ({"finetune": {"temperature": 0}}, "finetune.temperature: must be > 0"),
                            ({"finetune": {"query_max_len": 0}}, "finetune.query_max_len: must be >= 3"),
                            ({"finetune": {"pool": "cls"}}, "finetune.pool: unknown key"),
                            ({"finetune": {"lora": {"rank": 8}}}, r"finetune.lora.rank: unknown key \(known: alpha"),
                            ({"finetune": {"lora": {"r": -1}}}, r"^finetune.lora.r: must be >= 0"),
                            ({"finetune": {"lora": 8}}, "finetune.lora: expected"),
                            ({"finetune": {"lora": {"r": 0, "targets": ["q_proj"]}}},
                             r"^finetune.lora.targets: set, but finetune.lora.r is 0: no LoRA, every weight"),
                            ({"finetune": {"model": "cross", "lora": {"r": 8}}}, "finetune.lora: for the dual encoder"),
                            # the cross-encoder scores [CLS] through a linear layer: these would change nothing
                            ({"finetune": {"model": "cross", "pooling": "sparse"}},
                             r"finetune.pooling: sparse is for the dual encoder's vectors; the cross-encoder"),
                            ({"finetune": {"model": "cross", "normalize": True}},
                             "finetune.normalize: True is for the dual encoder's vectors"),
                            ({"method": {"name": "mlm"}}, "method: unknown top-level key")):
        config = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(change))
        with pytest.raises(ConfigError, match=message):
            finetune_experiment(config)
    several = OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(
        {"finetune": {"loss": "hinge", "temperature": 0, "query_max_len": 0}, "train": {"lr": "fast"}}))
    with pytest.raises(ConfigError) as raised:
        finetune_experiment(several)  # each bad key, in one error
    assert [p.split(":")[0] for p in raised.value.problems] == [
        "train.lr", "finetune.query_max_len", "finetune.temperature", "finetune.loss"]
    with pytest.raises(ConfigError, match=r"finetune.init_from: .*: not a model directory"):
        finetune_experiment(OmegaConf.create(base))  # sound options: the folder is read, and is no model


def test_a_query_prompt_longer_than_query_max_len_leaves_each_query_its_own_tokens(tokenizer):
    """query_max_len counts a query's tokens after its prompt: an instruction longer than it does not make every
    query the same truncated prompt (the loss at ln 8, without a word)."""
    from pretrieve.finetune.batches import prompt_tokens

    examples = read_examples(FLAG)
    prompt = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
    assert prompt_tokens(tokenizer, prompt) > 8
    loader = GroupLoader(examples, tokenizer, 4, 1, 8, 16, seed=0, prompts=(prompt, ""))
    queries = _texts(loader.collate([0, 1, 2, 3]), tokenizer)
    said = tokenizer.decode(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    for text, example in zip(queries, examples[:4], strict=True):  # the prompt, then 8 - [CLS] - [SEP] of its own
        own = tokenizer.decode(tokenizer(example.query, add_special_tokens=False)["input_ids"][:6])
        assert text == f"{said} {own}", text
    assert len(set(queries)) == 4


def test_a_passage_prompt_that_leaves_no_room_is_refused(tiny_encoder):
    prompt = "Represent this passage of a scientific article for retrieving it: "  # 13 tokens, 15 with [CLS] [SEP]
    base = {"finetune": {"init_from": str(tiny_encoder), "data": [str(FLAG)], "passage_max_len": 15,
                         "query_max_len": 8, "query_prompt": prompt}}
    finetune_experiment(OmegaConf.create(base))  # the query prompt: on top of query_max_len
    with pytest.raises(ConfigError, match=r"^finetune.passage_prompt: takes 15 tokens \(the tokenizer's special "
                                          r"ones included\) of the 15 of finetune.passage_max_len, which counts "
                                          r"the prompt"):
        finetune_experiment(OmegaConf.merge(OmegaConf.create(base), {"finetune": {"passage_prompt": prompt}}))
    finetune_experiment(OmegaConf.merge(OmegaConf.create(base), {"finetune": {"passage_prompt": prompt,
                                                                              "passage_max_len": 16}}))


def test_a_query_prompt_past_the_models_positions_is_refused(tiny_encoder):
    """A query's row is its prompt and query_max_len of its own (the export's max_seq_length grows to it): past
    the model's 512 positions it could not be encoded, so the config is refused, naming the key."""
    base = {"finetune": {"init_from": str(tiny_encoder), "data": [str(FLAG)], "query_max_len": 32}}
    prompt = " ".join(["retrieve"] * 480)
    finetune_experiment(OmegaConf.merge(OmegaConf.create(base), {"finetune": {"query_prompt": prompt}}))  # 512
    with pytest.raises(ConfigError, match=r"^finetune.query_prompt: takes 481 tokens, which with the 32 of "
                                          r"finetune.query_max_len \(a query's own, after its prompt\) pass the 512 "
                                          r"positions of "):
        finetune_experiment(OmegaConf.merge(OmegaConf.create(base), {"finetune": {"query_prompt": prompt + " it"}}))


def test_the_prompt_override_of_the_docs_works_in_a_shell_and_a_bad_one_is_named():
    """docs/finetuning.md's command-line prompt, through bash as written, gives the prompt; the unquoted form
    (what a shell leaves of `finetune.query_prompt="Instruct: ...\nQuery: "`) is an error naming the override,
    not the config file."""
    import re
    import subprocess

    from pretrieve.config import load_config

    config = Path(__file__).resolve().parent.parent / "configs" / "finetune" / "tiny.yaml"
    docs = (Path(__file__).resolve().parent.parent / "docs" / "finetuning.md").read_text()
    written = re.search(r"`('finetune\.query_prompt=\"[^`]*\"')`", docs).group(1)
    argument = subprocess.run(["bash", "-c", f"printf %s {written}"], capture_output=True, text=True,
                              check=True).stdout
    loaded = load_config(config, [argument], required=("finetune",))
    assert loaded.finetune.query_prompt == ("Instruct: Given a web search query, retrieve relevant passages that "
                                            "answer the query\nQuery: ")
    unquoted = subprocess.run(["bash", "-c", 'printf %s finetune.query_prompt="Instruct: a task\\nQuery: "'],
                              capture_output=True, text=True, check=True).stdout
    with pytest.raises(ConfigError) as raised:
        load_config(config, [unquoted], required=("finetune",))
    assert str(raised.value).startswith("override 'finetune.query_prompt=Instruct: a task\\\\nQuery: ': mapping "
                                        "values are not allowed in this context; the value is read as YAML")
    assert "tiny.yaml" not in str(raised.value)


def _epoch_losses(run_dir: Path) -> dict:
    """A fine-tuning run's loss over the batches of its first epoch (dropout off), with its initial weights and
    with its final checkpoint."""
    from pretrieve.config import section
    from pretrieve.engine.checkpoint import load_checkpoint_weights
    from pretrieve.finetune.batches import PairLoader
    from pretrieve.finetune.config import FinetuneOptions
    from pretrieve.finetune.run import build_model, load_examples

    raw = OmegaConf.load(run_dir / "config.yaml")
    o = section(raw, "finetune", FinetuneOptions)
    loader = (GroupLoader if o.model == "dual" else PairLoader)(
        load_examples(o), AutoTokenizer.from_pretrained(o.init_from), raw.train.micro_batch_size, o.negatives,
        o.query_max_len, o.passage_max_len, raw.seed, teacher_scores=o.loss == "distill" and o.model == "dual")
    batches = list(loader)
    result = {}
    for when in ("before", "after"):
        model = build_model(o).eval()
        if when == "after":
            load_checkpoint_weights(model, run_dir / "checkpoints", (run_dir / "checkpoints" / "latest").read_text())
        with torch.no_grad():
            result[when] = sum(float(model(b)["loss"]) for b in batches) / len(batches)
    return result


@pytest.mark.integration  # three fine-tuning stages and their evaluations: make test's slowest (3 minutes)
def test_farm_fine_tunes_three_stages_each_lowering_its_loss(tmp_path):
    """A tiny CoT-MoTE export through the farm's stages 1-3 on the SciFact sample: one fine-tuning chain
    (stage 1, mining, stage 2, teacher, teacher scores, stage 3) then one evaluation job per stage."""
    from mlflow.tracking import MlflowClient

    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method
    from pretrieve.orchestrate.farm import run_farm

    torch.manual_seed(0)
    method = get_method("cotmote")
    export(method.build(method.options_from({"max_len": 64}),
                        ModelOptions(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256)),
           tmp_path / "pretrained")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({
        "out": str(tmp_path / "farm"), "workers": 2, "tracking": {"uri": uri, "experiment": "ft"},
        "eval": {"max_length": 96, "depth": 100},
        "checkpoints": [{"name": "mote", "model": str(tmp_path / "pretrained")}],
        "datasets": [{"name": "scifact", "beir": str(SCIFACT)}],
        "stages": ["stage1", "stage2", "stage3"],
        "finetune": {"config": str(Path(__file__).parent.parent / "configs" / "finetune" / "tiny.yaml"),
                     "beir": str(SCIFACT), "split": "test", "negatives": 3, "depth": 30}}))
    result = run_farm(farm, progress=False)  # its jobs are processes of their own
    assert not result["failed"] and result["ran"] == 4 and len(result["logged"]) == 3

    chain = tmp_path / "farm" / "mote" / "finetune"
    for run in ("stage1", "stage2", "teacher", "stage3"):
        loss = _epoch_losses(chain / run)
        assert loss["after"] < loss["before"], (run, loss)
    hard = read_examples(chain / "hard.jsonl")  # mined by the stage-1 model
    assert len(hard) == 100 and all(len(e.neg) == 3 and not set(e.neg) & set(e.pos) for e in hard)
    scored = read_examples(chain / "distill.jsonl")
    assert [e.neg for e in scored] == [e.neg for e in hard] and all(len(e.neg_scores) == 3 for e in scored)
    meta = json.loads((chain / "stage3" / "export" / "pretrieve_finetune.json").read_text())
    assert meta["query_experts"] and meta["text_experts"] and meta["loss"] == "distill"

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("ft").experiment_id])
    evals = {r.data.tags["stage"]: r for r in runs if r.data.tags.get("pretrieve.farm") == "eval"}
    assert sorted(evals) == ["stage1", "stage2", "stage3"]
    for stage, run in evals.items():
        metrics = json.loads((tmp_path / "farm" / "mote" / "scifact" / stage / "metrics.json").read_text())
        assert run.data.metrics["ndcg_at_10"] == pytest.approx(metrics["ndcg@10"]) and metrics["queries"] == 100
    assert sorted(r.data.tags["method"] for r in runs if "method" in r.data.tags) == \
        ["finetune-cross", "finetune-dual", "finetune-dual", "finetune-dual"]  # the chain's runs, same store
    assert run_farm(farm, progress=False)["ran"] == 0  # nothing left to do


def _tiny_dupmae_export(out: Path, lpu: str) -> Path:
    from pretrieve.models.encoder import ModelOptions
    from pretrieve.models.export import export
    from pretrieve.models.heads import get_method

    torch.manual_seed(0)
    method = get_method("dupmae")
    return export(method.build(method.options_from({"max_len": 64, "lpu": lpu}),
                               ModelOptions(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)), out)


def test_dupmae_pooling_trains_on_the_joint_score_of_eq_12(tmp_path, tokenizer):
    """Pooling `dupmae`: the loss is eq. 13 over eq. 12's scores (computed directly by JointRepresentation +
    joint_scores), gradients reach W^cls and the LPU, and other models are refused by name."""
    from pretrieve.eval.encode import EncodeOptions, VocabEncoder
    from pretrieve.models.encoder import load_encoder
    from pretrieve.models.export import load_export
    from pretrieve.models.representation import joint_scores, load_joint

    batch = next(iter(GroupLoader(read_examples(FLAG), tokenizer, 3, 2, 16, 24, seed=0)))
    for lpu in ("mlm_head", "linear"):
        path = _tiny_dupmae_export(tmp_path / lpu, lpu)
        encoder = load_encoder(path).eval()
        joint = load_joint(path, encoder, cls_dim=16, ot_topk=20)
        model = DualEncoder(encoder, pooling="dupmae", joint=joint)
        lpu_logits = load_export(path).lpu_logits  # the pre-training head's own eq. (6)

        def represent(kind):
            ids, mask = batch[f"{kind}_input_ids"], batch[f"{kind}_attention_mask"]
            return joint(encoder(ids, mask), mask, lpu_logits)

        with torch.no_grad():
            expected = F.cross_entropy(joint_scores(represent("query"), represent("passage")), torch.tensor([0, 3, 6]))
        loss = model(batch)["loss"]
        torch.testing.assert_close(loss, expected)
        loss.backward()
        lpu_weight = joint.lpu.weight if lpu == "linear" else encoder.mlm_transform.dense.weight
        assert joint.cls_proj.weight.grad.abs().sum() > 0 and lpu_weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="unnormalised inner product"):
        DualEncoder(encoder, pooling="dupmae", joint=joint, normalize=True)
    _tiny_encoder().model.save_pretrained(str(tmp_path / "bert"))
    with pytest.raises(ValueError, match="pooling dupmae needs a DupMAE export"):
        load_joint(tmp_path / "bert", _tiny_encoder())
    with pytest.raises(ValueError, match="pooling sparse needs the model's MLM head"):
        VocabEncoder(tmp_path / "bert", EncodeOptions("sparse"))


def test_dupmae_fine_tuning_exports_its_joint_score_to_eval(tmp_path):
    """`pretrieve finetune` with pooling dupmae lowers its loss; the export carries the learned W^cls and LPU,
    `pretrieve eval` uses them by default (its scores are the fine-tuned model's eq. 12), mining searches
    with them, and sentence-transformers loads the dense part."""
    import subprocess
    import sys

    from support import pretrain_env

    from pretrieve.eval.evaluate import EvalOptions, run_eval
    from pretrieve.finetune.mine import MineOptions, mine
    from pretrieve.models.encoder import load_encoder
    from pretrieve.models.representation import load_joint

    pretrained = _tiny_dupmae_export(tmp_path / "pretrained", "linear")
    run_dir = tmp_path / "stage1"
    config = Path(__file__).parent.parent / "configs" / "finetune" / "tiny.yaml"
    subprocess.run([sys.executable, "-m", "pretrieve", "finetune", str(config), f"finetune.init_from={pretrained}",
                    f"finetune.data=[{FLAG}]", "finetune.pooling=dupmae", "finetune.cls_dim=16",
                    "finetune.ot_topk=24", "finetune.passage_max_len=48", "train.micro_batch_size=4",
                    "train.max_steps=6", "checkpoint.every=6", f"run_dir={run_dir}"],
                   check=True, env=pretrain_env(OMP_NUM_THREADS="2"), capture_output=True)
    loss = _epoch_losses(run_dir)
    assert loss["after"] < loss["before"], loss

    export = run_dir / "export"
    encoder = load_encoder(export).eval()
    joint = load_joint(export, encoder)
    initial = load_joint(pretrained, load_encoder(pretrained), cls_dim=16)
    assert joint.ot_topk == 24 and not torch.allclose(joint.cls_proj.weight, initial.cls_proj.weight)

    data = load_beir(SCIFACT)
    mini = tmp_path / "mini"
    (mini / "qrels").mkdir(parents=True)
    query_ids, doc_ids = list(data.queries)[:4], list(data.corpus)[:30]
    (mini / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": data.corpus[d][0],
                                                           "text": data.corpus[d][1]}) + "\n" for d in doc_ids))
    (mini / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": data.queries[q]}) + "\n"
                                                for q in query_ids))
    (mini / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t1\n" for q, d in zip(query_ids, doc_ids)))  # evaluated: the judged queries
    result = run_eval(EvalOptions(out=str(tmp_path / "eval"), model=str(export), beir=str(mini), max_length=48,
                                  depth=30, progress=False))
    assert result["retriever"] == "dupmae" and result["vocab_top_k"] == 24  # the fine-tuned pooling and k

    model = DualEncoder(encoder, pooling="dupmae", joint=joint)
    tokens = AutoTokenizer.from_pretrained(export)
    with torch.no_grad():
        q = tokens([data.queries[i] for i in query_ids], truncation=True, max_length=48, padding=True,
                   return_tensors="pt")
        d = tokens([data.doc_text(i) for i in doc_ids], truncation=True, max_length=48, padding=True,
                   return_tensors="pt")
        scores = model.embed(q["input_ids"], q["attention_mask"], queries=True) @ \
            model.embed(d["input_ids"], d["attention_mask"], queries=False).T
    lines = [line.split() for line in (tmp_path / "eval" / "run.trec").read_text().splitlines()]
    got = {(qid, doc): float(score) for qid, _, doc, _, score, _ in lines}
    assert len(got) == 4 * 30
    for (qid, doc), score in got.items():
        assert score == pytest.approx(scores[query_ids.index(qid), doc_ids.index(doc)].item(), rel=1e-4, abs=1e-4)

    hard = tmp_path / "new" / "hard.jsonl"  # its folder does not exist yet
    mined = mine(MineOptions(model=str(export), out=str(hard), data=[str(FLAG)], depth=20, negatives=3,
                             max_length=48, progress=False))
    assert mined["pooling"] == "dupmae" and mined["queries_with_fewer_negatives"] == 0
    assert all(len(e.neg) == 3 and not set(e.neg) & set(e.pos) for e in read_examples(hard))

    # sentence-transformers gets eq. 12's dense part only: [CLS] through the learned W^cls (its Dense module)
    sentence_transformers = pytest.importorskip("sentence_transformers")  # the dev extra
    dense = sentence_transformers.SentenceTransformer(str(export), device="cpu").encode(
        [data.queries[i] for i in query_ids], convert_to_tensor=True)
    with torch.no_grad():
        torch.testing.assert_close(dense, joint.cls_proj(encoder(q["input_ids"], q["attention_mask"])[:, 0]),
                                   atol=1e-5, rtol=0)


def test_finetune_stages_runs_each_fine_tuning_over_nproc_ranks(tmp_path, tokenizer):
    """`--nproc 2`: stage 1 as two ranks (the first in-batch loss spans both ranks' passages: ~ln 4 for a random
    encoder, ln 2 on one rank); SIGUSR1 to the chain reaches both ranks, which checkpoint and exit 85; the
    re-run resumes and finishes; a bad override fails before any rank starts."""
    import math
    import os
    import signal
    import threading
    import time

    from pretrieve.engine.preemption import Preempted
    from pretrieve.orchestrate.finetune_stages import StagesOptions, run_stages

    _tiny_encoder().model.save_pretrained(str(tmp_path / "bert"))
    tokenizer.save_pretrained(str(tmp_path / "bert"))
    run_dir = tmp_path / "chain" / "stage1"
    options = StagesOptions(model=str(tmp_path / "bert"), out=str(tmp_path / "chain"), up_to="stage1",
                            config=str(Path(__file__).parent.parent / "configs" / "finetune" / "tiny.yaml"),
                            data=[str(FLAG)], nproc=2,
                            # steps enough that the signal lands before the last on a loaded machine
                            overrides=["train.micro_batch_size=2", "train.max_steps=24", "checkpoint.every=24"])
    with pytest.raises(ConfigError, match="train.micro_batch_size"):
        run_stages(StagesOptions(**{**options.__dict__, "overrides": ["train.micro_batch_size=0"]}))

    def preempt_after_the_first_step():
        while not (run_dir / "metrics.jsonl").is_file():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=preempt_after_the_first_step, daemon=True).start()
    with pytest.raises(Preempted):
        run_stages(options)
    stopped = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert 1 <= stopped < 24 and not (run_dir / "export").exists()
    assert run_stages(options) == {"stage1": str(run_dir / "export")}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))  # resumed after the preemption checkpoint
    assert records[0]["loss"] == pytest.approx(math.log(4), abs=0.02)


def test_the_teacher_stage_leaves_the_dual_stages_pooling_out(tmp_path, tokenizer):
    """A base config pooling `mean` with `normalize` (an E5-style dual encoder): the chain's cross-encoder teacher,
    which refuses both, trains without them. The dual stages are done (their exports in place, as a re-run of the
    chain finds them), so the teacher trains, then scores the hard negatives."""
    from pretrieve.finetune.run import FINETUNE_META
    from pretrieve.orchestrate.finetune_stages import StagesOptions, run_stages

    _tiny_encoder().model.save_pretrained(str(tmp_path / "bert"))
    tokenizer.save_pretrained(str(tmp_path / "bert"))
    chain = tmp_path / "chain"
    for stage in ("stage1", "stage2", "stage3"):
        (chain / stage / "export").mkdir(parents=True)
        (chain / stage / "export" / FINETUNE_META).write_text("{}")
    (chain / "hard.jsonl").write_text(FLAG.read_text())
    base = OmegaConf.load(Path(__file__).parent.parent / "configs" / "finetune" / "tiny.yaml")
    base.finetune.pooling, base.finetune.normalize = "mean", True
    OmegaConf.save(base, tmp_path / "e5.yaml")
    run_stages(StagesOptions(model=str(tmp_path / "bert"), out=str(chain), config=str(tmp_path / "e5.yaml"),
                             data=[str(FLAG)], negatives=3, overrides=["train.max_steps=2", "checkpoint.every=2"]))
    assert json.loads((chain / "teacher" / "export" / FINETUNE_META).read_text())["model"] == "cross"
    assert (chain / "distill.jsonl").is_file()


def test_finetune_stages_passes_ctrl_c_to_its_ranks_once_and_holds_signals_from_its_start(tmp_path, tokenizer,
                                                                                          sigint_at_default):
    """Ctrl-C to the chain's process group (`finetune-stages --nproc 2`, as a terminal sends it): its ranks, each
    in a session of its own, get SIGINT once, from the chain, save a checkpoint at one step and end by SIGINT;
    rank 0 and the chain say where, one line each. A SIGUSR1 at the chain's first moment is held: it exits 85
    before any rank starts."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from support import pretrain_env, signal_in_mask

    _tiny_encoder().model.save_pretrained(str(tmp_path / "bert"))
    tokenizer.save_pretrained(str(tmp_path / "bert"))

    def chain(out: Path, **popen) -> subprocess.Popen:
        return subprocess.Popen([
            sys.executable, "-m", "pretrieve", "finetune-stages", "--model", str(tmp_path / "bert"), "--out", str(out),
            "--config", str(Path(__file__).parent.parent / "configs" / "finetune" / "tiny.yaml"), "--data", str(FLAG),
            "--up-to", "stage1", "--nproc", "2", "--set", "train.micro_batch_size=2", "--set", "train.max_steps=20",
            "--set", "checkpoint.every=20"], env=pretrain_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, **popen)

    early = chain(tmp_path / "early")
    while early.poll() is None and not signal_in_mask(early.pid, signal.SIGUSR1, "SigCgt"):
        time.sleep(0.001)
    early.send_signal(signal.SIGUSR1)
    _, err = early.communicate(timeout=300)
    assert early.returncode == 85, err[-2000:]
    assert "pretrieve finetune-stages: preempted, during start-up, before the first step; exit 85" in err
    assert not (tmp_path / "early" / "stage1").exists()

    run_dir = tmp_path / "chain" / "stage1"
    proc = chain(tmp_path / "chain", start_new_session=True)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (
            (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
        time.sleep(0.05)
    assert signal_in_mask(proc.pid, signal.SIGINT, "SigCgt")
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGINT, err[-3000:]
    stopped = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert 1 <= stopped < 20 and not (run_dir / "export").exists()
    saved = run_dir / "checkpoints" / f"step{stopped:08d}"
    assert [line for line in err.splitlines() if "interrupt" in line.lower()] == [
        f"pretrieve finetune: interrupted: saved step {stopped} to {saved}; resume with resume=auto",
        f"pretrieve finetune-stages: interrupted in stage1 (its latest checkpoint: {saved}); run the same command "
        "again to continue"], err[-3000:]
    assert "Traceback" not in err
