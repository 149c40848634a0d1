"""Pair sources for contrastive pre-training: (query, positive, negatives) texts from raw corpora, and the pair
sample's form in a shard.

`pretrieve prepare --pairs` reads records with these readers and writes pair shards through prepare.py's
machinery (shards, manifest, sha256, resume). Each source and what a record gives:

- `wikipedia` (`--pair-method sections`): the article title -> its first paragraph, and for each section with
  text "title: heading" -> the section's text (WikiExtractor writes a heading as a line of its own ending in
  a period; a bare heading, "History", would repeat across articles, so the title goes first).
- `books` and any document source (`--pair-method spans`): two spans of one document. The document is packed
  into blocks of max_len - 2 tokens at sentence boundaries (packing.py), then per block either two independent
  random crops of `crop_ratio` of its length (`--span-method crop`, Contriever, Izacard et al. 2022) or a
  sentence -> the rest of its block (`--span-method ict`, the Inverse Cloze Task, Lee et al. 2019, the sentence
  kept in its context with probability `ict_keep_prob`). Draws come from (seed, record, block).
- `msmarco` (`--pair-method qrels`): a folder with collection.tsv (or msmarco-docs.tsv), queries.<split>.tsv and
  qrels.<split>.tsv: each judged query -> its relevant passage.
- `beir`: a BEIR folder's corpus.jsonl, queries.jsonl and qrels/<split>.tsv, the same way.
- `jsonl` (`--pair-method records`): JSON lines {"query": str, "pos": str | [str], "neg": str | [str]} (the
  fine-tuning format, BGE's, and sentence-transformers' triplets), or a Hugging Face dataset's rows, under the field names of `--fields`: a
  pair per positive, each with all the record's negatives. A row whose positives a mask leaves empty
  (`microsoft/ms_marco`'s queries without a selected passage) gives no pair and is counted.

Qrels sources read the corpus in file order: a passage judged relevant to k queries is one record of k pairs,
so resuming, parts of the corpus and the reader's cursor work as for text.

In a shard a pair is one sample: its texts' token ids concatenated (query, positive, negatives; no special
tokens, each text cut to max_len - 2) in the ids member, and in the JSON `parts` (their lengths), `pair` (how it
was made: title, section, crop, ict, qrels, record) with `doc` and `source`. `split_pair` cuts them apart again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pretrieve.data import corpora
from pretrieve.data.corpora import BadRecord, CorpusError, Cursor, Document, ReaderOptions
from pretrieve.data.fields import MISSING, FieldError, field_value
from pretrieve.data.hf_datasets import HFDataset
from pretrieve.data.packing import pack_sentences
from pretrieve.data.retrieval import load_retrieval_set

PAIR_SOURCES = ("wikipedia", "books", "msmarco", "beir", "jsonl")
PAIR_METHODS = {"wikipedia": ("sections", "spans"), "books": ("spans",), "msmarco": ("qrels",),
                "beir": ("qrels",), "jsonl": ("records", "spans")}
SPAN_METHODS = ("crop", "ict")


@dataclass(frozen=True)
class TextPair:
    query: str
    pos: str
    negs: tuple[str, ...] = ()
    kind: str = "record"  # how it was made: title | section | qrels | record


@dataclass(frozen=True)
class PairRecord:
    """What one input record gives: text pairs, or (span methods) a document whose spans the tokenizer cuts."""
    doc_id: str
    where: str
    pairs: tuple[TextPair, ...] = ()
    text: str | None = None


def default_method(source: str) -> str:
    return PAIR_METHODS[source][0]


# --- inputs -------------------------------------------------------------------------------------------------
def input_files(source: str, inputs: list[str], split: str) -> tuple[list[Path], list[Path]]:
    """(the files read record by record, the other files a job depends on: queries and qrels)."""
    if source not in ("msmarco", "beir"):
        reader = {"wikipedia": "wikipedia", "books": "books", "jsonl": "jsonl"}[source]
        return corpora.list_input_files(reader, inputs), []
    if len(inputs) != 1 or not Path(inputs[0]).is_dir():
        raise CorpusError(f"--source {source} --pairs: --input takes one folder, got {' '.join(map(str, inputs))}")
    folder = Path(inputs[0])
    if source == "beir":
        corpus, extra = folder / "corpus.jsonl", [folder / "queries.jsonl", folder / "qrels" / f"{split}.tsv"]
    else:
        corpus = folder / "collection.tsv" if (folder / "collection.tsv").is_file() else folder / "msmarco-docs.tsv"
        extra = [folder / f"queries.{split}.tsv", folder / f"qrels.{split}.tsv"]
    missing = [str(p) for p in [corpus, *extra] if not p.is_file()]
    if missing:
        raise CorpusError(f"{source} pairs need {', '.join(missing)} (--qrels-split {split})")
    return [corpus], extra


def read_pair_records(source: str, method: str, files: list[Path] | HFDataset, split: str, reader: ReaderOptions,
                      start: Cursor, wanted: Callable[[int], bool] | None, on_error: str,
                      skipped: dict) -> Iterator[tuple[int, Cursor, PairRecord | BadRecord | None]]:
    """(index, cursor, record) as corpora.read_records numbers them; a record that gives no pair comes as None.
    Qrels lines naming a missing query or document stop the run (file:line) or, with on_error=skip, are
    counted into `skipped`."""
    if method == "records":
        if isinstance(files, HFDataset):
            return corpora.read_rows(files, partial(_mapping_pair, fields=reader), start, wanted)
        return corpora.read_line_records(files, partial(_jsonl_pair, fields=reader), start, wanted)
    if method == "qrels":
        return _qrels_pairs(source, files, split, start, wanted, on_error, skipped)
    text_source = {"wikipedia": "wikipedia", "books": "books", "jsonl": "jsonl"}[source]
    documents = corpora.read_records(text_source, files, reader, start, wanted)
    if method == "spans":
        return ((i, c, PairRecord(r.doc_id, r.where, text=r.text) if isinstance(r, Document) else r)
                for i, c, r in documents)
    return ((i, c, _wikipedia_pairs(r) if isinstance(r, Document) else r) for i, c, r in documents)


def _jsonl_pair(line: str, where: str, fields: ReaderOptions) -> PairRecord | BadRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadRecord("bad_json", where, f"malformed JSON ({e.msg} at column {e.colno})")
    return _mapping_pair(obj, where, fields)


def _mapping_pair(obj, where: str, fields: ReaderOptions) -> PairRecord | BadRecord:
    """The pairs of a record {query, pos, neg} under the field names of `fields`."""
    if not isinstance(obj, dict):
        return BadRecord("bad_json", where, f"expected a JSON object, got {type(obj).__name__}")
    try:
        query, pos, neg, doc_id = (field_value(obj, column) for column in
                                   (fields.query_field, fields.pos_field, fields.neg_field, fields.id_field))
    except FieldError as e:
        return BadRecord("bad_row", where, str(e))
    pos = [pos] if isinstance(pos, str) else pos
    neg = [] if neg is MISSING or neg is None else [neg] if isinstance(neg, str) else neg  # a triplet's: one
    if not isinstance(query, str) or not query.strip():
        return BadRecord("missing_field", where, f"no non-empty string field {fields.query_field!r}")
    masked = "[" in fields.pos_field  # a mask that selects no positive: a query without a judged passage
    if not isinstance(pos, list) or not (pos or masked) or not all(isinstance(p, str) and p.strip() for p in pos):
        return BadRecord("missing_field", where, f"{fields.pos_field!r} must be a non-empty string or list of "
                                                 "non-empty strings")
    if not isinstance(neg, list) or not all(isinstance(n, str) for n in neg):
        return BadRecord("bad_row", where, f"{fields.neg_field!r} must be a string or a list of strings")
    negs = tuple(n for n in neg if n.strip())
    doc_id = where.rsplit("/", 1)[-1] if doc_id is MISSING or doc_id is None else doc_id
    return PairRecord(str(doc_id), where, tuple(TextPair(query, p, negs, "record") for p in pos))


def is_heading(line: str) -> bool:
    """A WikiExtractor section heading: one short line, a capital first, a period last and none inside."""
    return (0 < len(line) <= 100 and line[0].isupper() and line.endswith(".") and ". " not in line
            and len(line.split()) <= 12)


def _wikipedia_pairs(doc: Document) -> PairRecord | None:
    """title -> first paragraph; "title: heading" -> the section's paragraphs (up to the next heading)."""
    lines = [line.strip() for line in doc.text.split("\n")]
    title, body = lines[0], [line for line in lines[1:] if line]
    pairs: list[TextPair] = []
    heading, section = None, []

    def close():
        if section:
            if heading is None:
                pairs.append(TextPair(title, section[0], (), "title"))
            else:
                pairs.append(TextPair(f"{title}: {heading}", "\n".join(section), (), "section"))

    for line in body:
        if is_heading(line):
            close()
            heading, section = line[:-1], []
        else:
            section.append(line)
    close()
    return PairRecord(doc.doc_id, doc.where, tuple(pairs)) if pairs else None


