"""Contrastive entropy (Fang et al. 2024; pretrieve/eval/contrastive.py): the formula on a hand-made case, the
fixed negatives (uniform, without the query's relevant documents, the same for every model), its direction,
the hybrid scorer, and `pretrieve eval --contrastive-entropy` on the bundled SciFact sample."""

import json
import math

import numpy as np
import pytest
from support import SAMPLES

from pretrieve.cli import main as cli
from pretrieve.data.retrieval import load_beir
from pretrieve.eval.contrastive import contrastive_entropy, pair_generator, sample_negatives
from pretrieve.orchestrate.farm import Job, load_farm
from pretrieve.eval.metrics import ranked
from pretrieve.eval.search import hybrid_search, pair_scorer, sparse_matrix

SCIFACT = SAMPLES / "beir" / "scifact-sample"


def _recording(score):
    """`score`, remembering the document rows each query was scored against."""
    seen = {}

    def wrapped(query, rows):
        seen.setdefault(query, []).append(rows.copy())
        return score(query, rows)

    return wrapped, seen


def test_hand_computed_case_and_temperature():
    # 5 documents; with K = 5 - |relevant| every non-relevant document is a negative, so the value is exact
    docs = np.array([[1, 0], [0, 1], [1, 1], [-1, 0], [0.5, -1]], dtype=np.float32)
    queries = np.array([[2, 0], [0, 1], [1, 1]], dtype=np.float32)
    doc_ids, query_ids = ["a", "b", "c", "d", "e"], ["q1", "q2", "q3"]
    # q1: a relevant, c judged non-relevant (a negative like any other); q2: b and c relevant; q3: nothing to find
    qrels = {"q1": {"a": 1, "c": 0}, "q2": {"b": 2, "c": 1}, "q3": {"d": 0}}
    s = queries @ docs.T

    def by_hand(q, positive, negatives, tau):
        logits = np.array([s[q, positive], *s[q, negatives]]) / tau
        return -math.log(math.exp(logits[0]) / np.exp(logits).sum())

    for tau in (1.0, 0.5):
        one = contrastive_entropy({"q1": qrels["q1"]}, doc_ids, query_ids, pair_scorer(docs, queries), k=4,
                                  temperature=tau)
        assert one.pairs == 1 and one.mean == pytest.approx(by_hand(0, 0, [1, 2, 3, 4], tau))
        result = contrastive_entropy({"q2": qrels["q2"], "q3": qrels["q3"]}, doc_ids, query_ids,
                                     pair_scorer(docs, queries), k=3, temperature=tau)
        q2 = [by_hand(1, 1, [0, 3, 4], tau), by_hand(1, 2, [0, 3, 4], tau)]  # the other positive is no negative
        assert result.pairs == 2 and set(result.per_query) == {"q2"}  # q3 has no relevant document
        assert result.mean == pytest.approx(np.mean(q2)) and result.per_query["q2"] == pytest.approx(np.mean(q2))
        assert result.metrics() == {"contrastive_entropy": round(result.mean, 6), "contrastive_entropy_k": 3,
                                    "contrastive_entropy_pairs": 2, "contrastive_entropy_temperature": tau,
                                    "contrastive_entropy_seed": 0}
    with pytest.raises(ValueError, match="query q2 has 3 non-relevant documents in a corpus of 5; give a smaller K"):
        contrastive_entropy(qrels, doc_ids, query_ids, pair_scorer(docs, queries), k=4)
    # the mean is over pairs (Fang et al.), so q2 with two relevant documents weighs twice
    mixed = contrastive_entropy({"q1": {"a": 1}, "q2": qrels["q2"]}, doc_ids, query_ids, pair_scorer(docs, queries),
                                k=3)
    assert mixed.pairs == 3
    assert mixed.mean == pytest.approx((mixed.per_query["q1"] + 2 * mixed.per_query["q2"]) / 3)
    equal = contrastive_entropy({"q1": {"a": 1}}, doc_ids, query_ids, lambda q, rows: np.zeros(len(rows)), k=3)
    assert equal.mean == pytest.approx(math.log(4))  # equal scores: log(K + 1)
    with pytest.raises(ValueError, match="--ce-temperature: must be > 0"):
        contrastive_entropy(qrels, doc_ids, query_ids, pair_scorer(docs, queries), k=1, temperature=0)


