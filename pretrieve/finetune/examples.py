"""Fine-tuning examples: a query, its positive passages, its negatives and, for distillation, teacher scores.

Read from
- JSON lines `{"query", "pos": [...], "neg": [...], "pos_scores": [...], "neg_scores": [...]}` (the common
  fine-tuning format, ../shared/data/finetune-examples; scores optional), also what `pretrieve mine` and
  `pretrieve teacher-scores` write;
- MS MARCO text triples (`triples.train.small.tsv`: query, positive, negative per line), grouped by query;
- an MS MARCO / BEIR set with a training split (qrels give the positives) plus an optional hard-negative
  file of `query id<TAB>doc id,doc id,...` lines (`examples_from_ids`).
A malformed line is an error naming the file and line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from pretrieve.data.retrieval import RetrievalDataError, RetrievalSet, jsonl_records, text_lines


@dataclass
class Example:
    query: str
    pos: list[str]
    neg: list[str] = field(default_factory=list)
    pos_scores: list[float] | None = None
    neg_scores: list[float] | None = None
    where: str = ""  # file:line, for errors about this example

    def to_json(self) -> dict:
        record = {"query": self.query, "pos": self.pos, "neg": self.neg}
        if self.pos_scores is not None:
            record.update(pos_scores=self.pos_scores, neg_scores=self.neg_scores)
        return record


def read_all(paths: list[str]) -> list[Example]:
    return [e for path in paths for e in read_examples(path)]


def read_examples(path: str | Path) -> list[Example]:
    """A JSON-lines file (`.jsonl`, `.json`, optionally .gz / .bz2) or a text-triples TSV (anything else)."""
    path = Path(path)
    if not path.is_file():
        raise RetrievalDataError(f"{path}: not found")
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2")]
    return _read_jsonl(path) if suffixes and suffixes[-1] in (".jsonl", ".json") else _read_triples(path)


def write_examples(path: str | Path, examples: Iterable[Example]) -> Path:
    """JSON lines, one example at a time, into a temporary file renamed to PATH at the end."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps(e.to_json(), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def _read_jsonl(path: Path) -> list[Example]:
    examples = []
    for number, record in jsonl_records(path):
        where = f"{path}:{number}"
        if not isinstance(record, dict) or not isinstance(record.get("query"), str):
            raise RetrievalDataError(f"{where}: no \"query\" string")
        texts = {}
        for key in ("pos", "neg"):
            value = record.get(key, [])
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise RetrievalDataError(f"{where}: \"{key}\" must be a list of strings")
            texts[key] = value
        if not texts["pos"]:
            raise RetrievalDataError(f"{where}: \"pos\" is empty (every query needs a positive)")
        scores = {}
        for key in ("pos", "neg"):
            value = record.get(f"{key}_scores")
            if value is not None and (not isinstance(value, list) or len(value) != len(texts[key])
                                      or not all(isinstance(s, (int, float)) for s in value)):
                raise RetrievalDataError(f"{where}: \"{key}_scores\" must be {len(texts[key])} numbers, one per "
                                         f"\"{key}\" text")
            scores[key] = None if value is None else [float(s) for s in value]
        if (scores["pos"] is None) != (scores["neg"] is None):
            raise RetrievalDataError(f"{where}: give both \"pos_scores\" and \"neg_scores\", or neither")
        examples.append(Example(record["query"], texts["pos"], texts["neg"], scores["pos"], scores["neg"], where))
    return examples


def _read_triples(path: Path) -> list[Example]:
    """query<TAB>positive<TAB>negative lines; lines of one query (same text, same positive) become one example."""
    grouped: dict[tuple[str, str], Example] = {}
    for number, line in text_lines(path):
        where = f"{path}:{number}"
        cols = line.rstrip("\n").split("\t")
        if len(cols) != 3:
            raise RetrievalDataError(f"{where}: expected query<TAB>positive<TAB>negative, got {len(cols)} columns "
                                     "(JSON lines need a .jsonl name)")
        query, pos, neg = cols
        example = grouped.setdefault((query, pos), Example(query, [pos], [], where=where))
        example.neg.append(neg)
    return list(grouped.values())


def examples_from_ids(data: RetrievalSet, hard_negatives: str | Path | None = None) -> list[Example]:
    """Examples from a set's judged queries (relevance > 0 are positives) and, optionally, a hard-negative file
    of `query id<TAB>doc id,doc id,...` lines (judged positives among them are dropped)."""
    negatives: dict[str, list[str]] = {}
    if hard_negatives is not None:
        path = Path(hard_negatives)
        if not path.is_file():
            raise RetrievalDataError(f"{path}: not found")
        for number, line in text_lines(path):
            where = f"{path}:{number}"
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 2:
                raise RetrievalDataError(f"{where}: expected query id<TAB>doc id,doc id,..., got {len(cols)} columns")
            qid, ids = cols[0].strip(), [d.strip() for d in cols[1].split(",") if d.strip()]
            for doc in ids:
                if doc not in data.corpus:
                    raise RetrievalDataError(f"{where}: document {doc} is not in the corpus of {data.name}")
            negatives[qid] = ids
    return [Example(data.queries[qid], [data.doc_text(d) for d in positives],
                    [data.doc_text(d) for d in negatives.get(qid, []) if d not in data.qrels[qid]],
                    where=f"{data.name} query {qid}") for qid, positives in positive_ids(data).items()]


def positive_ids(data: RetrievalSet) -> dict[str, list[str]]:
    """query id -> the documents judged relevant to it (relevance > 0), for the queries with one, in qrels order."""
    judged = ((qid, [d for d, rel in docs.items() if rel > 0]) for qid, docs in data.qrels.items())
    return {qid: positives for qid, positives in judged if positives}