def _qrels_pairs(source: str, files: list[Path], split: str, start: Cursor, wanted, on_error: str,
                 skipped: dict) -> Iterator[tuple]:
    """The corpus in file order; each passage judged relevant to queries is a record of (query, passage) pairs.
    The judgements are checked first against the corpus's ids (retrieval.py, which reads the corpus once)."""
    folder = files[0].parent
    judged = load_retrieval_set(**{source: folder}, split=split, on_missing=on_error, texts=False)
    skipped.update(judged.skipped)
    by_doc: dict[str, list[str]] = {}
    for qid, docs in judged.qrels.items():
        for doc_id, grade in docs.items():
            if grade > 0:
                by_doc.setdefault(doc_id, []).append(judged.queries[qid])
    reader_source = "beir" if source == "beir" else \
        "msmarco-passage" if files[0].name.startswith("collection") else "msmarco-doc"
    for index, cursor, record in corpora.read_records(reader_source, files, ReaderOptions(), start, wanted):
        if isinstance(record, Document):
            queries = by_doc.get(record.doc_id)
            record = None if not queries else PairRecord(
                record.doc_id, record.where, tuple(TextPair(q, record.text, (), "qrels") for q in queries))
        yield index, cursor, record


# --- tokens ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpanOptions:
    method: str = "crop"  # crop | ict
    crop_ratio_min: float = 0.1
    crop_ratio_max: float = 0.5
    ict_keep_prob: float = 0.1
    seed: int = 42


