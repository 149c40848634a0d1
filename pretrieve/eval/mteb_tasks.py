"""The MTEB tasks of `pretrieve eval --mteb`: by task name (`SciFact`), by benchmark name (`"MTEB(eng, v2)"`, `BEIR`:
its retrieval tasks), or a local BEIR folder as a task of its own (MTEB's custom tasks: an AbsTaskRetrieval whose
data pretrieve's BEIR reader loads, so nothing is fetched).

MTEB loads a named task's data from the Hugging Face cache, and compute nodes have no network: the hub is put in
offline mode while MTEB runs (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, also in the `huggingface_hub` and `datasets`
modules already imported, which read them at import), so a task whose data is not cached fails at once, with an
error naming the task and its dataset, instead of waiting on a network timeout (docs/evaluation.md says how to fill
the cache on a login node).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mteb
from mteb.abstasks import AbsTask
from mteb.abstasks.aggregated_task import AbsTaskAggregate
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.task_metadata import TaskMetadata

from pretrieve.data.retrieval import load_retrieval_set

OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
FILL_CACHE = ("python -c \"import mteb; [t.load_data() for t in mteb.get_tasks(tasks=[{names}])]\" on a machine with "
              "network and the same HF_HOME")


@dataclass
class RequestedTask:
    """A task as given: what MTEB evaluates (the subtasks of an aggregate, such as CQADupstackRetrieval) and the
    aggregate that combines their results, if any."""
    name: str
    tasks: list[AbsTask]
    aggregate: AbsTaskAggregate | None = None
    local: bool = False  # a BEIR folder's own task: no data to fetch
    left_out: list[str] = field(default_factory=list)


def requested_tasks(spec: str, split: str | None = None) -> list[RequestedTask]:
    """The tasks of `--mteb` (comma-separated names, benchmark names or BEIR folders); `split`: the split to
    evaluate (default: each task's own; a folder's: test)."""
    found = []
    for name in (item.strip() for item in _split_names(spec)):
        folder = Path(name)
        if (folder / "corpus.jsonl").is_file():
            found.append(RequestedTask(folder.name, [local_task(folder, split or "test")], local=True))
            continue
        if folder.is_dir():
            raise ValueError(f"--mteb {name}: a folder without corpus.jsonl; give a BEIR folder (corpus.jsonl, "
                             "queries.jsonl, qrels/SPLIT.tsv), an MTEB task or a benchmark name")
        benchmark = _benchmark(name)
        tasks = benchmark.tasks if benchmark is not None else [_task(name)]
        retrieval = [t for t in tasks if t.metadata.type == "Retrieval"]
        left_out = [t.metadata.name for t in tasks if t.metadata.type != "Retrieval"]
        if benchmark is None and left_out:
            raise ValueError(f"--mteb {name}: a {tasks[0].metadata.type} task; pretrieve evaluates retrievers on "
                             "MTEB's Retrieval tasks")
        if left_out:
            print(f"pretrieve: --mteb {name}: its {len(retrieval)} Retrieval tasks are evaluated; its other "
                  f"{len(left_out)} tasks are not retrieval and are left out ({', '.join(left_out)})", file=sys.stderr)
        for task in retrieval:
            if split is not None:
                task = mteb.get_task(task.metadata.name, eval_splits=[split])
            if isinstance(task, AbsTaskAggregate):
                found.append(RequestedTask(task.metadata.name, list(task.metadata.tasks), aggregate=task))
            else:
                found.append(RequestedTask(task.metadata.name, [task]))
    if not found:
        raise ValueError("--mteb: no task given")
    return found


def _split_names(spec: str) -> list[str]:
    """Names split at commas, but not inside a benchmark's parentheses (`MTEB(eng, v2)`)."""
    names, depth, current = [], 0, ""
    for char in spec:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            names.append(current)
            current = ""
        else:
            current += char
    return [n for n in (*names, current) if n.strip()]


def _benchmark(name: str):
    try:
        return mteb.get_benchmark(name)
    except KeyError:
        return None


def _task(name: str) -> AbsTask:
    try:
        return mteb.get_task(name)
    except KeyError as e:
        raise ValueError(f"--mteb {name}: no such MTEB task or benchmark ({e.args[0]})") from None


def local_task(folder: Path, split: str) -> AbsTaskRetrieval:
    """A BEIR folder as an MTEB retrieval task: MTEB's own retrieval evaluation of pretrieve's reading of it."""
    data = load_retrieval_set(beir=folder, split=split)
    ids = list(data.corpus)
    corpus = {"id": ids, "title": [data.corpus[d][0] for d in ids], "text": [data.corpus[d][1] for d in ids]}
    queries = {"id": list(data.queries), "text": list(data.queries.values())}
    metadata = TaskMetadata(
        name=folder.name, description=f"the BEIR folder {folder.resolve()}", type="Retrieval", category="t2t",
        dataset={"path": str(folder.resolve()), "revision": "local"}, eval_splits=[split], eval_langs=["eng-Latn"],
        main_score="ndcg_at_10", modalities=["text"])

    class LocalRetrieval(AbsTaskRetrieval):
        def load_data(self, num_proc=None, **kwargs) -> None:
            from datasets import Dataset

            self.dataset = {"default": {split: {"corpus": Dataset.from_dict(corpus),
                                                "queries": Dataset.from_dict(queries),
                                                "relevant_docs": {q: dict(d) for q, d in data.qrels.items()},
                                                "top_ranked": None}}}
            self.data_loaded = True

    LocalRetrieval.metadata = metadata
    return LocalRetrieval()


@contextmanager
def offline_hub():
    """The Hugging Face hub in offline mode inside the block: set in the environment and in the modules that read it
    at import; restored after."""
    saved_env = {name: os.environ.get(name) for name in OFFLINE_VARIABLES}
    os.environ.update({name: "1" for name in OFFLINE_VARIABLES})
    modules = [m for m in (sys.modules.get("huggingface_hub.constants"), sys.modules.get("datasets.config")) if m]
    saved = [(m, name, getattr(m, name)) for m in modules for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
             if hasattr(m, name)]
    for module, name, _ in saved:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_cached(requested: list[RequestedTask]) -> None:
    """Every named task's data is in the Hugging Face cache (checked offline, before any encoding), or a
    ValueError names each missing task, its dataset and revision, and how to fill the cache."""
    from datasets import get_dataset_config_names

    missing = []
    for item in requested:
        for task in ([] if item.local else item.tasks):
            dataset = task.metadata.dataset
            try:
                get_dataset_config_names(dataset["path"], revision=dataset.get("revision"))
            except (ConnectionError, OSError, FileNotFoundError, ValueError) as e:
                missing.append((task.metadata.name, dataset, type(e).__name__))
    if missing:
        from huggingface_hub.constants import HF_HUB_CACHE

        listed = "; ".join(f"{name}: {d['path']} (revision {d.get('revision')}, {error})"
                           for name, d, error in missing)
        names = ", ".join(repr(name) for name, _, _ in missing)
        raise ValueError(f"--mteb: the data of {len(missing)} task(s) is not in the Hugging Face cache "
                         f"({HF_HUB_CACHE}), and pretrieve runs MTEB offline: {listed}. Fill the cache with "
                         f"{FILL_CACHE.format(names=names)} (docs/evaluation.md, \"MTEB\")")