def test_negatives_are_uniform_distinct_and_skip_the_relevant_rows():
    excluded = np.array([0, 7, 8, 19])  # the first, the last and two neighbours
    counts = np.zeros(20, dtype=int)
    for i in range(3000):
        rows = sample_negatives(pair_generator(0, f"q{i}", "d"), 20, excluded, 6)
        assert len(set(rows.tolist())) == 6 and not set(rows.tolist()) & set(excluded.tolist())
        assert rows.min() >= 0 and rows.max() < 20
        counts[rows] += 1
    free = np.setdiff1d(np.arange(20), excluded)
    assert counts[excluded].sum() == 0
    expected = 3000 * 6 / len(free)  # 1,125 draws each
    assert np.all(np.abs(counts[free] - expected) < 0.12 * expected), counts
    everything = sample_negatives(pair_generator(0, "q", "d"), 20, excluded, 16)
    assert sorted(everything.tolist()) == free.tolist()


def test_negatives_are_fixed_whatever_the_model():
    rng = np.random.default_rng(0)
    doc_ids, query_ids = [f"d{i}" for i in range(300)], [f"q{i}" for i in range(40)]
    qrels = {q: {f"d{j}": 1 for j in rng.choice(300, 1 + i % 3, replace=False)} for i, q in enumerate(query_ids)}
    first, second = (rng.standard_normal((300, 16)).astype(np.float32) for _ in range(2))
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    runs = []
    for docs in (first, second, first):
        score, seen = _recording(pair_scorer(docs, queries))
        runs.append((contrastive_entropy(qrels, doc_ids, query_ids, score, k=32), seen))
    assert runs[0][0] == runs[2][0]  # the same model twice: the same value
    assert runs[0][0].mean != runs[1][0].mean  # another model: another value ...
    for q in range(40):  # ... on the same negatives
        assert all(np.array_equal(a, b) for a, b in zip(runs[0][1][q], runs[1][1][q]))
    # a pair's negatives depend on (seed, its ids) only: not on the other pairs, nor on the order of the qrels
    score, alone = _recording(pair_scorer(first, queries))
    contrastive_entropy({"q5": qrels["q5"]}, doc_ids, query_ids, score, k=32)
    assert np.array_equal(alone[5][0], runs[0][1][5][0])
    score, reordered = _recording(pair_scorer(first, queries))
    contrastive_entropy(dict(reversed(qrels.items())), doc_ids, query_ids, score, k=32)
    assert all(np.array_equal(reordered[q][0], runs[0][1][q][0]) for q in range(40))
    other_seed = contrastive_entropy(qrels, doc_ids, query_ids, pair_scorer(first, queries), k=32, seed=1)
    assert other_seed.mean != runs[0][0].mean
    for q in range(40):
        rows = runs[0][1][q][0].reshape(-1, 33)
        relevant = {int(d[1:]) for d, r in qrels[query_ids[q]].items() if r > 0}
        assert sorted(rows[:, 0].tolist()) == sorted(relevant)  # the positive first ...
        assert not set(rows[:, 1:].ravel().tolist()) & relevant  # ... and no relevant document among the negatives


def test_a_better_model_has_lower_contrastive_entropy():
    """Queries near their relevant document, at decreasing noise: CE falls as the ranking improves (MRR rises)."""
    rng = np.random.default_rng(1)
    docs = rng.standard_normal((400, 32)).astype(np.float32)
    doc_ids, query_ids = [f"d{i}" for i in range(400)], [f"q{i}" for i in range(60)]
    positives = rng.choice(400, 60, replace=False)
    qrels = {q: {doc_ids[p]: 1} for q, p in zip(query_ids, positives)}
    noise = rng.standard_normal((60, 32)).astype(np.float32)
    entropies, reciprocal_ranks = [], []
    for scale in (8.0, 2.0, 1.0, 0.5):  # 8: mostly noise; 0.5: close to the positive
        queries = (docs[positives] + scale * noise) / 4
        entropies.append(contrastive_entropy(qrels, doc_ids, query_ids, pair_scorer(docs, queries), k=64).mean)
        scores = queries @ docs.T
        reciprocal_ranks.append(np.mean([1 / (1 + (scores[i] > scores[i, p]).sum()) for i, p in enumerate(positives)]))
    assert entropies == sorted(entropies, reverse=True) and entropies[0] - entropies[-1] > 1.0, entropies
    assert reciprocal_ranks == sorted(reciprocal_ranks), reciprocal_ranks


