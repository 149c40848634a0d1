"""`pretrieve scale plan`: parameter counts of the built models, FLOPs of engine/flops.py, the grid, bad studies."""

import json
from itertools import islice
from pathlib import Path

import pytest
import yaml

from pretrieve.cli import main as cli
from pretrieve.config import experiment, load_config
from pretrieve.scale.plan import StudyError, plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "pretrain"


def write_study(tmp_path, wiki_shards, **changes) -> Path:
    study = {"name": "grid", "methods": ["mlm", "retromae"], "config": str(CONFIGS / "tiny-{method}.yaml"),
             "sizes": {"h32": {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 128},
                       "h64": {"hidden_size": 64, "num_layers": 1, "num_heads": 4, "intermediate_size": 256}},
             "budgets": {"tokens": [2048, 8192]}, "seeds": [0],
             "train": {"batch_size": 4, "seq_len": 64, "lr": 1e-3, "base_width": 64,
                       "overrides": ["tracking.enabled=false"]},
             "data": {"manifests": [str(wiki_shards / "manifest.json")]}, "run": {"out": str(tmp_path / "study")}}
    study.update(changes)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def test_plan_counts_parameters_and_flops_of_the_real_models(tmp_path, wiki_shards, vocab):
    from pretrieve.data.stream import ShardStream
    from pretrieve.engine.flops import train_flops
    from pretrieve.models.encoder import Encoder

    study, points = plan(write_study(tmp_path, wiki_shards))
    assert [(p.method, p.size, p.steps) for p in points] == [
        (m, s, steps) for m in ("mlm", "retromae") for s in ("h32", "h64") for steps in (8, 32)]
    samples = list(islice(iter(ShardStream([wiki_shards / "manifest.json"], seed=0, shuffle_buffer=1)), 4))
    for point in points:
        exp = experiment(load_config(CONFIGS / f"tiny-{point.method}.yaml", point.overrides))
        bert = Encoder(exp.model.bert_config()).bert
        counted = {name: p.numel() for name, p in bert.named_parameters()}
        assert point.N == sum(n for name, n in counted.items() if name.startswith("encoder."))
        assert point.N_total == sum(n for name, n in counted.items() if not name.startswith("pooler."))
        assert point.D == point.steps * 4 * 64 and exp.train.max_steps == point.steps
        batch = exp.method.collator.from_options(exp.options, vocab, seed=0)(samples)
        assert point.C == train_flops(point.method, exp.options, exp.model.bert_config(), batch) * point.steps
        assert point.lr == pytest.approx(1e-3 * 64 / exp.model.hidden_size)  # the inverse-width rule
        assert exp.run_dir == tmp_path / "study" / "points" / point.id
    retromae, mlm = (next(p for p in points if p.method == m and p.size == "h64" and p.steps == 8)
                     for m in ("retromae", "mlm"))
    assert retromae.C > mlm.C and retromae.N == mlm.N  # the decoder costs compute, not retriever parameters


def test_plan_command_prints_the_grid_and_writes_the_run_list(tmp_path, wiki_shards, capsys):
    assert cli(["scale", "plan", str(write_study(tmp_path, wiki_shards)), "--flops-per-second", "1e9"]) == 0
    printed = capsys.readouterr().out
    listed = json.loads((tmp_path / "study" / "plan.json").read_text())
    assert listed["study"] == "grid" and len(listed["points"]) == 8
    first = listed["points"][0]
    assert f"| {first['id']} | mlm | h32 | {first['N']:,} | {first['N_total']:,} | 2,048 | 8 |" in printed
    total = sum(p["C"] for p in listed["points"])
    assert f"8 points, {total:.3g} FLOPs in all: {total / 1e9 / 3600:.3g} device-hours at 1e+09 FLOP/s" in printed


@pytest.mark.parametrize("change,message", [
    ({"methods": ["mlm", "retro"]}, r"methods\[1\]: 'retro' is not a registered method"),
    ({"sizes": {"odd": {"hidden_size": 30, "num_layers": 1, "num_heads": 4, "intermediate_size": 64}}},
     "sizes.odd: num_heads 4 does not divide hidden_size 30"),
    ({"budgets": {"tokens": [100]}}, r"budgets.tokens\[0\]: 100 gives 100 tokens, less than one batch \(4 x 64"),
    ({"budgets": {"flops": [1e12]}}, "budgets: give one of tokens"),
    ({"train": {"batch_size": 4}}, "train.batch_size .>= 1. and train.seq_len"),
    ({"config": str(CONFIGS / "tiny-{method}.yaml"), "train": {"batch_size": 4, "seq_len": 64,
                                                             "overrides": ["train.lr_schedule=step"]}},
     "point mlm-h32-D2.05e03-s0: train.lr_schedule: 'step'"),
])
def test_bad_studies_name_the_key(tmp_path, wiki_shards, change, message):
    with pytest.raises(StudyError, match=message):
        plan(write_study(tmp_path, wiki_shards, **change))
