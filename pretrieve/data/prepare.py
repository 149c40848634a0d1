"""`pretrieve prepare`: raw corpus -> tokenized, packed webdataset shards + manifest.json.

Pipeline: a reader (corpora.py) yields records in file order; chunks of records go to `workers` processes
that tokenize (HF fast tokenizer, one thread each) and pack (packing.py); the main process writes the
results in input order into shards of `shard_size` samples (shards.py). The output does not depend on the
number of workers.

Crash safety and resume: shards are renamed into place only when complete, and after each one a state
file records where the next shard starts (record index, block index, and the reader's cursor: file, byte
offset or row) and the skip counts so far. Re-running the same command reads on from the cursor, neither
parsing nor tokenizing the records already in complete shards. The manifest is written last, atomically; its
presence means the directory is complete.

Parts (`--part i --parts n`): records (corpora.py numbers them over the whole input) form groups of
`group_records` consecutive records, and a shard never spans two groups, in a single job as in a part. Part
i prepares groups i, i + n, i + 2n, ... and counts the other records without parsing them. Its shards are
therefore byte for byte the single job's shards of those groups (the packing's random draws are seeded by the
record index), and `combine.py` lists all parts' shards in group order: the single job's shard table, which
the stream (a function of shard sizes and contents) reads into the same samples in the same order.

Remote output (`--out s3://bucket/shards/wiki`, `gs://...`, any fsspec URL that can be written; `file://` is
local): the job runs into a local staging folder (`stage`, default a folder under TMPDIR named after the URL
and the job, so re-running the command resumes there), then the shards are uploaded, then the manifest under a temporary
name, moved into place last. Object stores show an upload whole or not at all, and no manifest names a shard
before all of them are up, so the remote folder is complete when its manifest exists, as a local one is.

Held-out splits (`--holdout FRACTION --split train|validation`): a document is on the validation side when
the hash of its id falls below FRACTION (`holdout_side`), so the two invocations, one per side, split the
corpus by document, disjointly and the same way on every machine; records of the other side are not tokenized.

Hugging Face datasets (`--hf-dataset NAME` in place of `--input`): hf_datasets.py streams the rows, each a record
read with the field mapping (`--fields`); the cursor is (the stream's shard, the row in it), so a resume starts at
that shard. The manifest's `inputs` names the dataset, the config and split it was read with (where it has
them) and the data files they resolved to.

Pairs (`--pairs`): the records are read by pairs.py's readers (the same cursors, so the same resume) and each
gives (query, positive, negatives) samples instead of blocks; the manifest says `"kind": "pairs"`. A pair
whose query and positive tokens an earlier pair had is dropped and counted (`duplicate_pairs`); a resumed run
learns the pairs already written from its complete shards.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import numpy as np

from pretrieve import __version__
from pretrieve.data import corpora, pairs, remote
from pretrieve.data.corpora import BadRecord, CorpusError, Cursor, Document, ReaderOptions
from pretrieve.data.hf_datasets import HFDataset
from pretrieve.data.packing import pack_sentences, sentence_starts, sentence_token_bounds
from pretrieve.data.shards import MANIFEST_FORMAT, ShardStats, ShardWriter, read_shard, token_extension
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, describe, load_backend
from pretrieve.utils.options import default_of
from pretrieve.utils.output_folder import check_own_entries
from pretrieve.utils.run_lock import LOCK_FILE, DirectoryLock

MANIFEST = "manifest.json"
STATE = ".prepare-state.json"
PASSAGE_SOURCES = ("msmarco-passage", "beir")  # one text per sample by default
CHUNK_CHARS = 1 << 20  # text sent to a worker at a time


class PrepareError(RuntimeError):
    pass


@dataclass
class PrepareOptions:
    source: str
    inputs: list[str]
    out: str
    tokenizer: str = DEFAULT_TOKENIZER
    max_len: int = 512
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    shard_size: int = 10000
    on_error: str = "fail"  # fail | skip
    packing: str | None = None  # sentences | passage; None = passage for passage corpora, else sentences
    short_seq_prob: float = 0.0
    seed: int = 42
    text_field: str = "text"
    id_field: str = "id"
    title_field: str | None = "title"
    queries_field: str | None = "queries"
    books_format: str = "file"
    overwrite: bool = False
    progress: bool | None = None  # None/True: a bar on a terminal, periodic lines otherwise; False: silent
    holdout: float = 0.0  # share of documents on the validation side (0: no split)
    split: str = "train"  # which side this output holds when holdout > 0: train | validation
    stage: str | None = None  # remote `out`: the local folder the job runs in before the upload
    part: int = 0  # this job's share of the input: record groups part, part + parts, part + 2 parts, ...
    parts: int = 1
    group_records: int = 100_000  # consecutive records per group; no shard spans two groups
    # --pairs: (query, positive, negatives) samples (pairs.py says what each source gives)
    pairs: bool = False
    pair_method: str | None = None  # sections | spans | qrels | records; None: the source's first (pairs.PAIR_METHODS)
    span_method: str = "crop"  # spans: crop (Contriever's two independent crops) | ict (sentence -> its context)
    crop_ratio_min: float = 0.1  # crop: a crop's share of its block, drawn uniformly (Contriever's 0.1-0.5)
    crop_ratio_max: float = 0.5
    ict_keep_prob: float = 0.1  # ict: how often the sentence stays in its context (Lee et al. 2019: 0.1)
    qrels_split: str = "train"  # msmarco / beir: the qrels the pairs come from
    query_field: str = "query"  # records: the fields of a pair (--fields query=... pos=... neg=...)
    pos_field: str = "pos"
    neg_field: str = "neg"
    # a Hugging Face dataset streamed in place of `inputs` (hf_datasets.py)
    hf_dataset: str | None = None  # what datasets.load_dataset takes: a Hub name, a folder, or a builder
    hf_config: str | None = None
    hf_split: str | None = None  # None: train, where the dataset has splits
    hf_data_files: list[str] | None = None
    hf_rows_per_document: int = 1  # consecutive rows that make one document (a dataset of one sentence a row)

    def dataset(self) -> HFDataset | None:
        if self.hf_dataset is None:
            return None
        return HFDataset(self.hf_dataset, self.hf_config, self.hf_split, tuple(self.hf_data_files or ()),
                         self.hf_rows_per_document)

    def resolved_packing(self) -> str:
        return self.packing or ("passage" if self.source in PASSAGE_SOURCES else "sentences")

    def resolved_pair_method(self) -> str | None:
        return (self.pair_method or pairs.default_method(self.source)) if self.pairs else None

    def validate(self) -> None:
        if bool(self.inputs) == (self.hf_dataset is not None):
            raise PrepareError("give the corpus as --input PATH... or as --hf-dataset NAME, one of the two")
        if self.hf_dataset is None and (self.hf_config or self.hf_split or self.hf_data_files
                                        or self.hf_rows_per_document != 1):
            raise PrepareError("--hf-config, --hf-split, --hf-data-files and --hf-rows-per-document go with "
                               "--hf-dataset")
        if self.hf_rows_per_document < 1:
            raise PrepareError(f"--hf-rows-per-document must be positive, got {self.hf_rows_per_document}")
        if self.hf_dataset is not None:
            self.dataset().check()
        if self.pairs:
            self._validate_pairs()
        elif self.source not in corpora.SOURCES:
            raise PrepareError(f"--source {self.source!r}: choose one of {', '.join(corpora.SOURCES)}")
        if self.max_len < 4:
            raise PrepareError(f"--max-len must be at least 4, got {self.max_len}")
        if self.shard_size < 1:
            raise PrepareError(f"--shard-size must be positive, got {self.shard_size}")
        if self.on_error not in ("fail", "skip"):
            raise PrepareError(f"--on-error must be fail or skip, got {self.on_error!r}")
        if self.resolved_packing() not in ("sentences", "passage"):
            raise PrepareError(f"--packing must be sentences or passage, got {self.packing!r}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise PrepareError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if not 0.0 <= self.holdout < 1.0:
            raise PrepareError(f"--holdout must be in [0, 1), got {self.holdout}")
        if self.split not in ("train", "validation"):
            raise PrepareError(f"--split must be train or validation, got {self.split!r}")
        if self.split == "validation" and self.holdout == 0.0:
            raise PrepareError("--split validation needs --holdout FRACTION > 0")
        if self.books_format not in ("file", "lines"):
            raise PrepareError(f"--books-format must be file or lines, got {self.books_format!r}")
        if not 0 <= self.part < self.parts:
            raise PrepareError(f"--part must be in [0, --parts), got part {self.part} of {self.parts}")
        if self.group_records < 1:
            raise PrepareError(f"--group-records must be positive, got {self.group_records}")

    def _validate_pairs(self) -> None:
        if self.source not in pairs.PAIR_SOURCES:
            raise PrepareError(f"--pairs --source {self.source!r}: choose one of {', '.join(pairs.PAIR_SOURCES)}")
        if self.resolved_pair_method() not in pairs.PAIR_METHODS[self.source]:
            raise PrepareError(f"--pair-method {self.pair_method!r}: --source {self.source} takes "
                               f"{' or '.join(pairs.PAIR_METHODS[self.source])}")
        if self.span_method not in pairs.SPAN_METHODS:
            raise PrepareError(f"--span-method must be crop or ict, got {self.span_method!r}")
        if not 0.0 < self.crop_ratio_min <= self.crop_ratio_max <= 1.0:
            raise PrepareError(f"--crop-ratio-min/max must satisfy 0 < min <= max <= 1, got {self.crop_ratio_min}, "
                               f"{self.crop_ratio_max}")
        if not 0.0 <= self.ict_keep_prob <= 1.0:
            raise PrepareError(f"--ict-keep-prob must be in [0, 1], got {self.ict_keep_prob}")
        if self.hf_dataset is not None and self.resolved_pair_method() == "qrels":
            raise PrepareError(f"--pairs --source {self.source} joins a folder's corpus, queries and qrels; it "
                               "reads --input FOLDER, not --hf-dataset (prepare the rows as --source jsonl)")
        if self.hf_rows_per_document != 1 and self.resolved_pair_method() == "records":
            raise PrepareError("--hf-rows-per-document joins rows into documents; a pair record is one row")
        if self.parts > 1:  # duplicates are dropped over the whole input, which no part sees
            raise PrepareError("--pairs prepares in one job (--parts 1): duplicate pairs are dropped over the "
                               "whole input")

    def wanted(self):
        """The record indices this part prepares (None: all)."""
        if self.parts == 1:
            return None
        return lambda index: (index // self.group_records) % self.parts == self.part

    def output_arguments(self) -> dict:
        """The arguments that determine the output (not workers, progress, overwrite)."""
        args = asdict(self)
        for key in ("workers", "progress", "overwrite", "out", "stage"):
            args.pop(key)
        args["packing"] = self.resolved_packing()
        for key in _LATER_KEYS:  # jobs that do not use them keep the ids they had before these existed
            if args[key] == default_of(PrepareOptions, key):
                args.pop(key)
        pair_keys = ("pairs", "pair_method", "span_method", "crop_ratio_min", "crop_ratio_max", "ict_keep_prob",
                     "qrels_split")
        if not self.pairs:  # text jobs keep the ids they had before pairs existed
            for key in pair_keys:
                args.pop(key)
        else:
            args["pair_method"] = self.resolved_pair_method()
        return args

    def span_options(self) -> pairs.SpanOptions:
        return pairs.SpanOptions(self.span_method, self.crop_ratio_min, self.crop_ratio_max, self.ict_keep_prob,
                                 self.seed)


_LATER_KEYS = ("query_field", "pos_field", "neg_field", "hf_dataset", "hf_config", "hf_split", "hf_data_files",
               "hf_rows_per_document")


def prepare(opts: PrepareOptions) -> dict:
    """Run (or resume) a prepare job; returns the manifest."""
    opts.validate()
    if remote.is_remote(opts.out):
        return _prepare_remote(opts)
    out = Path(remote.local_path(opts.out))
    # one writer per folder: two prepares into one OUT would mix shards of different settings
    with DirectoryLock(out, "prepare"):
        return _prepare_local(opts, out)


def _prepare_local(opts: PrepareOptions, out: Path) -> dict:
    files, backend, info, inputs, job_id, _ = _job(opts)

    state = _load_previous(out, job_id, opts.overwrite)
    if state.get("complete"):
        _nothing_to_do(out)
        return state["manifest"]
    out.mkdir(parents=True, exist_ok=True)
    token_ext = token_extension(info.vocab_size)
    output = _ShardSequence(out, opts.source, token_ext, opts.shard_size, job_id, state, opts.pairs)
    resume = state.get("next", {"record": 0, "block": 0, "cursor": [0, 0, 0, 0]})
    cursor = Cursor(*resume["cursor"])
    reader = ReaderOptions(text_field=opts.text_field, id_field=opts.id_field, title_field=opts.title_field,
                           queries_field=opts.queries_field, books_format=opts.books_format,
                           query_field=opts.query_field, pos_field=opts.pos_field, neg_field=opts.neg_field)
    if opts.pairs:
        qrels_skipped: dict = {}  # qrels lines naming a missing query or document (--on-error skip)
        read = pairs.read_pair_records(opts.source, opts.resolved_pair_method(), files, opts.qrels_split, reader, cursor,
                                       opts.wanted(), opts.on_error, qrels_skipped)
    else:
        read = corpora.read_records(opts.source, files, reader, cursor, opts.wanted())
    records = _Counted(read, cursor.record)
    started = time.perf_counter()
    try:
        _write_samples(output, _tokenized(_chunks(_kept(records, opts), resume["record"]), opts), opts, resume)
    except BaseException:
        output.abort()
        raise
    output.finish()
    if opts.pairs:
        output.skipped.update({f"qrels: {k}": v for k, v in qrels_skipped.items()})
    if output.num_samples == 0 and opts.parts == 1:
        raise PrepareError(f"no samples produced from {opts.dataset() or ', '.join(map(str, opts.inputs))} "
                           f"(skipped: {dict(output.skipped) or 'none'})")
    if output.num_samples == 0:
        groups = -(-records.count // opts.group_records)
        print(f"pretrieve prepare: part {opts.part} of {opts.parts} holds no samples: the input's {records.count:,} "
              f"records make {groups} group(s) of --group-records {opts.group_records}", file=sys.stderr)
    manifest = {
        "format": MANIFEST_FORMAT,
        "num_samples": output.num_samples,
        "num_tokens": output.num_tokens,
        "num_documents": output.documents,
        "num_records": records.count,
        "token_dtype": "uint16" if token_ext == "ids.u16" else "int32",
        "max_len": opts.max_len,
        "max_tokens_per_sample": opts.max_len - 2,
        "source": opts.source,
        "tokenizer": info.as_dict(),
        "inputs": inputs,
        "arguments": opts.output_arguments(),
        "skipped": dict(sorted(output.skipped.items())),
        "truncated_documents": output.truncated,
        "shards": output.shard_entries(),
        "job_id": job_id,
        "pretrieve_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "prepare_seconds": round(time.perf_counter() - started, 3),
    }
    if opts.pairs:
        manifest.update({
            "kind": "pairs",
            "pairs": {opts.source: output.num_samples},  # per source (one source per manifest)
            "pair_kinds": dict(sorted((k[5:], v) for k, v in output.counts.items() if k.startswith("kind:"))),
            "duplicate_pairs": output.counts["duplicates"],
            "records_without_pairs": output.counts["records_without_pairs"],
            "truncated_texts": output.truncated,
        })
    _write_json_atomic(out / MANIFEST, manifest)
    (out / STATE).unlink(missing_ok=True)
    return manifest


def _write_samples(output: "_ShardSequence", results: Iterator[tuple], opts: PrepareOptions, resume: dict) -> None:
    """Each record's blocks as samples, from the resume point on; a new group of records starts a new shard."""
    for item in results:
        kind, index, cursor = item[0], item[1], item[2]
        output.enter_group(index // opts.group_records, {"record": index, "block": 0, "cursor": cursor})
        if kind == "bad":
            _, _, _, reason, where, detail = item
            if opts.on_error == "fail":
                raise CorpusError(f"{where}: {detail} ({reason}); fix the input or pass --on-error skip")
            output.skipped[reason] += 1
            continue
        if kind == "pairs":
            _write_pairs(output, item, opts, resume)
            continue
        _, _, _, doc_id, blocks, truncated, queries = item
        first = resume["block"] if index == resume["record"] else 0
        if first == 0:  # a document split over the resume point was counted before the stop
            output.truncated += truncated
            output.documents += 1
        for block_index in range(first, len(blocks)):
            meta = {"doc": doc_id, "block": block_index, "source": opts.source}
            if queries:
                meta["queries"] = queries
            output.add(blocks[block_index], meta, {"record": index, "block": block_index + 1, "cursor": cursor})


def _write_pairs(output: "_ShardSequence", item: tuple, opts: PrepareOptions, resume: dict) -> None:
    """A record's pair samples, from the resume point on; a pair seen before is dropped and counted."""
    _, index, cursor, doc_id, samples, truncated = item
    first = resume["block"] if index == resume["record"] else 0
    if first == 0:
        output.truncated += truncated
        output.documents += bool(samples)
        output.counts["records_without_pairs"] += not samples  # ict: one-sentence blocks; texts with no tokens
    for k in range(first, len(samples)):
        ids, meta = samples[k]
        next_position = {"record": index, "block": k + 1, "cursor": cursor}
        digest = pairs.pair_digest(ids, meta["parts"])
        if digest in output.seen:
            output.counts["duplicates"] += 1
            continue
        output.seen.add(digest)
        output.counts[f"kind:{meta['pair']}"] += 1
        output.add(ids, {"doc": doc_id, "block": k, "source": opts.source, **meta}, next_position)


def _kept(records: Iterator[tuple], opts: PrepareOptions) -> Iterator[tuple]:
    """`--holdout`: the documents of this side (bad records stay, to be reported; other parts' pass, uncounted)."""
    if not opts.holdout:
        return records
    return ((index, cursor, r) for index, cursor, r in records
            if not isinstance(r, (Document, pairs.PairRecord)) or holdout_side(r.doc_id, opts.holdout) == opts.split)


class _Counted:
    """The records read so far: the index after the last one seen."""

    def __init__(self, records: Iterator[tuple], start: int):
        self.records, self.count = records, start

    def __iter__(self) -> Iterator[tuple]:
        for item in self.records:
            self.count = item[0] + 1
            yield item


def job_id_of(arguments: dict, inputs: list[dict], fingerprint: str) -> str:
    """What identifies an output: its arguments, inputs (paths and sizes) and tokenizer (combine.py uses it too)."""
    job = {"arguments": arguments, "inputs": inputs, "tokenizer": fingerprint}
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()


def _job(opts: PrepareOptions) -> tuple:
    """(input files, tokenizer backend, its description, input list, job id, other files read whole): what
    identifies the output."""
    if opts.hf_dataset is not None:
        files, extra = opts.dataset(), []
    elif opts.pairs:
        files, extra = pairs.input_files(opts.source, opts.inputs, opts.qrels_split)
    else:
        files, extra = corpora.list_input_files(opts.source, opts.inputs), []
    backend = load_backend(opts.tokenizer)
    info = describe(opts.tokenizer, backend)
    inputs = [files.as_input()] if opts.hf_dataset is not None else \
        [{"path": str(p), "bytes": corpora.file_size(p)} for p in files + extra]
    return files, backend, info, inputs, job_id_of(opts.output_arguments(), inputs, info.fingerprint), extra


def _prepare_remote(opts: PrepareOptions) -> dict:
    """`prepare` into a local staging folder, then upload: shards first, the manifest last (module docstring)."""
    target = opts.out.rstrip("/")
    manifest_url = remote.child(target, MANIFEST)
    previous = _remote_manifest(manifest_url)
    job_id = _job(opts)[-2]
    if previous is not None and not opts.overwrite:
        if previous.get("job_id") != job_id:
            raise PrepareError(f"{target} holds a complete prepare with other arguments or inputs; "
                               "use another --out or pass --overwrite")
        _nothing_to_do(target)
        return previous
    stage = Path(opts.stage or Path(tempfile.gettempdir()) /
                 f"pretrieve-stage-{hashlib.sha256((target + job_id).encode()).hexdigest()[:16]}")
    manifest = prepare(replace(opts, out=str(stage)))
    if previous is not None:  # --overwrite: the old output stops being complete before any of it changes
        remote.remove(manifest_url)
    for shard in manifest["shards"]:
        remote.upload(stage / shard["file"], remote.child(target, shard["file"]))
    staged_manifest = remote.child(target, f".{MANIFEST}.tmp")
    remote.upload(stage / MANIFEST, staged_manifest)
    remote.move(staged_manifest, manifest_url)
    for old in {s["file"] for s in (previous or {}).get("shards", [])} - {s["file"] for s in manifest["shards"]}:
        remote.remove(remote.child(target, old))
    if opts.stage is None:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


def _nothing_to_do(out) -> None:
    print(f"pretrieve prepare: {out} is already complete with these arguments and inputs: nothing was done "
          "(--overwrite prepares it again)", file=sys.stderr)


def _remote_manifest(location: str) -> dict | None:
    try:
        data, _ = remote.fetch(location, digest=False)
    except remote.NotFound:
        return None
    except remote.ReadError as e:
        raise PrepareError(f"cannot check for an earlier output: {e}") from e
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except ValueError as e:
        raise PrepareError(f"{location}: damaged ({e}); use another --out or pass --overwrite") from e


def holdout_side(doc_id: str, fraction: float) -> str:
    """"validation" for the documents whose id hashes below `fraction` of the 64-bit range, else "train"."""
    digest = hashlib.sha256(str(doc_id).encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") < fraction * 2 ** 64 else "train"


def _load_previous(out: Path, job_id: str, overwrite: bool) -> dict:
    """The resume state of an earlier run of the same job; refuses to mix different jobs in one directory."""
    manifest_path, state_path = out / MANIFEST, out / STATE
    check_own_entries(out, "pretrieve prepare", _prepare_writes)  # --overwrite too: it removes only its own files
    if overwrite and out.exists():
        manifest_path.unlink(missing_ok=True)  # first: the old output stops being complete before any of it changes
        for p in out.iterdir():
            if p.name != LOCK_FILE:
                p.unlink()
        return {}
    for path, what in ((manifest_path, "a complete prepare"), (state_path, "an unfinished prepare")):
        if path.exists():
            try:
                previous = json.loads(path.read_text(encoding="utf-8"))
            except ValueError as e:
                raise PrepareError(f"{path}: damaged ({e}); use another --out or pass --overwrite") from e
            if not isinstance(previous, dict) or previous.get("job_id") != job_id:
                raise PrepareError(f"{out} holds {what} with other arguments or inputs; "
                                   "use another --out or pass --overwrite")
            if path == manifest_path:
                return {"complete": True, "manifest": previous}
            return previous
    if out.exists() and any(out.glob("*.tar")):
        raise PrepareError(f"{out} holds shards but no manifest or resume state; use another --out or --overwrite")
    return {}


def _prepare_writes(name: str) -> bool:
    """The names a local prepare gives its files: shards, manifest, resume state, lock, temporary files."""
    return name in (MANIFEST, STATE, LOCK_FILE) or re.fullmatch(_SHARD_NAME, name) is not None


_SHARD_NAME = rf"\.?({'|'.join(map(re.escape, {*corpora.SOURCES, *pairs.PAIR_SOURCES}))})-\d{{6,}}\.tar(\.tmp)?|\..+\.tmp"


class _ShardSequence:
    """Cuts the sample stream into shards and checkpoints progress after each complete shard."""

    def __init__(self, out: Path, source: str, token_ext: str, shard_size: int, job_id: str, state: dict,
                 pairs: bool = False):
        self.out, self.source, self.token_ext, self.shard_size, self.job_id = out, source, token_ext, shard_size, job_id
        self.shards = [ShardStats(**{k: v for k, v in s.items() if k != "group"}) for s in state.get("shards", [])]
        self.groups = [s["group"] for s in state.get("shards", [])]  # the record group of each shard
        self.group: int | None = None  # the group of the shard being written
        self.skipped = Counter(state.get("skipped", {}))
        self.documents = state.get("documents", 0)
        self.truncated = state.get("truncated", 0)
        self.counts = Counter(state.get("counts", {}))  # pairs: duplicates dropped, pairs by kind
        self.seen: set[bytes] = set()  # pairs: the digests of the pairs written
        self.writer: ShardWriter | None = None
        for shard in self.shards:  # a resumed run trusts complete shards only if they are intact
            path = out / shard.file
            if not path.exists() or path.stat().st_size != shard.bytes:
                raise PrepareError(f"{path}: listed as complete in {out / STATE} but missing or changed; "
                                   "re-run with --overwrite")
            if pairs:
                self.seen.update(_pairs_digests(path, shard))

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards) + (self.writer.num_samples if self.writer else 0)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards) + (self.writer.num_tokens if self.writer else 0)

    def shard_entries(self) -> list[dict]:
        return [{**s.as_dict(), "group": g} for s, g in zip(self.shards, self.groups)]

    def enter_group(self, group: int, next_position: dict) -> None:
        """The next record belongs to `group`: a shard of another group ends here, however few samples it has."""
        if group != self.group and self.writer is not None:
            self._close_shard()
            self._save_state(next_position)
        self.group = group

    def add(self, ids: np.ndarray, meta: dict, next_position: dict) -> None:
        if self.writer is None:
            self.writer = ShardWriter(self.out / f"{self.source}-{len(self.shards):06d}.tar", self.token_ext)
        self.writer.add(ids, meta)
        if self.writer.num_samples == self.shard_size:
            self._close_shard()
            self._save_state(next_position)

    def _close_shard(self) -> None:
        self.shards.append(self.writer.close())
        self.groups.append(self.group)
        self.writer = None

    def _save_state(self, next_position: dict) -> None:
        """`next`: the record to go on from (its cursor re-reads it) and its first block not yet written."""
        _write_json_atomic(self.out / STATE, {
            "job_id": self.job_id, "next": {**next_position, "cursor": list(next_position["cursor"])},
            "shards": self.shard_entries(), "skipped": dict(self.skipped), "documents": self.documents,
            "truncated": self.truncated, "counts": dict(self.counts),
        })

    def finish(self) -> None:
        if self.writer is not None and self.writer.num_samples:
            self._close_shard()
        elif self.writer is not None:
            self.writer.abort()

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None


