"""`pretrieve mine`: ANN hard negatives for stage 2 (dupmae-retromae-2-acl2023.txt eq. 14; ANCE) and
`pretrieve teacher-scores`: cross-encoder soft labels for stage 3 (eq. 15).

Mining encodes the corpus and the training queries with the stage-1 model, searches with faiss (with pooling
`dupmae`: eq. 12 through eval.evaluate.vocab_search, as `pretrieve eval` does), removes each
query's positives from its ranking, leaves out the top `skip` ranks (likely unjudged positives), and samples
`negatives` of the remaining results down to rank `depth` (CoT-MoTE: 15 negatives from depth 200). The
corpus is the set's corpus for MS MARCO / BEIR data, else every distinct passage of the training file.
Both write JSON lines in the fine-tuning format (finetune.examples), through a temporary file and a rename.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from pretrieve.finetune.examples import Example, write_examples

PASSAGE_MAX_LENGTH = 144  # passage tokens when neither a flag nor the model says (CoT-MoTE's fine-tuning length)


@dataclass
class MineOptions:
    model: str
    out: str
    data: list[str] = field(default_factory=list)
    msmarco: str | None = None
    beir: str | None = None
    split: str = "train"
    on_missing: str = "fail"
    depth: int = 200
    negatives: int = 15
    skip: int = 0
    pooling: str | None = None  # None: what the model says (eval.model_config), else cls
    normalize: bool | None = None  # None: what the model says, else off
    max_length: int | None = None  # passage tokens; None: what the model says, else PASSAGE_MAX_LENGTH
    query_max_length: int = 32
    batch_size: int = 64
    index: str = "flat"
    seed: int = 42
    progress: bool = True


def mine(opts: MineOptions) -> dict:
    from pretrieve.data.retrieval import load_retrieval_set
    from pretrieve.eval.encode import VOCAB_POOLINGS, DenseEncoder, EncodeOptions, VocabEncoder
    from pretrieve.eval.evaluate import vocab_search
    from pretrieve.eval.model_config import resolve_encoding
    from pretrieve.eval.search import dense_search
    from pretrieve.finetune.examples import examples_from_ids, read_all

    if opts.depth < 1 or opts.negatives < 1 or not 0 <= opts.skip < opts.depth:
        raise ValueError(f"need depth >= 1, negatives >= 1 and 0 <= skip < depth (got depth {opts.depth}, "
                         f"negatives {opts.negatives}, skip {opts.skip})")
    if bool(opts.data) + (opts.msmarco is not None) + (opts.beir is not None) != 1:
        raise ValueError("give one of --data FILE..., --msmarco DIR or --beir DIR")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)  # now, not after hours of encoding
    if opts.data:
        examples = read_all(opts.data)
        corpus = list(dict.fromkeys(t for e in examples for t in (*e.pos, *e.neg)))
    else:
        data = load_retrieval_set(opts.beir, opts.msmarco, opts.split, opts.on_missing)
        examples = examples_from_ids(data)
        corpus = [data.doc_text(d) for d in data.corpus]
    encoding = resolve_encoding(opts.model, opts.pooling, opts.normalize, opts.max_length, PASSAGE_MAX_LENGTH)
    pooling, normalize, max_length = encoding.pooling, encoding.normalize, encoding.max_length
    ids, query_ids = [str(i) for i in range(len(corpus))], [str(i) for i in range(len(examples))]
    k = opts.depth + max(len(e.pos) for e in examples)
    if pooling in VOCAB_POOLINGS:  # DupMAE's eq. (12) (or sparse / hybrid)
        encoder = VocabEncoder(opts.model, EncodeOptions(pooling, max_length, opts.batch_size))
        run = vocab_search(encoder, ids, corpus, query_ids, [e.query for e in examples], k,
                           query_max_length=opts.query_max_length, progress=opts.progress)
    else:
        encoder = DenseEncoder(opts.model, EncodeOptions(pooling, max_length, opts.batch_size, normalize))
        doc_vectors = encoder.encode(corpus, desc="encode corpus", progress=opts.progress)
        encoder.options = EncodeOptions(pooling, opts.query_max_length, opts.batch_size, normalize)  # query length
        query_vectors = encoder.encode([e.query for e in examples], desc="encode queries", progress=opts.progress,
                                        queries=True)
        run = dense_search(doc_vectors, ids, query_vectors, query_ids, k=k, index=opts.index)
    mined, short = [], 0
    for i, example in enumerate(examples):
        positives = set(example.pos)
        ranked = [corpus[int(d)] for d in sorted(run[str(i)], key=lambda d: -run[str(i)][d])]
        pool = [t for t in ranked if t not in positives][opts.skip:opts.depth]
        rng = random.Random(f"{opts.seed}/{i}")
        picked = rng.sample(pool, min(opts.negatives, len(pool)))
        short += len(picked) < opts.negatives
        mined.append(Example(example.query, example.pos, picked))
    write_examples(opts.out, mined)
    return {"out": opts.out, "queries": len(mined), "corpus": len(corpus), "pooling": pooling,
            "normalize": normalize, "queries_with_fewer_negatives": short}


@dataclass
class TeacherOptions:
    model: str  # a cross-encoder export (`pretrieve finetune` with finetune.model=cross)
    data: list[str]
    out: str
    max_length: int = 176
    batch_size: int = 64
    progress: bool = True


def teacher_scores(opts: TeacherOptions) -> dict:
    """Score every (query, passage) pair of the data with the cross-encoder; write them as pos/neg_scores."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    from pretrieve.finetune.examples import read_all
    from pretrieve.progress import track

    examples = read_all(opts.data)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    model = BertForSequenceClassification.from_pretrained(opts.model, local_files_only=True).to(device).eval()
    if model.config.num_labels != 1:
        raise ValueError(f"{opts.model}: a cross-encoder export has one output label, this model has "
                         f"{model.config.num_labels}")
    pairs = [(i, text) for i, e in enumerate(examples) for text in (*e.pos, *e.neg)]
    scores: list[float] = []
    with torch.inference_mode():
        for start in track(range(0, len(pairs), opts.batch_size), desc="teacher scores", unit="batch",
                           enabled=opts.progress, leave=False):
            chunk = pairs[start:start + opts.batch_size]
            batch = tokenizer([examples[i].query for i, _ in chunk], [t for _, t in chunk], truncation=True,
                              max_length=opts.max_length, padding=True, return_tensors="pt").to(device)
            scores.extend(model(**batch).logits.squeeze(-1).float().tolist())
    cursor = 0
    scored = []
    for e in examples:
        pos = scores[cursor:cursor + len(e.pos)]
        neg = scores[cursor + len(e.pos):cursor + len(e.pos) + len(e.neg)]
        cursor += len(e.pos) + len(e.neg)
        scored.append(Example(e.query, e.pos, e.neg, pos, neg))
    write_examples(opts.out, scored)
    return {"out": opts.out, "queries": len(scored), "pairs": len(pairs)}
