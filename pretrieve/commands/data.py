"""`pretrieve tokenizer train`, `prepare` and `stream`: raw corpora to tokenizers, shards and streams. Each
command's flags are in its `add_` function, its work in its `run_` function."""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

from pretrieve.commands.arguments import at_least, command, mixture_weight, option, options_from


def add_tokenizer(commands) -> None:
    from pretrieve.data.corpora import SOURCES, ReaderOptions
    from pretrieve.data.tokenizer_train import KINDS, TokenizerTrainOptions

    p = commands.add_parser("tokenizer", help="train a WordPiece, BPE, Unigram or decoder LLM's (--kind llm) "
                                              "tokenizer on raw corpora")
    actions = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = command(actions, "train", run_tokenizer_train)
    flag = partial(option, train, TokenizerTrainOptions, shown="%(default)s")
    train.add_argument("--source", choices=SOURCES, required=True, help="the corpus format")
    train.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files or directories")
    train.add_argument("--out", required=True, metavar="DIR", help="the tokenizer directory to write")
    flag("--kind", "wordpiece: BERT's; bpe: RoBERTa's byte-level BPE; unigram: XLM-R's SentencePiece unigram; "
         "llm: a decoder LLM's byte-level BPE (Llama 3 / Qwen split, eos ends each text)",
         choices=KINDS)
    flag("--vocab-size", "tokens in the vocabulary, special tokens included (a small corpus may give fewer)",
         type=at_least(300))
    flag("--min-frequency", "wordpiece / bpe: occurrences a merge needs", type=at_least(1))
    train.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                       help="lower-case the text (default: yes for wordpiece, as bert-base-uncased; no otherwise)")
    flag("--max-documents", "train on the first N documents only", shown="all", type=at_least(1), metavar="N")
    flag("--model-max-length", "the longest input the tokenizer config declares", type=at_least(1))
    flag("--on-error", "bad records: stop with file:line (fail) or skip and count them", choices=("fail", "skip"))
    train.add_argument("--overwrite", action="store_true", help="replace the tokenizer an earlier `tokenizer train` wrote to --out "
                       "(a folder holding anything else is refused)")
    _reader_options(partial(option, train, ReaderOptions, shown="%(default)s"), queries=False)


def _reader_options(flag, queries: bool) -> None:
    """How a corpus is read (data/corpora.py ReaderOptions), for `prepare` and `tokenizer train` alike."""
    flag("--text-field", "jsonl / parquet: field holding the text")
    flag("--id-field", "jsonl / parquet: field holding the document id")
    if queries:
        flag("--queries-field", "jsonl / parquet: optional list of pseudo-queries per document, kept for CoT-MAE; "
             "'' for none")
        flag("--title-field", "jsonl / parquet: optional title field; '' for none")
    else:
        flag("--title-field", "jsonl / parquet: optional title field, prepended to the text; '' for none")
    flag("--books-format", "books: paragraphs separated by blank lines (file) or one sentence per line (lines)",
         choices=("file", "lines"))


def run_tokenizer_train(args) -> int:
    """raw corpus -> a HF tokenizer directory for `prepare --tokenizer` and `data.tokenizer`

    Train a tokenizer (HF tokenizers) on a raw corpus, read as `prepare` reads it, and write a HF tokenizer
    directory with the conventions of its backbone family: wordpiece (BERT), bpe (RoBERTa, byte-level), unigram
    (XLM-R, SentencePiece).
    """
    from pretrieve.data.corpora import ReaderOptions
    from pretrieve.data.tokenizer_train import TokenizerTrainOptions, train_tokenizer

    record = train_tokenizer(options_from(TokenizerTrainOptions, args, inputs=args.input, reader=options_from(
        ReaderOptions, args, title_field=args.title_field or None)))
    print(f"{args.out}: {record['kind']} tokenizer of {record['vocab_size']:,} tokens from "
          f"{record['documents']:,} documents ({record['characters']:,} characters); skipped "
          f"{record['skipped'] or 'none'}; {record['fingerprint'][:19]}...")
    return 0


