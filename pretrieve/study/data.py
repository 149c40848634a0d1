"""Data of the quality study (quality.py): the pre-training text, the target corpora, and the
labelled fine-tuning set every arm is fine-tuned on.

The labelled set (studies/quality/README.md, "The labelled set"). No MS MARCO is available offline, so the
general-domain supervision is built from the Wikipedia sample the way weakly supervised retrievers build theirs:
E5's (title, passage) pairs and Contriever's passages of other documents as negatives. Per article the query is
its title, the positive one passage of about `passage_words` words drawn from the article (seeded by the
article id), and the negative the passage of another article that BM25 (pretrieve.eval.bm25.bm25_search,
bm25s) ranks highest for that title (a random one where no other passage shares a word with it). With
`beir_train` folders, their training splits are added in the same form (qrels positives, the best BM25 document
not judged relevant as the negative): SciFact's 809 training claims, when SciFact is not among the collections
evaluated. The Wikipedia passages are pre-training text too, as MS MARCO's passages are in DupMAE's
pre-training corpus; no test split enters the set, and `check_no_leak` refuses a set that holds an evaluated
query.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import sys
import time
import zlib
from pathlib import Path


def log(message: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, text: str) -> None:
    from pretrieve.utils.run_dir import write_atomic as replace_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, text)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- pre-training text ------------------------------------------------------------------------------------
def held_out(doc_id: str) -> bool:
    """The held-out rule for Wikipedia articles: 1 in 20 by a hash of the article id (stable, order-free)."""
    return zlib.crc32(doc_id.encode()) % 20 == 0


def split_pretrain(wiki: Path, books: list[Path], raw: Path) -> dict:
    """Wikipedia split by article, books by title (the book whose file name hashes lowest is held out); the raw
    train / held-out Wikipedia files under `raw`. Returns the split's record and the inputs of each part."""
    train, heldout = raw / "wiki-train.jsonl", raw / "wiki-heldout.jsonl"
    counts_file = raw / "split.json"
    if not counts_file.is_file():
        raw.mkdir(parents=True, exist_ok=True)
        counts = [0, 0]
        with gzip.open(wiki, "rt", encoding="utf-8") as f, open(f"{train}.tmp", "w") as tr, \
                open(f"{heldout}.tmp", "w") as ho:
            for line in f:
                out = held_out(str(json.loads(line)["id"]))
                (ho if out else tr).write(line)
                counts[out] += 1
        os.replace(f"{train}.tmp", train)
        os.replace(f"{heldout}.tmp", heldout)
        write_atomic(counts_file, json.dumps({"wiki_train_articles": counts[0], "wiki_heldout_articles": counts[1]}))
    book_out = min(books, key=lambda p: zlib.crc32(p.name.encode()))
    return {"wiki": str(wiki), "books": [str(b) for b in books], "rule": "Wikipedia: crc32(article id) % 20 == 0 "
            "held out; books: the file whose crc32(name) is lowest held out", "books_heldout": [book_out.name],
            **json.loads(counts_file.read_text()),
            "parts": {"wiki-train": [str(train)], "wiki-heldout": [str(heldout)],
                      "books-train": [str(b) for b in books if b != book_out], "books-heldout": [str(book_out)]}}


def prepare(source: str, inputs: list[str], out: Path, max_len: int, skip_bad: bool = False, workers: int = 0) -> dict:
    """`pretrieve prepare`'s library call (in this process: no interpreter start-up), skipped when the manifest
    exists; returns the manifest's totals."""
    manifest = out / "manifest.json"
    if not manifest.is_file():
        log(f"prepare {out.name} ({source})")
        from pretrieve.data.prepare import prepare as prepare_shards
        from pretrieve.data.prepare_options import PrepareOptions

        prepare_shards(PrepareOptions(source=source, inputs=inputs, out=str(out), max_len=max_len, workers=workers,
                                      on_error="skip" if skip_bad else "fail"))
    info = json.loads(manifest.read_text())
    return {"manifest": str(manifest), "num_samples": info["num_samples"], "num_tokens": info["num_tokens"]}


# --- the labelled set -------------------------------------------------------------------------------------
def passages(text: str, words: int) -> list[str]:
    """The article cut into consecutive windows of `words` words (a shorter tail is merged into the last)."""
    tokens = text.split()
    cuts = list(range(0, len(tokens), words))
    if len(cuts) > 1 and len(tokens) - cuts[-1] < words // 2:
        cuts.pop()
    return [" ".join(tokens[start:end]) for start, end in zip(cuts, cuts[1:] + [len(tokens)])]


