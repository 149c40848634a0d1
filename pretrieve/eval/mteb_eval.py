"""`pretrieve eval --model DIR --mteb TASK[,TASK...]`: the `mteb` package's own evaluation of an export, with
pretrieve's outputs beside MTEB's.

OUT/mteb/ is an MTEB result cache: `results/<model>/local/<Task>.json` in MTEB's own result format (and
`model_meta.json`), which `mteb.load_results` and the leaderboard read. It is written to OUT/.mteb.tmp and
renamed when every task is scored; a failed or stopped evaluation removes it (and OUT, when it made OUT and
nothing else is there). With `dim`, MTEB scores the vectors cut to their first N coordinates, re-normalised
when the encoding normalises, as `pretrieve eval --dim` searches them (eval.encode). OUT/metrics.json holds
MTEB's scores under pretrieve's names (ndcg@10 <- ndcg_at_10, mrr@10, mrr@100, recall@100, recall@1000,
map <- map_at_1000) and `mteb_main_score`; with several tasks, each task's as `<Task>/ndcg@10` ... and the mean over tasks (MTEB's
average) as `ndcg@10` .... OUT/run.trec holds MTEB's ranking and OUT/per_query.jsonl its trec_eval metrics per
query (eval.metrics), the query ids prefixed `<Task>/` when there are several tasks, subsets or splits, so `pretrieve
track` and the farm log an MTEB evaluation like any other. A task that ignores identical ids (ArguAna, Quora:
a query is also a document) drops those self-hits from run.trec as MTEB does from its scores.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from pretrieve.eval.metrics import evaluate, trec_run_lines
from pretrieve.eval.mteb_model import ExportEncoder
from pretrieve.eval.mteb_tasks import check_cached, offline_hub, requested_tasks
from pretrieve.eval.options import EvalOptions
from pretrieve.utils.output_folder import replace_directory, staging_folder
from pretrieve.utils.run_dir import write_atomic

MTEB_METRICS = {"ndcg@10": "ndcg_at_10", "mrr@10": "mrr_at_10", "mrr@100": "mrr_at_100",
                "recall@100": "recall_at_100", "recall@1000": "recall_at_1000", "map": "map_at_1000"}
RESULTS = "mteb"  # OUT/mteb: MTEB's result cache


def run_mteb(opts: EvalOptions, encoding) -> dict:
    """Evaluate the export on the tasks of `opts.mteb` with MTEB; returns metrics.json's content."""
    import mteb

    started = time.perf_counter()
    out = Path(opts.out)
    made = not out.exists()
    staging = staging_folder(out / RESULTS)  # MTEB's cache, renamed to OUT/mteb once every task is scored
    try:
        with offline_hub():
            requested = requested_tasks(opts.mteb, opts.split)
            check_cached(requested)
            model = ExportEncoder(opts.model, encoding, opts.batch_size, opts.progress, opts.dim)
            cache = mteb.ResultCache(staging)
            results, run, per_query = {}, {}, {}
            prefixed = sum(len(task.eval_splits) * len(task.hf_subsets) for r in requested for task in r.tasks) > 1
            for item in requested:
                task_results = [_evaluate(task, model, cache, opts, run, per_query, prefixed) for task in item.tasks]
                if item.aggregate is not None:  # CQADupstackRetrieval: the mean of its subtasks, as MTEB keeps it
                    combined = item.aggregate.combine_task_results(task_results)
                    cache.save_to_cache(combined, model.mteb_model_meta)
                    task_results = [combined]
                results[item.name] = _scores(task_results)
    except BaseException:  # a failed or stopped evaluation leaves nothing half-written (nor an OUT it made)
        shutil.rmtree(staging, ignore_errors=True)
        with suppress(OSError):
            if made:
                out.rmdir()  # only when empty
        raise
    replace_directory(staging, out / RESULTS)
    info = {"retriever": "mteb", "model": str(Path(opts.model).resolve()), "mteb": opts.mteb,
            "mteb_tasks": ",".join(results), "dataset": opts.mteb if len(results) > 1 else next(iter(results)),
            "mteb_local": any(item.local for item in requested),  # a BEIR folder: no MTEB task of that name
            "pooling": encoding.pooling, "normalize": encoding.normalize, "max_length": encoding.max_length,
            "dim": opts.dim,
            "query_prompt": encoding.query_prompt, "passage_prompt": encoding.passage_prompt,
            "encoding_from": encoding.source, "batch_size": opts.batch_size, "queries": len(per_query),
            "mteb_results": str((out / RESULTS / "results").resolve()),
            "seconds": round(time.perf_counter() - started, 1)}
    metrics = _summary(results)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "run.trec", "".join(line + "\n" for line in trec_run_lines(run, "mteb")))
    write_atomic(out / "per_query.jsonl", "".join(json.dumps({"query_id": q, **m}) + "\n"
                                                   for q, m in per_query.items()))
    result = {**metrics, **info}
    write_atomic(out / "metrics.json", json.dumps(result, indent=1) + "\n")  # last: its presence means done
    return result


