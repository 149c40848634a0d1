"""Evaluation and mining at MS MARCO scale, in bounded memory: wall time and peak RSS of every stage.

    python -m benchmarks.eval_scale [--sizes 100000 300000 1000000] [--queries 1000] [--data ../shared/data]
                                    [--work bench-out/eval-scale] [--out benchmarks/results/eval_scale.json]
                                    [--stages encode eval mine bm25] [--again]

Per size N, a synthetic MS MARCO-format folder (collection.tsv, queries.dev.tsv / queries.train.tsv,
qrels.dev.tsv / qrels.train.tsv in TREC form) of N passages cut from the shared Wikipedia sample: windows of
PASSAGE_WORDS words of its articles, taken again at a shifted offset on each further pass until N; a query is
QUERY_WORDS words from the middle of its judged passage. The encoder is a random 2-layer BERT (hidden 64, the
bundled tokenizer): the model's cost is not what is measured. Each stage runs as processes of its own, and each
process's peak RSS comes from the kernel (os.wait4):
    encode   `pretrieve encode --workers 2`, workers 0 and 1 side by side, one torch thread each
    eval     `pretrieve eval --embeddings` (dense, exact search shard by shard)
    mine     `pretrieve mine --embeddings` (the train queries' negatives)
    bm25     `pretrieve eval --bm25`
The results file is written after every stage; a rerun skips the stages it holds (resumable), unless `--again`
(then the `--stages` given are measured again and replace theirs). The targets: encode's peak RSS within 20 %
from the smallest size to the largest (`encode_rss_growth`); BM25's at most 1.5 GB at 1M passages and within 30 %
from 300k to 1M (`bm25_rss_growth`, when both sizes ran).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pretrieve.utils.run_dir import write_atomic

ROOT = Path(__file__).resolve().parent.parent
WIKIPEDIA = Path("pretrain") / "enwiki-sample" / "enwiki_2015_wikiextractor_100shards.jsonl.gz"
PASSAGE_WORDS = 60  # MS MARCO passages average about 56 words
QUERY_WORDS = 6  # MS MARCO queries average about 6 words
WORKERS = 2
STAGES = ("encode", "eval", "mine", "bm25")


def articles(path: Path):
    with gzip.open(path, "rt") as f:
        for line in f:
            yield json.loads(line)["text"].split()


def windows(wikipedia: Path):
    """Passages of PASSAGE_WORDS words, pass after pass over the articles, each pass starting further in."""
    for shift in itertools.count():
        for words in articles(wikipedia):
            for start in range(shift * 7 % PASSAGE_WORDS, len(words) - PASSAGE_WORDS + 1, PASSAGE_WORDS):
                yield words[start:start + PASSAGE_WORDS]


def write_collection(wikipedia: Path, folder: Path, size: int, queries: int) -> None:
    """FOLDER/collection.tsv of `size` passages and two judged query sets of `queries` each (dev: the first
    passage of each stride, train: the middle one), written whole or not at all."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stride, middle = size // queries, PASSAGE_WORDS // 2
    judged = {"dev": {}, "train": {}}  # pid -> query text
    with open(tmp / "collection.tsv", "w") as out:
        for pid, window in enumerate(itertools.islice(windows(wikipedia), size)):
            out.write(f"{pid}\t{' '.join(window)}\n")
            if pid % stride in (0, stride // 2) and pid // stride < queries:
                judged["dev" if pid % stride == 0 else "train"][pid] = " ".join(window[middle:middle + QUERY_WORDS])
    for split, pairs in judged.items():
        (tmp / f"queries.{split}.tsv").write_text("".join(f"{pid}\t{text}\n" for pid, text in pairs.items()))
        (tmp / f"qrels.{split}.tsv").write_text("".join(f"{pid}\t0\t{pid}\t1\n" for pid in pairs))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def tiny_encoder(out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import BertConfig, BertModel

    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)) \
        .save_pretrained(tmp)
    for file in Path(DEFAULT_TOKENIZER).iterdir():
        shutil.copy(file, tmp / file.name)
    tmp.rename(out)
    return out


