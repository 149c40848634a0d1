"""The quality study's protocol parts that need no training (pretrieve/study/): the paired bootstrap
and its summaries, the labelled fine-tuning set (deterministic, no evaluated query in it), the settings of each
scale (studies/quality/<scale>.yaml, studies/recipe/<scale>.yaml) and their fixing before any result. The
end-to-end run is tests/test_quality_benchmark.py."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pretrieve.cli import main as cli
from pretrieve.study import data as quality_data
from pretrieve.study import plan as quality_plan
from pretrieve.study import stats as quality_stats
from pretrieve.study.study_file import load_study

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "pretrieve" / "assets" / "samples"
RECIPE_SCALES = ("cpu", "gpu-short")


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # a study file's paths (the studies it builds on, configs) are the working directory's


def _study(name: str):
    """studies/NAME.yaml, read from the repository's root (its paths are the working directory's)."""
    return load_study(ROOT / "studies" / f"{name}.yaml")


def _plan(scale: str, smoke: bool = False, beir: list[str] = (), sets: list[str] = ()) -> dict:
    """The quality study's settings at `scale`, as `pretrieve study plan studies/quality/SCALE.yaml` fixes them."""
    study = _study(f"quality/{scale}")
    return quality_plan.build_plan(study.settings, study.scale, smoke, list(beir), list(sets))


# --- statistics -------------------------------------------------------------------------------------------
def _queries(values) -> dict[str, float]:
    return {f"q{i}": float(v) for i, v in enumerate(values)}


def test_paired_bootstrap_sees_a_small_shift_that_query_spread_would_hide():
    """+0.01 on every query of a set whose queries differ by +-0.3: pairing by query finds it (interval above
    0); an unpaired comparison of the two means could not (their own intervals are ~100x wider)."""
    rng = np.random.default_rng(1)
    base = rng.uniform(0.2, 0.8, size=300)
    arm, ref = {"d": _queries(base + 0.01)}, {"d": _queries(base)}
    result = quality_stats.paired(arm, ref, resamples=2000, seed=0)
    assert result["diff"] == pytest.approx(0.01, abs=1e-5)
    assert 0 < result["ci95"][0] <= 0.01 <= result["ci95"][1] and result["p"] < 0.001
    own = quality_stats.interval({"d": np.array(list(arm["d"].values()))}, 2000, 0)
    assert own["ci95"][1] - own["ci95"][0] > 10 * (result["ci95"][1] - result["ci95"][0])


def test_paired_bootstrap_of_an_arm_with_itself_and_of_noise():
    rng = np.random.default_rng(2)
    scores = {"d": _queries(rng.uniform(size=200))}
    same = quality_stats.paired(scores, scores, resamples=1000, seed=0)
    assert same["diff"] == 0 and same["ci95"] == [0, 0] and same["p"] == 1.0
    noise = {"d": {q: v + rng.normal(0, 0.05) for q, v in scores["d"].items()}}
    result = quality_stats.paired(noise, scores, resamples=1000, seed=0)
    assert result["ci95"][0] < result["diff"] < result["ci95"][1]


def test_the_average_over_datasets_weighs_each_dataset_the_same():
    """A 10-query set at 1.0 and a 1000-query set at 0.0 average to 0.5 (a pooled query mean would say ~0.01)."""
    values = {"small": np.ones(10), "large": np.zeros(1000)}
    assert quality_stats.interval(values, 500, 0)["mean"] == 0.5


def test_seed_mean_refuses_seeds_that_scored_other_queries():
    with pytest.raises(ValueError, match="other queries"):
        quality_stats.seed_mean([{"a": 1.0, "b": 0.0}, {"a": 1.0}])
    assert quality_stats.seed_mean([{"a": 1.0}, {"a": 0.0}]) == {"a": 0.5}


def test_summarize_compares_every_arm_with_none_and_mlm():
    rng = np.random.default_rng(3)
    runs = {arm: {name: [_queries(rng.uniform(size=50)) for _ in range(2)] for name in ("d", "e")}
            for arm in ("none", "mlm", "retromae")}
    summary = quality_stats.summarize(runs, ("none", "mlm"), resamples=500, seed=0)
    assert set(summary["none"]["d"]) == {"mean", "ci95", "ndcg@10", "vs_mlm"}
    assert {"vs_none", "vs_mlm"} <= set(summary["retromae"]["d"]) and "vs_mlm" not in summary["mlm"]["d"]
    assert len(summary["retromae"]["d"]["ndcg@10"]) == 2 and set(summary["retromae"]) == {"d", "e", "average"}
    expected = np.mean([np.mean([runs["retromae"]["d"][s][q] for s in range(2)]) for q in runs["retromae"]["d"][0]])
    assert summary["retromae"]["d"]["mean"] == pytest.approx(expected, abs=1e-5)
    average = summary["retromae"]["average"]
    assert average["mean"] == pytest.approx((summary["retromae"]["d"]["mean"] + summary["retromae"]["e"]["mean"]) / 2,
                                            abs=1e-5)
    assert "average" not in quality_stats.summarize({"none": {"d": runs["none"]["d"]}}, ("none",), 100, 0)["none"]