def add_prepare(commands) -> None:
    from pretrieve.data.corpora import SOURCES
    from pretrieve.data.pairs import PAIR_SOURCES
    from pretrieve.data.prepare_options import PrepareOptions

    p = command(commands, "prepare", run_prepare)
    flag = partial(option, p, PrepareOptions, shown="%(default)s")
    p.add_argument("--source", choices=sorted(set(SOURCES) | set(PAIR_SOURCES)),
                   help="the corpus format (needed unless --combine; msmarco with --pairs only)")
    p.add_argument("--input", nargs="+", metavar="PATH",
                   help="files or directories (needed unless --hf-dataset or --combine)")
    flag("--hf-dataset", "a Hugging Face dataset streamed in place of --input: a Hub name (wikimedia/wikipedia), a "
         "local folder (of data files, or from save_to_disk), or a builder with --hf-data-files (parquet, json)",
         shown="none", metavar="NAME")
    flag("--hf-config", "--hf-dataset: its configuration (subset), e.g. 20231101.en", shown="none", metavar="C")
    flag("--hf-split", "--hf-dataset: the split to read (a dataset with splits)", shown="train", metavar="S")
    flag("--hf-data-files", "--hf-dataset: the data files a builder reads (paths or glob patterns)", shown="none",
         nargs="+", metavar="FILE")
    flag("--hf-rows-per-document", "--hf-dataset: consecutive rows that make one document, their texts its lines "
         "(a dataset of one sentence a row: BookCorpus)", type=at_least(1), metavar="N")
    p.add_argument("--fields", nargs="+", default=None, metavar="KEY=COLUMN",
                   help="which column holds what: text, title, id, queries (documents), query, pos, neg (--pairs "
                        "records); a dotted path reaches into nested columns, COLUMN[MASK] keeps the items whose "
                        "MASK item is true ([!MASK]: false) (default: the --*-field flags, query, pos, neg)")
    p.add_argument("--out", required=True, metavar="DIR", help="a folder, or a URL (s3://, gs://, file://)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="local HF tokenizer directory "
                   "(default: the bundled bert-base-uncased WordPiece vocabulary)")
    flag("--max-len", "model sequence length; blocks hold max_len-2 tokens", type=int)
    p.add_argument("--workers", type=int, default=None,
                   help=f"tokenizer processes; 0 = in-process (default: all cores, {os.cpu_count()} here)")
    flag("--shard-size", "samples per shard", type=int)
    flag("--on-error", "bad records: stop with file:line (fail) or skip and count them in the manifest",
         choices=("fail", "skip"))
    flag("--packing", "sentences: greedy sentence packing; passage: one text per sample",
         shown="passage for msmarco-passage and beir, else sentences", choices=("sentences", "passage"))
    flag("--short-seq-prob", "probability of a shorter block target, BERT's 0.1", type=float)
    flag("--seed", "of the --short-seq-prob block targets", type=int)
    _reader_options(flag, queries=True)
    p.add_argument("--overwrite", action="store_true", help="delete an earlier output in --out first (default: off)")
    flag("--holdout", "split by document: this share of documents (by a hash of the id) is the validation side",
         shown="%(default)s, no split", type=float, metavar="FRACTION")
    flag("--split", "with --holdout: the side this --out holds, run once per side", choices=("train", "validation"))
    flag("--part", "with --parts: prepare record groups I, I+N, I+2N, ... of the input (e.g. a SLURM array task)",
         type=at_least(0), metavar="I")
    flag("--parts", "jobs the input is split over", type=at_least(1), metavar="N")
    flag("--group-records", "consecutive records per group, the unit of --part; no shard spans two groups",
         type=at_least(1), metavar="R")
    p.add_argument("--pairs", action="store_true", help="write (query, positive, negatives) pair shards; --source "
                   "wikipedia, books, msmarco, beir or jsonl (default: off, text blocks)")
    flag("--pair-method", "--pairs: sections (wikipedia), spans (books, wikipedia, jsonl), qrels (msmarco, beir), "
         "records (jsonl {query, pos, neg})", shown="the source's first", choices=("sections", "spans", "qrels",
                                                                                  "records"))
    flag("--span-method", "spans: crop (two independent crops, Contriever) or ict (a sentence -> its context)",
         choices=("crop", "ict"))
    flag("--crop-ratio-min", "crop: the smallest share of its block a crop takes", type=float)
    flag("--crop-ratio-max", "crop: the largest share of its block a crop takes", type=float)
    flag("--ict-keep-prob", "ict: how often the sentence stays in its context", type=float)
    flag("--qrels-split", "msmarco / beir pairs: the qrels split the positives come from")
    p.add_argument("--combine", nargs="+", default=None, metavar="PART",
                   help="write --out's manifest over the shards of these --part outputs (one corpus, as one job) "
                        "(default: none: prepare from --input)")


