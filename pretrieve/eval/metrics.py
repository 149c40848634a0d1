"""Retrieval metrics with trec_eval's semantics, through pytrec_eval (the trec_eval C code).

Keys (docs/design.md, "Evaluation output"): `ndcg@10` (trec_eval ndcg_cut.10), `mrr@10` and `mrr@100` (recip_rank of
the run cut to its top 10 / 100), `recall@100`, `recall@1000`, `map`. As trec_eval orders a run, ties in
score are broken by document id, descending; the cut for MRR@k uses the same order, so it cuts exactly what
trec_eval would rank first. Every judged query counts (trec_eval -c): a query missing from the run scores
0. A query whose judgements are all 0 has nothing to find: its metrics are 0, as trec_eval gives them.
"""

from __future__ import annotations

import pytrec_eval

METRICS = ("ndcg@10", "mrr@10", "mrr@100", "recall@100", "recall@1000", "map")
_TREC = {"ndcg": "ndcg_cut", "recall": "recall", "map": "map"}

Run = dict[str, dict[str, float]]  # query id -> doc id -> score
Qrels = dict[str, dict[str, int]]


def ranked(docs: dict[str, float]) -> list[tuple[str, float]]:
    """A query's results in trec_eval's order: score descending, then document id descending."""
    return sorted(docs.items(), key=lambda item: (item[1], item[0]), reverse=True)


def evaluate(qrels: Qrels, run: Run, metrics: tuple[str, ...] = METRICS) -> tuple[dict, dict]:
    """(mean of each metric over the judged queries, {query id: {metric: value}})."""
    per_query = {qid: {} for qid in qrels}
    for name in metrics:
        measure, _, depth = name.partition("@")
        if measure == "mrr":
            cut = {q: dict(ranked(docs)[:int(depth)]) for q, docs in run.items()}
            scores = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(cut)
            key = "recip_rank"
        elif measure in _TREC:
            trec = f"{_TREC[measure]}.{depth}" if depth else _TREC[measure]
            scores = pytrec_eval.RelevanceEvaluator(qrels, {trec}).evaluate(run)
            key = f"{_TREC[measure]}_{depth}" if depth else _TREC[measure]
        else:
            raise ValueError(f"unknown metric {name!r} (known: {', '.join(METRICS)})")
        for qid in qrels:
            per_query[qid][name] = float(scores[qid][key]) if qid in scores else 0.0
    means = {name: sum(q[name] for q in per_query.values()) / len(per_query) for name in metrics}
    return means, per_query


def trec_run_lines(run: Run, tag: str) -> list[str]:
    """`qid Q0 docid rank score tag` lines, ranks in trec_eval's order."""
    return [f"{qid} Q0 {doc} {rank} {score:.6f} {tag}" for qid, docs in run.items()
            for rank, (doc, score) in enumerate(ranked(docs), 1)]
