"""Contrastive entropy: the continuous retrieval metric of Fang et al., "Scaling Laws for Dense Retrieval"
(SIGIR 2024, arXiv:2403.18684), for scaling studies where NDCG@10 moves in steps too coarse to fit a law to.

For each judged pair (q, p+) with relevance > 0, K negatives n_1 .. n_K are drawn uniformly without replacement
from the corpus minus q's relevant documents, and

    CE(q, p+) = -log( exp(s(q, p+) / tau) / (exp(s(q, p+) / tau) + sum_j exp(s(q, n_j) / tau)) )

where s is the model's own score (eval.search.pair_scorer: the inner product of the vectors eval searches with,
plus the weighted sparse product for hybrid / DupMAE). `contrastive_entropy` is its mean over the pairs, as
the paper averages over test pairs, so a query counts once per relevant document; per_query.jsonl carries each
query's mean over its own pairs. Lower is better; log(K + 1) is what equal scores give.

From the paper: K = 256 negatives per query-passage pair, and s the raw inner product (no temperature).
Choices it leaves open, made here:
- tau defaults to 1.0, the paper's raw inner product. With normalised vectors s lies in [-1, 1], so CE stays
  within log(1 + K e^-2) .. log(1 + K e^2) (3.6 .. 7.4 at K = 256): still continuous and ordered, but
  compressed; `--ce-temperature` with the fine-tuning temperature spreads it. Values compare only at the same
  K, tau and seed; metrics.json records all three.
- The negatives are fixed, independent of the model: pair (q, p+) draws from a generator seeded by (seed, a
  stable hash of the query and document ids), over corpus rows in file order. Every model evaluated on the same
  files with the same seed and K is scored on the same negatives (what points of a scaling study need), and a
  pair's negatives do not depend on which other pairs exist (`--on-missing skip` leaves the others' alone).
- Judged non-relevant documents (relevance 0) may be drawn as negatives; only the query's relevant ones are
  excluded.
- Scores are exact, whatever `--index` the search used. Cost: (K + 1) inner products per pair on the vectors eval
  already holds; no second encoding.
- BM25 has no vectors and scores on no scale a softmax over inner products would share; `pretrieve eval`
  refuses the option without a model, and a BM25 baseline beside a model gets no contrastive entropy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

DEFAULT_NEGATIVES = 256  # Fang et al. 2024: negatives per query-passage pair

# score(query row, document rows [m]) -> [m] scores of those pairs (eval.search.pair_scorer)
PairScorer = Callable[[int, np.ndarray], np.ndarray]


@dataclass
class ContrastiveEntropy:
    mean: float | None  # over the judged (query, relevant document) pairs; None when there are none
    per_query: dict[str, float]  # query id -> mean over its pairs (queries with a relevant document)
    pairs: int
    k: int
    temperature: float
    seed: int

    def metrics(self) -> dict:
        """The metrics.json entries: the value and what it was computed with."""
        return {"contrastive_entropy": None if self.mean is None else round(self.mean, 6),
                "contrastive_entropy_k": self.k, "contrastive_entropy_pairs": self.pairs,
                "contrastive_entropy_temperature": self.temperature, "contrastive_entropy_seed": self.seed}


def check_options(k: int, temperature: float, qrels: dict[str, dict[str, int]] | None = None,
                  documents: int | None = None) -> None:
    """Refuse bad settings before anything is encoded; with the qrels and the corpus size, also a K larger than
    some query's non-relevant documents."""
    if k < 1:
        raise ValueError(f"--contrastive-entropy: K (negatives per pair) must be >= 1, got {k}")
    if not temperature > 0:
        raise ValueError(f"--ce-temperature: must be > 0, got {temperature}")
    for qid, docs in (qrels or {}).items():
        free = documents - sum(relevance > 0 for relevance in docs.values())
        if free < k:
            raise ValueError(f"--contrastive-entropy {k}: query {qid} has {free} non-relevant documents in a corpus "
                             f"of {documents}; give a smaller K")


def pair_generator(seed: int, query_id: str, doc_id: str) -> np.random.Generator:
    """The generator of one pair's negatives: from the seed and the two ids only (not Python's salted hash)."""
    digest = hashlib.blake2b(f"{query_id}\t{doc_id}".encode(), digest_size=8).digest()
    return np.random.default_rng([seed, int.from_bytes(digest, "little")])


def sample_negatives(rng: np.random.Generator, documents: int, excluded: np.ndarray, k: int) -> np.ndarray:
    """k distinct rows of range(documents), uniform over those not in `excluded` (sorted, distinct rows)."""
    picks = rng.choice(documents - len(excluded), size=k, replace=False)
    # the x-th free row is x + (excluded rows at or before it); excluded[i] - i free rows precede excluded[i]
    return picks + np.searchsorted(excluded - np.arange(len(excluded)), picks, side="right")


def contrastive_entropy(qrels: dict[str, dict[str, int]], doc_ids: list[str], query_ids: list[str],
                        score: PairScorer, k: int = DEFAULT_NEGATIVES, temperature: float = 1.0,
                        seed: int = 0) -> ContrastiveEntropy:
    """CE over every judged pair with relevance > 0; `score` rows index `doc_ids` and `query_ids`."""
    check_options(k, temperature, qrels, len(doc_ids))
    judged = {d for docs in qrels.values() for d in docs}
    row_of = {d: i for i, d in enumerate(doc_ids) if d in judged}  # judged documents only: corpora run to millions
    query_row = {q: i for i, q in enumerate(query_ids)}
    values, per_query = [], {}
    for qid, docs in qrels.items():
        positives = [d for d, relevance in docs.items() if relevance > 0]
        if not positives:
            continue
        relevant = np.array(sorted(row_of[d] for d in positives), dtype=np.int64)
        rows = np.stack([np.concatenate(([row_of[d]], sample_negatives(pair_generator(seed, qid, d), len(doc_ids),
                                                                        relevant, k)))
                         for d in positives])  # [pairs of q, 1 + K], the positive first
        logits = np.asarray(score(query_row[qid], rows.ravel()), dtype=np.float64).reshape(rows.shape) / temperature
        top = logits.max(axis=1)
        entropy = top + np.log(np.exp(logits - top[:, None]).sum(axis=1)) - logits[:, 0]  # logsumexp - positive
        values.extend(entropy.tolist())
        per_query[qid] = float(entropy.mean())
    mean = float(np.mean(values)) if values else None
    return ContrastiveEntropy(mean, per_query, len(values), k, temperature, seed)