def text_pair_samples(backend, pairs: tuple[TextPair, ...], max_tokens: int) -> tuple[list[tuple], int]:
    """([(ids, meta)] for `pairs`, the number of texts cut to max_tokens)."""
    texts = [t for p in pairs for t in (p.query, p.pos, *p.negs)]
    encoded = iter(backend.encode_batch(texts, add_special_tokens=False))
    samples, truncated = [], 0
    for pair in pairs:
        parts = [np.asarray(next(encoded).ids, dtype=np.int32) for _ in range(2 + len(pair.negs))]
        truncated += sum(len(p) > max_tokens for p in parts)
        parts = [p[:max_tokens] for p in parts]
        if len(parts[0]) and len(parts[1]):  # a text of nothing but characters the tokenizer drops gives no pair
            samples.append(pair_sample(parts[0], parts[1], [n for n in parts[2:] if len(n)], pair.kind))
    return samples, truncated


def span_pair_samples(ids: np.ndarray, sentence_ends: np.ndarray, max_tokens: int, spans: SpanOptions,
                      index: int) -> list[tuple]:
    """Two spans of each block of a document (crop: two independent crops; ict: a sentence and its context)."""
    samples = []
    for b, (lo, hi) in enumerate(pack_sentences(sentence_ends, max_tokens)):
        rng = np.random.default_rng([spans.seed, index, b])
        block = ids[lo:hi]
        if spans.method == "crop":
            if len(block) < 2:
                continue
            crops = []
            for _ in range(2):
                length = max(1, int(len(block) * rng.uniform(spans.crop_ratio_min, spans.crop_ratio_max)))
                begin = int(rng.integers(0, len(block) - length + 1))
                crops.append(block[begin:begin + length])
            samples.append(pair_sample(crops[0], crops[1], [], "crop"))
            continue
        ends = [e - lo for e in sentence_ends.tolist() if lo < e <= hi]
        starts = [0] + ends[:-1]
        if len(ends) < 2:  # one sentence: no context to find it in
            continue
        k = int(rng.integers(len(ends)))
        query = block[starts[k]:ends[k]]
        keep = rng.random() < spans.ict_keep_prob
        context = block if keep else np.concatenate([block[:starts[k]], block[ends[k]:]])
        samples.append(pair_sample(query, context, [], "ict"))
    return samples


def pair_sample(query: np.ndarray, pos: np.ndarray, negs: list[np.ndarray], kind: str) -> tuple[np.ndarray, dict]:
    """(the concatenated ids, the meta keys that cut them apart)."""
    parts = [query, pos, *negs]
    return np.concatenate(parts), {"parts": [len(p) for p in parts], "pair": kind}


def split_pair(ids: np.ndarray, parts: list[int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """(query, positive, negatives) of a pair sample's ids."""
    texts, start = [], 0
    for length in parts:  # in Python: np.cumsum of a short list costs more than the stream's whole sample
        texts.append(ids[start:start + length])
        start += length
    return texts[0], texts[1], texts[2:]


def pair_digest(ids: np.ndarray, parts: list[int]) -> bytes:
    """What makes two pairs the same: the query's and the positive's tokens (negatives aside)."""
    query, pos, _ = split_pair(np.asarray(ids, dtype=np.int64), parts)
    h = hashlib.blake2b(digest_size=16)
    h.update(len(query).to_bytes(4, "little"))
    h.update(query.tobytes())
    h.update(pos.tobytes())
    return h.digest()