# --- the labelled set -------------------------------------------------------------------------------------
def _records(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture()
def beir_with_train(tmp_path) -> Path:
    """The bundled SciFact sample with its judged queries split in two: odd positions train, even test."""
    folder = tmp_path / "scifact"
    shutil.copytree(SAMPLES / "beir" / "scifact-sample", folder)
    header, *rows = (folder / "qrels" / "test.tsv").read_text().splitlines()
    queries = list(dict.fromkeys(row.split("\t")[0] for row in rows))
    train = {q for i, q in enumerate(queries) if i % 2}
    for split, keep in (("train", lambda q: q in train), ("test", lambda q: q not in train)):
        lines = [row for row in rows if keep(row.split("\t")[0])]
        (folder / "qrels" / f"{split}.tsv").write_text("\n".join([header, *lines]) + "\n")
    return folder


def test_labelled_set_is_deterministic_and_well_formed(tmp_path, beir_with_train):
    wiki = SAMPLES / "wikipedia" / "wiki_00.jsonl.gz"
    first = quality_data.build_labelled(tmp_path / "a" / "set.jsonl", wiki, [beir_with_train], 60, seed=0)
    again = quality_data.build_labelled(tmp_path / "b" / "set.jsonl", wiki, [beir_with_train], 60, seed=0)
    other = quality_data.build_labelled(tmp_path / "c" / "set.jsonl", wiki, [beir_with_train], 60, seed=1)
    assert first["sha256"] == again["sha256"] != other["sha256"]
    assert first["examples"]["wikipedia-titles"] > 50 and first["examples"]["scifact-train"] > 10
    titles, positives = quality_data.title_pairs(wiki, 60, 0)
    owner = {p: t for t, p in zip(titles, positives)}
    examples = _records(first["path"])
    for example in examples[:first["examples"]["wikipedia-titles"]]:
        assert owner[example["pos"][0]] == example["query"]
        assert example["neg"][0] != example["pos"][0] and owner[example["neg"][0]] != example["query"]
    from pretrieve.finetune.examples import read_examples

    assert len(read_examples(first["path"])) == len(examples)  # pretrieve finetune's reader takes it


def test_labelled_set_holds_no_evaluated_query(tmp_path, beir_with_train):
    from pretrieve.data.retrieval import load_beir

    labelled = quality_data.build_labelled(tmp_path / "set.jsonl", SAMPLES / "wikipedia" / "wiki_00.jsonl.gz",
                                           [beir_with_train], 60, seed=0)
    quality_data.check_no_leak(Path(labelled["path"]), {"scifact": beir_with_train})
    test = load_beir(beir_with_train, "test")
    texts = {quality_data.normalized(e["query"]) for e in _records(labelled["path"])}
    positives = {p for e in _records(labelled["path"]) for p in e["pos"]}
    assert not texts & {quality_data.normalized(test.queries[q]) for q in test.qrels}
    assert not any(quality_data.normalized(test.queries[q]) in texts and test.doc_text(d) in positives
                   for q in test.qrels for d in test.qrels[q])
    # a set built from the test split itself is refused, naming the line and the query
    (beir_with_train / "qrels" / "train.tsv").write_text((beir_with_train / "qrels" / "test.tsv").read_text())
    leaking = quality_data.build_labelled(tmp_path / "leak.jsonl", SAMPLES / "wikipedia" / "wiki_00.jsonl.gz",
                                          [beir_with_train], 60, seed=0)
    with pytest.raises(ValueError, match=r"leak\.jsonl:\d+: the query is scifact's test query"):
        quality_data.check_no_leak(Path(leaking["path"]), {"scifact": beir_with_train})


# --- settings ---------------------------------------------------------------------------------------------
def test_scales_follow_the_protocol():
    cpu, gpu = _plan("cpu"), _plan("gpu")
    for plan in (cpu, gpu):
        assert all(plan["general"]["arms"][arm] >= 3 for arm in ("none", "mlm", "retromae", "dupmae"))
        assert set(plan["domain"]["bases"]) == {"base", "minilm"}
    # the cpu study ran its arms; the arms added since (bow, condenser, cocondenser, simlm) are for the gpu scales:
    # the CPU arms tie
    assert set(cpu["general"]["arms"]) == set(quality_plan.CPU_ARMS) < set(quality_plan.ARMS)
    assert set(gpu["general"]["arms"]) == set(gpu["pooling"]) == set(quality_plan.ARMS)
    assert {"bow", "condenser", "cocondenser", "simlm", "lexmae"} <= \
        set(_plan("gpu-short")["general"]["arms"])
    assert gpu["pooling"]["bow"] == "cls"
    assert cpu["pooling"]["dupmae"] == gpu["pooling"]["dupmae"] == "dupmae"  # eq. 12
    assert {cpu["pooling"][arm] for arm in ("retromae", "seed", "costa", "cotmae")} == {"cls"}
    assert gpu["model"]["hidden_size"] == 512 and 4 <= gpu["model"]["num_layers"] <= 8
    assert gpu["base"]["steps"] * gpu["base"]["batch"] * gpu["max_len"] >= 0.5e9
    smoke = _plan("gpu", smoke=True)
    assert smoke["smoke"] and smoke["model"]["hidden_size"] == 64 and smoke["base"]["steps"] <= 4
    assert set(smoke["general"]["arms"].values()) == {1} and smoke["precision"] == "fp32"


def test_recipe_scales_follow_its_protocol(capsys):
    for scale in RECIPE_SCALES:
        recipe = _study(f"recipe/{scale}")
        budget, arms, plan = recipe.keys["budget"], recipe.keys["arms"], _plan(scale)
        assert budget["points"] == sorted(budget["points"]) and budget["points"][-1] == budget["steps"]
        assert all(point % budget["points"][0] == 0 for point in budget["points"])  # checkpoints every points[0]
        assert {run["pooling"] for run in budget["runs"].values()} == {"cls", "mean"}  # and a slower [CLS] run
        assert len([run for run in budget["runs"].values() if run["pooling"] == "cls"]) == 2
        # the arms' pre-training runs are the quality study's own: no arm or seed it lacks
        assert all(plan["general"]["arms"].get(arm, 0) >= seeds for arm, seeds in arms["arms"].items())
        assert arms["steps"] is None or arms["steps"] in budget["points"]
        assert arms["poolings"] == ["cls", "mean"]
        assert ("bow" in arms["arms"]) == (scale == "gpu-short")
    # an arms stage before its scale's budget is fixed is refused at once, before the data is looked at
    assert _study("recipe/gpu-short").keys["arms"]["steps"] is None
    assert cli(["study", "run", "studies/recipe/gpu-short.yaml", "--part", "arms", "--data", "/nonexistent"]) == 2
    assert "studies/recipe/gpu-short.yaml (arms.steps) is not chosen yet" in capsys.readouterr().err
    assert _study("recipe/gpu-short").results.name == "recipe-gpu-short.json"


def test_settings_overrides_and_extra_collections(tmp_path, beir_with_train):
    extra = shutil.copytree(beir_with_train, tmp_path / "claims")
    plan = _plan("cpu", beir=[str(extra)], sets=["pretrain.steps=8", 'general.arms={"none": 1, "retromae": 1}'])
    assert plan["pretrain"]["steps"] == 8 and plan["general"]["arms"] == {"none": 1, "retromae": 1}
    assert plan["general"]["beir"] == [str(extra.resolve())]
    with pytest.raises(ValueError, match="unknown key pretrain.stesp"):
        _plan("cpu", sets=["pretrain.stesp=7"])
    with pytest.raises(ValueError, match="general.arms: unknown arm 'bert'"):
        _plan("cpu", sets=['general.arms={"bert": 1}'])
    with pytest.raises(ValueError, match="pooling.mlm: 'max' is not"):
        _plan("cpu", sets=["pooling.mlm=max"])
    with pytest.raises(ValueError, match="curve.points: 3 must divide pretrain.steps"):
        _plan("cpu", sets=["curve.points=3"])
    with pytest.raises(ValueError, match="evaluated already"):
        _plan("cpu", beir=[str(beir_with_train)])  # named scifact, as SciFact itself
    with pytest.raises(ValueError, match="no qrels/test.tsv"):
        _plan("cpu", beir=[str(tmp_path)])


def test_settings_are_fixed_at_the_first_run(tmp_path):
    plan = _plan("cpu")
    first = quality_plan.fix_settings(tmp_path, plan)
    assert first["fixed_before_test_results"] and first["settings"] == plan
    assert quality_plan.fix_settings(tmp_path, _plan("cpu")) == first  # a resume
    changed = _plan("cpu", sets=["finetune.lr=0.001"])
    with pytest.raises(ValueError, match=r"finetune\.lr = 0\.0005; this run has 0\.001"):
        quality_plan.fix_settings(tmp_path, changed)


def test_every_arm_has_a_config_that_takes_its_own_overrides():
    """Each pre-training arm's tiny config loads with the arm's own overrides: cocondenser without GradCache."""
    from pretrieve.config import load_config
    from pretrieve.pretrain_config import method_options

    pretrain = _study("quality/cpu").config("pretrain")
    for arm in quality_plan.ARMS[1:]:
        config = load_config(ROOT / pretrain.replace("{arm}", arm), quality_plan.ARM_OVERRIDES.get(arm, []))
        method, options = method_options(config)
        assert method.name == arm and getattr(options, "grad_cache", None) is None
