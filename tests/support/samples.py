"""The bundled samples made into what the commands read: shards, BEIR folders, a tiny checkpoint to start from."""
from pathlib import Path

from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareOptions

from .paths import SAMPLES


def prepare_sample(out: Path, source: str, folder: str, **kwargs) -> dict:
    opts = PrepareOptions(source=source, inputs=[str(SAMPLES / folder)], out=str(out), workers=0, **kwargs)
    return prepare(opts)


def write_beir(out: Path, data, query_ids: list[str], doc_ids: list[str]) -> Path:
    """A BEIR folder at OUT with those queries of `data` (retrieval.load_beir), their test qrels, and those
    documents."""
    import json

    (out / "qrels").mkdir(parents=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": data.corpus[d][0],
                                                          "text": data.corpus[d][1]}) + "\n" for d in doc_ids))
    (out / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": data.queries[q]}) + "\n"
                                               for q in query_ids))
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{q}\t{d}\t{r}\n" for q in query_ids for d, r in data.qrels[q].items()))
    return out


def beir_subset(out: Path, queries: int, other_docs: int) -> Path:
    """A BEIR folder at OUT with the bundled SciFact sample's first QUERIES queries, the documents judged for them
    and its first OTHER_DOCS other documents: real text, small enough for a full-size encoder on 2 cores."""
    from pretrieve.data.retrieval import load_beir

    data = load_beir(SAMPLES / "beir" / "scifact-sample")
    query_ids = [q for q in data.queries if q in data.qrels][:queries]
    judged = {d for q in query_ids for d in data.qrels[q]}
    doc_ids = [d for d in data.corpus if d in judged] + [d for d in data.corpus if d not in judged][:other_docs]
    return write_beir(out, data, query_ids, doc_ids)


def save_tiny_bert(out: Path, hidden: int, intermediate: int) -> Path:
    """A random 2-layer BERT (seed 0, dropout on) with the default tokenizer in `out`: what fine-tuning starts from."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=intermediate)).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(DEFAULT_TOKENIZER).save_pretrained(str(out))
    return out
