"""Cut the small real samples shipped in pretrieve/assets/samples/ from ../shared/data.

Run from the repo root: `python tools/make_samples.py [SHARED_DATA_DIR]`. Deterministic: the same input
gives byte-identical samples. One sample per raw format `pretrieve prepare` reads.
"""
import gzip
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARED = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
OUT = Path("pretrieve/assets/samples")


def read_jsonl(path, limit=None):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)


def write_text(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main():
    wiki = list(read_jsonl(SHARED / "pretrain/enwiki-sample/enwiki_2015_wikiextractor_100shards.jsonl.gz", 140))
    # WikiExtractor JSON lines, gzip: the first 60 articles.
    (OUT / "wikipedia").mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(OUT / "wikipedia/wiki_00.jsonl.gz", "wb", mtime=0) as f:
        f.write("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in wiki[:60]).encode())
    # HF datasets-style parquet with title/text: the next 40 articles.
    table = pa.table({k: [a[k] for a in wiki[60:100]] for k in ("id", "url", "title", "text")})
    (OUT / "wikipedia-parquet").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, OUT / "wikipedia-parquet/train-00000-of-00001.parquet")
    # MS MARCO document format (docid, url, title, body), from 40 more articles (real URLs).
    rows = []
    for a in wiki[100:140]:
        body = " ".join(a["text"].split())
        rows.append(f"D{a['id']}\t{a['url']}\t{a['title']}\t{body}\n")
    write_text(OUT / "msmarco-doc/msmarco-docs.tsv", "".join(rows))

    # Books: two public-domain Gutenberg books, one file per book (first 2,000 lines of Moby Dick).
    gut = SHARED / "pretrain/gutenberg"
    write_text(OUT / "books/blake-poems.txt", (gut / "blake-poems.txt").read_text(encoding="utf-8"))
    moby = (gut / "melville-moby_dick.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    write_text(OUT / "books/melville-moby_dick-part.txt", "".join(moby[:2000]))

    # BEIR: SciFact test queries 0-99 with every judged document, plus filler documents up to 500.
    scifact = SHARED / "beir/scifact"
    qrels = [line.rstrip("\n").split("\t") for line in open(scifact / "qrels/test.tsv", encoding="utf-8")][1:]
    qids = sorted({q for q, _, _ in qrels}, key=int)[:100]
    qrels = [r for r in qrels if r[0] in qids]
    judged = {d for _, d, _ in qrels}
    corpus = list(read_jsonl(scifact / "corpus.jsonl"))
    docs = [d for d in corpus if d["_id"] in judged]
    docs += [d for d in corpus if d["_id"] not in judged][: 500 - len(docs)]
    beir = OUT / "beir/scifact-sample"
    write_text(beir / "corpus.jsonl", "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    queries = [q for q in read_jsonl(scifact / "queries.jsonl") if q["_id"] in qids]
    write_text(beir / "queries.jsonl", "".join(json.dumps(q, ensure_ascii=False) + "\n" for q in queries))
    write_text(beir / "qrels/test.tsv", "query-id\tcorpus-id\tscore\n" + "".join("\t".join(r) + "\n" for r in qrels))

    # MS MARCO passage format (pid, passage): the same SciFact documents, title + text on one line.
    write_text(
        OUT / "msmarco-passage/collection.tsv",
        "".join(f"{d['_id']}\t{' '.join((d['title'] + ' ' + d['text']).split())}\n" for d in docs),
    )
    # Generic JSON lines (pyserini style {"id", "contents"}): 300 CACM abstracts.
    cacm = list(read_jsonl(SHARED / "beir/cacm/corpus.jsonl", 300))
    write_text(
        OUT / "jsonl/cacm-300.jsonl",
        "".join(json.dumps({"id": d["_id"], "contents": f"{d['title']}\n{d['text']}"}) + "\n" for d in cacm),
    )
    # Fine-tuning JSON lines (query, pos, neg, pos_scores, neg_scores): FlagEmbedding's MS MARCO example, as is.
    for name in ("embedder_retrieval_msmarco.jsonl", "LICENSE.FlagEmbedding"):
        write_text(OUT / "finetune" / name, (SHARED / "finetune-examples" / name).read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