def test_pair_scorer_scores_as_the_hybrid_and_sparse_searches():
    rng = np.random.default_rng(0)
    dense_docs, dense_queries = rng.standard_normal((200, 8)).astype(np.float32), \
        rng.standard_normal((5, 8)).astype(np.float32)
    sparse_docs = sparse_matrix(np.where(rng.random((200, 50)) < 0.2, rng.random((200, 50)), 0), top_k=6)
    sparse_queries = sparse_matrix(np.where(rng.random((5, 50)) < 0.3, rng.random((5, 50)), 0))
    doc_ids, query_ids = [f"d{i}" for i in range(200)], [f"q{i}" for i in range(5)]
    run = hybrid_search(dense_docs, dense_queries, sparse_docs, sparse_queries, doc_ids, query_ids, k=20,
                        sparse_weight=0.3)
    hybrid = pair_scorer(dense_docs, dense_queries, sparse_docs, sparse_queries, sparse_weight=0.3)
    sparse_only = pair_scorer(None, None, sparse_docs, sparse_queries, sparse_weight=0.3)  # sparse takes no weight
    for i, qid in enumerate(query_ids):
        rows = np.array([int(d[1:]) for d, _ in ranked(run[qid])])
        assert hybrid(i, rows) == pytest.approx([s for _, s in ranked(run[qid])], rel=1e-5)
        assert sparse_only(i, rows) == pytest.approx((sparse_queries[i] @ sparse_docs[rows].T).toarray().ravel())


def test_pretrieve_eval_writes_contrastive_entropy(tmp_path, tiny_encoder, capsys):
    common = ["eval", "--model", str(tiny_encoder), "--beir", str(SCIFACT), "--pooling", "mean", "--normalize",
              "--max-length", "32", "--depth", "10"]
    assert cli([*common, "--contrastive-entropy", "--ce-temperature", "0.05", "--out", str(tmp_path / "a")]) == 0
    printed = json.loads(capsys.readouterr().out)
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert metrics["contrastive_entropy_k"] == 256 and metrics["contrastive_entropy_temperature"] == 0.05
    assert metrics["contrastive_entropy_seed"] == 0 and metrics["contrastive_entropy_pairs"] == 116
    assert printed["contrastive_entropy"] == metrics["contrastive_entropy"]
    assert 0 < metrics["contrastive_entropy"] and math.isfinite(metrics["contrastive_entropy"])
    assert "ce_temperature" not in metrics and "ce_seed" not in metrics  # recorded once, under the metric's name
    assert not any("@" in key for key in metrics if key.startswith("contrastive"))  # MLflow-safe as they are
    per_query = [json.loads(line) for line in (tmp_path / "a" / "per_query.jsonl").read_text().splitlines()]
    assert len(per_query) == 100 and all("contrastive_entropy" in q for q in per_query)
    qrels = load_beir(SCIFACT).qrels
    weights = [sum(r > 0 for r in qrels[q["query_id"]].values()) for q in per_query]
    assert np.average([q["contrastive_entropy"] for q in per_query], weights=weights) == \
        pytest.approx(metrics["contrastive_entropy"], abs=1e-5)

    # the BM25 baseline alone refuses it; a K beyond the corpus stops before anything is written
    assert cli(["eval", "--bm25", "--beir", str(SCIFACT), "--contrastive-entropy", "8", "--out",
                str(tmp_path / "c")]) == 1
    assert "--contrastive-entropy scores a model's own similarities: give --model DIR" in capsys.readouterr().err
    assert cli([*common, "--contrastive-entropy", "500", "--out", str(tmp_path / "d")]) == 1
    assert "has 499 non-relevant documents in a corpus of 500; give a smaller K" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_farm_passes_the_contrastive_entropy_settings_to_eval(tmp_path):
    farm = tmp_path / "farm.yaml"
    farm.write_text(json.dumps({"eval": {"contrastive_entropy": 256}, "checkpoints": [{"name": "a", "model": "m"}],
                                "datasets": [{"name": "s", "beir": "b"}]}))
    assert load_farm(farm)["eval"] == {"contrastive_entropy": 256}  # a known key, as scale studies set it
    job = Job({"name": "a", "model": "m"}, {"name": "s", "beir": "b"}, "zero-shot", tmp_path)
    args = job.eval_args({"max_length": 32, "contrastive_entropy": 256, "ce_temperature": 0.05, "ce_seed": 3})
    assert args[args.index("--contrastive-entropy") + 1] == "256"
    assert args[args.index("--ce-temperature") + 1] == "0.05" and args[args.index("--ce-seed") + 1] == "3"