def run_processes(commands: list[list[str]], logs: list[Path]) -> dict:
    """Run `pretrieve` commands side by side; their wall time and each one's peak RSS (MiB, from the kernel)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    procs = []
    for command, log in zip(commands, logs):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "pretrieve", *command], stdout=f,
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    peaks = []
    for proc, log in zip(procs, logs):
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"eval_scale: `pretrieve {' '.join(commands[procs.index(proc)])}` failed "
                             f"(exit {proc.returncode}); its log: {log}")
        peaks.append(round(usage.ru_maxrss / 1024, 1))  # KiB on Linux
    return {"wall_s": round(time.perf_counter() - started, 1), "peak_rss_mib": max(peaks),
            "peak_rss_mib_each": peaks}


def stages(model: Path, marco: Path, work: Path) -> dict[str, list[list[str]]]:
    vectors = work / "vectors"
    # one max length for all three: vectors are reused only with the settings they were made with
    common = ["--model", str(model), "--msmarco", str(marco), "--pooling", "cls", "--max-length", "144"]
    return {
        "encode": [["encode", *common, "--out", str(vectors), "--worker", str(i), "--workers", str(WORKERS)]
                   for i in range(WORKERS)],
        "eval": [["eval", *common, "--split", "dev", "--embeddings", str(vectors), "--out", str(work / "eval"),
                  "--overwrite"]],
        "mine": [["mine", *common, "--split", "train", "--embeddings", str(vectors), "--out",
                  str(work / "negatives.jsonl")]],
        "bm25": [["eval", "--bm25", "--msmarco", str(marco), "--split", "dev", "--out", str(work / "bm25"),
                  "--overwrite"]],  # a stage measured again replaces its evaluation
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    p.add_argument("--queries", type=int, default=1000, help="judged queries per split (default %(default)s)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"), help="the shared data (pretrain/)")
    p.add_argument("--work", default=str(ROOT / "bench-out" / "eval-scale"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "eval_scale.json"))
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES),
                   help="the stages to run (eval and mine need encode's vectors)")
    p.add_argument("--again", action="store_true", help="measure the --stages again though the results hold them")
    args = p.parse_args(argv)
    wikipedia = Path(args.data) / WIKIPEDIA
    if not wikipedia.is_file():
        p.error(f"--data {args.data}: no {WIKIPEDIA} there")
    if min(args.sizes) < 2 * args.queries:
        p.error(f"--sizes: each must be at least 2 x --queries ({2 * args.queries}): a query judges one passage")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.is_file() else {}
    settings = {"passage_words": PASSAGE_WORDS, "query_words": QUERY_WORDS, "queries_per_split": args.queries,
                "encoder": "BERT 2 x 64, random", "encode_workers": WORKERS, "threads_per_process": 1}
    if results.setdefault("settings", settings) != settings:
        p.error(f"{out} holds results of other settings ({results['settings']}); give another --out")
    results["machine"] = f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') >> 30} GiB"
    model = tiny_encoder(work / "encoder")
    for size in args.sizes:
        entry = results.setdefault("sizes", {}).setdefault(str(size), {})
        marco, size_work = work / f"marco-{size}", work / f"run-{size}"
        if not (marco / "qrels.train.tsv").is_file():
            print(f"[eval_scale] writing {size:,} passages to {marco}", file=sys.stderr, flush=True)
            write_collection(wikipedia, marco, size, args.queries)
        entry["collection_mib"] = round((marco / "collection.tsv").stat().st_size / 2**20, 1)
        size_work.mkdir(exist_ok=True)
        for name, commands in stages(model, marco, size_work).items():
            if name not in args.stages or (name in entry and not args.again):
                continue
            print(f"[eval_scale] {size:,}: {name}", file=sys.stderr, flush=True)
            logs = [size_work / f"{name}-{i}.log" for i in range(len(commands))]
            entry[name] = run_processes(commands, logs)
            if name in ("eval", "bm25"):  # a check that the stage searched: a random encoder is near 0, BM25 is not
                entry[name]["ndcg@10"] = json.loads((size_work / name / "metrics.json").read_text())["ndcg@10"]
            write_atomic(out, json.dumps(results, indent=1) + "\n")
            print(f"[eval_scale] {size:,}: {name}: {entry[name]}", file=sys.stderr, flush=True)
    encode = [results["sizes"][str(s)]["encode"]["peak_rss_mib"] for s in args.sizes if "encode" in
              results["sizes"].get(str(s), {})]
    if len(encode) > 1:  # the target: encode's memory flat in corpus size, within 20 % from the smallest to the largest
        results["encode_rss_growth"] = round(encode[-1] / encode[0] - 1, 3)
    bm25 = [results["sizes"].get(str(s), {}).get("bm25", {}).get("peak_rss_mib") for s in (300_000, 1_000_000)]
    if all(bm25):  # the target: within 30 % from 300k to 1M passages
        results["bm25_rss_growth"] = round(bm25[1] / bm25[0] - 1, 3)
    write_atomic(out, json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "settings"}, indent=1))


if __name__ == "__main__":
    main()