def _pairs_digests(path: Path, shard: ShardStats) -> Iterator[bytes]:
    for ids, meta in read_shard(path, sha256=shard.sha256, num_samples=shard.num_samples):
        yield pairs.pair_digest(ids, meta["parts"])


def _chunks(records: Iterator[tuple], resume_record: int) -> Iterator[list[tuple]]:
    """Groups of (index, cursor, ...) of about CHUNK_CHARS text; records before `resume_record` (the records of a
    book read again from its start) and other parts' records (None) are dropped."""
    chunk, chars = [], 0
    for index, cursor, record in records:
        if index < resume_record or record is None:
            continue
        if isinstance(record, BadRecord):
            chunk.append((index, cursor, "bad", record.reason, record.where, record.detail))
        elif isinstance(record, pairs.PairRecord):
            chunk.append((index, cursor, "pairs", record.doc_id, record, record.where))
            chars += len(record.text or "") + sum(len(p.pos) + len(p.query) for p in record.pairs)
        else:
            chunk.append((index, cursor, "doc", record.doc_id, record.text, record.where, record.queries))
            chars += len(record.text)
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _tokenized(work: Iterator[list[tuple]], opts: PrepareOptions) -> Iterator[tuple]:
    """Results per record in input order: ("doc", index, cursor, doc_id, blocks, truncated, query_ids) or
    ("bad", index, cursor, reason, where, detail)."""
    config = (opts.tokenizer, opts.max_len - 2, opts.resolved_packing(), opts.short_seq_prob, opts.seed,
              opts.span_options())
    with _progress(opts) as bar:
        if opts.workers <= 0:
            _init_worker(config)
            results = map(_process_chunk, work)
            pool = None
        else:
            pool = multiprocessing.get_context("fork").Pool(opts.workers, initializer=_init_worker, initargs=(config,))
            results = pool.imap(_process_chunk, work)
        try:
            for chunk_result in results:
                for item in chunk_result:
                    if item[0] in ("doc", "pairs"):
                        bar.update(1)
                    yield item
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()