def run_prepare(args) -> int:
    """raw corpus -> tokenized, packed webdataset shards + manifest.json

    Read a raw corpus, tokenize, pack sentences into blocks and write webdataset shards and manifest.json.
    Re-running resumes. Split over jobs: --part I --parts N in each (own --out), then --combine.
    """
    from pretrieve.data.combine import combine
    from pretrieve.data.fields import parse_fields
    from pretrieve.data.prepare import prepare
    from pretrieve.data.prepare_options import PrepareOptions
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER
    from pretrieve.utils.options import default_of

    if args.combine:
        if args.source or args.input or args.hf_dataset:
            raise ValueError("--combine joins prepared parts; it takes no --source, --input or --hf-dataset")
        _print_prepared(args.out, combine(args.combine, args.out))
        return 0
    if not args.source or not (args.input or args.hf_dataset):
        raise ValueError("--source and --input (or --hf-dataset) are needed (or --combine PART... to join the parts "
                         "of a split run)")
    fields = {"title_field": args.title_field or None, "queries_field": args.queries_field or None,
              **{f"{key}_field": column for key, column in parse_fields(args.fields).items()}}
    _print_prepared(args.out, prepare(options_from(
        PrepareOptions, args, inputs=args.input or [], tokenizer=args.tokenizer or DEFAULT_TOKENIZER,
        workers=default_of(PrepareOptions, "workers") if args.workers is None else args.workers, **fields)))
    return 0


def _print_prepared(out: str, m: dict) -> None:
    if m.get("kind") == "pairs":
        print(f"{out}: {m['num_samples']:,} pairs {m['pair_kinds']} from {m['num_documents']:,} records, "
              f"{m['num_tokens']:,} tokens in {len(m['shards'])} shards; duplicates dropped {m['duplicate_pairs']}; "
              f"skipped {m['skipped'] or 'none'}; texts truncated {m['truncated_texts']}")
        return
    print(f"{out}: {m['num_documents']:,} documents -> {m['num_samples']:,} samples, {m['num_tokens']:,} tokens "
          f"in {len(m['shards'])} shards; skipped {m['skipped'] or 'none'}; truncated {m['truncated_documents']}")


def add_stream(commands) -> None:
    p = command(commands, "stream", run_stream)
    p.add_argument("manifests", nargs="+", metavar="MANIFEST", help="manifest.json files (or their directories)")
    p.add_argument("--weights", type=mixture_weight, nargs="+", default=None, help="mixture weights, one per manifest")
    p.add_argument("--epochs", type=at_least(1), default=1)
    p.add_argument("--batch-size", type=at_least(1), default=32)
    p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader workers")
    p.add_argument("--shuffle-buffer", type=at_least(1), default=1000)
    p.add_argument("--seed", type=int, default=0)


def run_stream(args) -> int:
    """stream shards for N epochs and print counts and throughput

    Read prepared shards through the training stream (mixture, shuffle, rank/worker split) and report what came out.
    """
    from pretrieve.data.stream_counts import epoch_counts

    for counts in epoch_counts(args.manifests, epochs=args.epochs, batch_size=args.batch_size, workers=args.workers,
                               shuffle_buffer=args.shuffle_buffer, seed=args.seed, weights=args.weights):
        print(json.dumps(counts))
    return 0