def title_pairs(wiki: Path, passage_words: int, seed: int) -> tuple[list[str], list[str]]:
    """(titles, positives): per Wikipedia article with at least one full passage and a title not seen before,
    its title and one of its passages, drawn with random.Random((seed, article id))."""
    titles, positives, seen = [], [], set()
    with gzip.open(wiki, "rt", encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            title = record["title"].strip()
            windows = [p for p in passages(record["text"], passage_words) if len(p.split()) >= passage_words // 2]
            if not title or not windows or title.lower() in seen:
                continue
            seen.add(title.lower())
            titles.append(title)
            positives.append(random.Random(f"{seed}/{record['id']}").choice(windows))
    return titles, positives


def bm25_negatives(queries: list[str], docs: dict[str, str], relevant: list[set[str]], seed: int) -> list[str]:
    """Per query, the id of the document BM25 ranks highest among those not in its `relevant` set; where BM25
    finds none (no shared word), one drawn with random.Random((seed, query number))."""
    from pretrieve.eval.bm25 import bm25_search

    run = bm25_search(docs, {str(i): q for i, q in enumerate(queries)}, k=max(map(len, relevant)) + 1)
    ids = sorted(docs)
    best = []
    for i, judged in enumerate(relevant):
        ranked = sorted(run.get(str(i), {}).items(), key=lambda item: -item[1])
        found = next((doc for doc, _ in ranked if doc not in judged), None)
        rng = random.Random(f"{seed}/{i}")
        while found is None or found in judged:
            found = rng.choice(ids)
        best.append(found)
    return best


def wikipedia_examples(wiki: Path, passage_words: int, seed: int) -> list[dict]:
    """Title -> passage examples with one BM25 negative from another article."""
    titles, positives = title_pairs(wiki, passage_words, seed)
    docs = {str(i): p for i, p in enumerate(positives)}
    negatives = bm25_negatives(titles, docs, [{str(i)} for i in range(len(titles))], seed)
    return [{"query": t, "pos": [p], "neg": [docs[n]]} for t, p, n in zip(titles, positives, negatives)]


def beir_examples(folder: Path, split: str, seed: int) -> list[dict]:
    """A BEIR set's `split` as examples: its judged positives, and the BM25-best unjudged document as the
    negative."""
    from pretrieve.data.retrieval import load_beir

    data = load_beir(folder, split)
    qids = [q for q, judged in data.qrels.items() if any(r > 0 for r in judged.values())]
    docs = {d: data.doc_text(d) for d in data.corpus}
    negatives = bm25_negatives([data.queries[q] for q in qids], docs, [set(data.qrels[q]) for q in qids], seed)
    return [{"query": data.queries[q], "pos": [docs[d] for d, r in data.qrels[q].items() if r > 0], "neg": [docs[n]]}
            for q, n in zip(qids, negatives)]


def build_labelled(out: Path, wiki: Path, beir_train: list[Path], passage_words: int, seed: int) -> dict:
    """Write the labelled set to `out` (JSON lines {"query", "pos", "neg"}, pretrieve finetune's format) unless
    it is there; returns its record: path, sha256, examples per source."""
    record_file = out.with_suffix(".json")
    if not (out.is_file() and record_file.is_file()):
        log(f"labelled set {out.name}")
        sources = {"wikipedia-titles": wikipedia_examples(wiki, passage_words, seed)}
        for folder in beir_train:
            sources[f"{folder.name}-train"] = beir_examples(folder, "train", seed)
        examples = [e for part in sources.values() for e in part]
        write_atomic(out, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in examples))
        write_atomic(record_file, json.dumps({"path": str(out), "sha256": sha256(out), "passage_words": passage_words,
                                              "seed": seed, "wikipedia": str(wiki),
                                              "examples": {k: len(v) for k, v in sources.items()}}, indent=1))
    return json.loads(record_file.read_text())


def normalized(text: str) -> str:
    return " ".join(text.lower().split())


def check_no_leak(labelled: Path, evaluated: dict[str, Path], split: str = "test") -> None:
    """Refuse a labelled set holding an evaluated query (any query of `split` of an evaluated BEIR folder),
    compared lower-cased with whitespace collapsed. The error names the set, the line and the query id."""
    from pretrieve.data.retrieval import load_beir

    owners = {}
    for name, folder in evaluated.items():
        data = load_beir(folder, split)
        for qid in data.qrels:
            owners.setdefault(normalized(data.queries[qid]), (name, qid))
    with open(labelled, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            owner = owners.get(normalized(json.loads(line)["query"]))
            if owner:
                raise ValueError(f"{labelled}:{number}: the query is {owner[0]}'s {split} query {owner[1]}: "
                                 "evaluated queries must not be fine-tuned on")