def _evaluate(task, model: ExportEncoder, cache, opts: EvalOptions, run: dict, per_query: dict, prefixed: bool):
    """MTEB's result of one task; its ranking and per-query metrics added to `run` and `per_query`."""
    import mteb

    name = task.metadata.name
    task.load_data()  # here, so that the judgements stay loaded after MTEB's evaluation (it unloads what it loads)
    qrels = {(subset, split): {q: dict(d) for q, d in task.dataset[subset][split]["relevant_docs"].items() if d}
             for subset in task.dataset for split in task.dataset[subset] if split in task.eval_splits}
    predictions = Path(tempfile.mkdtemp(prefix=".mteb-predictions-", suffix=".tmp",
                                        dir=opts.out if Path(opts.out).is_dir() else None))
    try:
        result = mteb.evaluate(model, task, cache=cache, overwrite_strategy="always", prediction_folder=predictions,
                               encode_kwargs={"batch_size": opts.batch_size}, show_progress_bar=opts.progress)
        ranked = json.loads(next(predictions.glob("*.json")).read_text())
    finally:
        shutil.rmtree(predictions, ignore_errors=True)
        task.unload_data()
    for (subset, split), judged in qrels.items():
        found = ranked[subset][split]
        if task.ignore_identical_ids:
            found = {q: {d: s for d, s in docs.items() if d != q} for q, docs in found.items()}
        found = {q: dict(sorted(docs.items(), key=lambda i: -i[1])[:opts.depth]) for q, docs in found.items()}
        _, scores = evaluate(judged, found)
        prefix = "/".join(p for p in (name, subset if subset != "default" else "", split) if p) + "/" \
            if prefixed else ""
        run.update({prefix + q: docs for q, docs in found.items() if q in judged})
        per_query.update({prefix + q: m for q, m in scores.items()})
    return result.task_results[0]


def _scores(task_results) -> dict:
    """pretrieve's names of MTEB's scores of one task: the mean over its splits and subsets."""
    entries = [entry for result in task_results for split in result.scores.values() for entry in split]
    keys = {**MTEB_METRICS, "mteb_main_score": "main_score"}
    return {ours: round(sum(e[theirs] for e in entries) / len(entries), 6) for ours, theirs in keys.items()
            if all(theirs in e for e in entries)}


def _summary(results: dict[str, dict]) -> dict:
    """One task's scores as they are; several tasks' means, and each task's under `<Task>/`."""
    if len(results) == 1:
        return next(iter(results.values()))
    keys = set.intersection(*(set(scores) for scores in results.values()))
    means = {k: round(sum(s[k] for s in results.values()) / len(results), 6) for k in sorted(keys)}
    return {**means, **{f"{task}/{k}": v for task, scores in results.items() for k, v in scores.items()}}