def _progress(opts: PrepareOptions):
    """A bar on a terminal, a line every 30 s otherwise (a SLURM log); none with progress=False."""
    from pretrieve.progress import Progress

    return Progress(None, f"prepare {opts.source}", unit="docs", enabled=opts.progress is not False)


_WORKER: dict = {}


def _init_worker(config: tuple) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker; parallelism comes from the pool
    tokenizer_path, max_tokens, packing, short_seq_prob, seed, spans = config
    _WORKER.update(backend=load_backend(tokenizer_path), max_tokens=max_tokens, packing=packing,
                   short_seq_prob=short_seq_prob, seed=seed, spans=spans)


def _process_chunk(chunk: list[tuple]) -> list[tuple]:
    docs = [item for item in chunk if item[2] == "doc"]  # (pairs tokenize per record: _pair_result)
    encodings = _WORKER["backend"].encode_batch([item[4] for item in docs], add_special_tokens=False)
    encoded = {item[0]: enc for item, enc in zip(docs, encodings)}
    queries = [q for item in docs for q in item[6]]
    query_ids = iter(_WORKER["backend"].encode_batch(queries, add_special_tokens=False) if queries else ())
    results = []
    for item in chunk:
        index, cursor = item[0], item[1]
        if item[2] == "bad":
            results.append(("bad", index, cursor, *item[3:]))
            continue
        if item[2] == "pairs":
            results.append(_pair_result(item))
            continue
        _, _, _, doc_id, text, where, doc_queries = item
        # pseudo-queries as token id lists (JSON), each cut to a block's length
        query_tokens = [next(query_ids).ids[:_WORKER["max_tokens"]] for _ in doc_queries]
        enc = encoded[index]
        ids = np.asarray(enc.ids, dtype=np.int32)
        if len(ids) == 0:
            results.append(("bad", index, cursor, "empty", where, "no tokens after tokenization"))
            continue
        blocks, truncated = _blocks(ids, text, enc, index)
        results.append(("doc", index, cursor, doc_id, blocks, truncated, [q for q in query_tokens if q]))
    return results


def _pair_result(item: tuple) -> tuple:
    """("pairs", index, cursor, doc_id, [(ids, meta)], texts truncated) of a pair record, or ("bad", ...)."""
    index, cursor, _, doc_id, record, where = item
    backend, max_tokens = _WORKER["backend"], _WORKER["max_tokens"]
    if record.text is None:
        samples, truncated = pairs.text_pair_samples(backend, record.pairs, max_tokens)
    else:
        enc = backend.encode(record.text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        ends = sentence_token_bounds(enc, sentence_starts(record.text)) if len(ids) else np.zeros(0, np.int64)
        samples, truncated = pairs.span_pair_samples(ids, ends, max_tokens, _WORKER["spans"], index), 0
    return "pairs", index, cursor, doc_id, samples, truncated


def _blocks(ids: np.ndarray, text: str, enc, index: int) -> tuple[list[np.ndarray], int]:
    max_tokens = _WORKER["max_tokens"]
    if _WORKER["packing"] == "passage":
        return [ids[:max_tokens]], int(len(ids) > max_tokens)
    ends = sentence_token_bounds(enc, sentence_starts(text))
    prob = _WORKER["short_seq_prob"]
    rng = np.random.default_rng([_WORKER["seed"], index]) if prob > 0 else None
    return [ids[a:b] for a, b in pack_sentences(ends, max_tokens, prob, rng)], 0


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
