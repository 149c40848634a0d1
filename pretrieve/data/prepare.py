"""`pretrieve prepare`: raw corpus -> tokenized, packed webdataset shards + manifest.json.

Pipeline: a reader (corpora.py) yields records in file order; chunks of records go to the worker pool
(prepare_workers.py), which tokenizes and packs them; the main process writes the results in input order into
shards of `shard_size` samples (shards.py). The output does not depend on the number of workers. The options
are prepare_options.py's; where a job stands (its id, its resume state) is prepare_state.py's.

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
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from pretrieve import __version__
from pretrieve.data import corpora, pairs, remote
from pretrieve.data.corpora import BadRecord, CorpusError, Cursor, Document, ReaderOptions
from pretrieve.data.prepare_options import PrepareError, PrepareOptions
from pretrieve.data.prepare_state import (MANIFEST, STATE, ShardSequence, job_id_of, load_previous,
                                          remote_manifest, write_json_atomic)
from pretrieve.data.prepare_workers import DocumentBlocks, PairSamples, Pending, Result, Skipped, tokenized
from pretrieve.data.shards import MANIFEST_FORMAT, token_extension
from pretrieve.data.tokenizer import describe, load_backend
from pretrieve.utils.run_lock import DirectoryLock

CHUNK_CHARS = 1 << 20  # text sent to a worker at a time


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
    files, _, info, inputs, job_id, _ = _job(opts)

    state = load_previous(out, job_id, opts.overwrite)
    if state.get("complete"):
        _nothing_to_do(out)
        return state["manifest"]
    out.mkdir(parents=True, exist_ok=True)
    token_ext = token_extension(info.vocab_size)
    output = ShardSequence(out, opts.source, token_ext, opts.shard_size, job_id, state, opts.pairs)
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
        _write_samples(output, tokenized(_chunks(_kept(records, opts), resume["record"]), opts), opts, resume)
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
    manifest = _manifest(opts, output, records.count, token_ext, info, inputs, job_id, started)
    write_json_atomic(out / MANIFEST, manifest)
    (out / STATE).unlink(missing_ok=True)
    return manifest


def _manifest(opts: PrepareOptions, output: ShardSequence, num_records: int, token_ext: str, info, inputs: list[dict],
              job_id: str, started: float) -> dict:
    manifest = {
        "format": MANIFEST_FORMAT,
        "num_samples": output.num_samples,
        "num_tokens": output.num_tokens,
        "num_documents": output.documents,
        "num_records": num_records,
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
    return manifest


def _write_samples(output: ShardSequence, results: Iterator[Result], opts: PrepareOptions, resume: dict) -> None:
    """Each record's blocks as samples, from the resume point on; a new group of records starts a new shard."""
    for result in results:
        index, cursor = result.index, result.cursor
        output.enter_group(index // opts.group_records, {"record": index, "block": 0, "cursor": cursor})
        if isinstance(result, Skipped):
            if opts.on_error == "fail":
                raise CorpusError(f"{result.where}: {result.detail} ({result.reason}); fix the input or pass "
                                  "--on-error skip")
            output.skipped[result.reason] += 1
        elif isinstance(result, PairSamples):
            _write_pairs(output, result, opts, resume)
        else:
            _write_blocks(output, result, opts, resume)


def _write_blocks(output: ShardSequence, result: DocumentBlocks, opts: PrepareOptions, resume: dict) -> None:
    """A document's blocks, from the resume point on."""
    index, cursor = result.index, result.cursor
    first = resume["block"] if index == resume["record"] else 0
    if first == 0:  # a document split over the resume point was counted before the stop
        output.truncated += result.truncated
        output.documents += 1
    for block_index in range(first, len(result.blocks)):
        meta = {"doc": result.doc_id, "block": block_index, "source": opts.source}
        if result.queries:
            meta["queries"] = result.queries
        output.add(result.blocks[block_index], meta, {"record": index, "block": block_index + 1, "cursor": cursor})


def _write_pairs(output: ShardSequence, result: PairSamples, opts: PrepareOptions, resume: dict) -> None:
    """A record's pair samples, from the resume point on; a pair seen before is dropped and counted."""
    index, samples = result.index, result.samples
    first = resume["block"] if index == resume["record"] else 0
    if first == 0:
        output.truncated += result.truncated
        output.documents += bool(samples)
        output.counts["records_without_pairs"] += not samples  # ict: one-sentence blocks; texts with no tokens
    for k in range(first, len(samples)):
        ids, meta = samples[k]
        next_position = {"record": index, "block": k + 1, "cursor": result.cursor}
        digest = pairs.pair_digest(ids, meta["parts"])
        if digest in output.seen:
            output.counts["duplicates"] += 1
            continue
        output.seen.add(digest)
        output.counts[f"kind:{meta['pair']}"] += 1
        output.add(ids, {"doc": result.doc_id, "block": k, "source": opts.source, **meta}, next_position)


def _kept(records: Iterator[tuple], opts: PrepareOptions) -> Iterator[tuple]:
    """`--holdout`: the documents of this side (bad records stay, to be reported; other parts' pass, uncounted)."""
    if not opts.holdout:
        return records
    return ((index, cursor, r) for index, cursor, r in records
            if not isinstance(r, (Document, pairs.PairRecord)) or holdout_side(r.doc_id, opts.holdout) == opts.split)


def holdout_side(doc_id: str, fraction: float) -> str:
    """"validation" for the documents whose id hashes below `fraction` of the 64-bit range, else "train"."""
    digest = hashlib.sha256(str(doc_id).encode("utf-8")).digest()
    return "validation" if int.from_bytes(digest[:8], "big") < fraction * 2 ** 64 else "train"


class _Counted:
    """The records read so far: the index after the last one seen."""

    def __init__(self, records: Iterator[tuple], start: int):
        self.records, self.count = records, start

    def __iter__(self) -> Iterator[tuple]:
        for item in self.records:
            self.count = item[0] + 1
            yield item


def _chunks(records: Iterator[tuple], resume_record: int) -> Iterator[list[Pending]]:
    """The records for the workers in groups of about CHUNK_CHARS text; records before `resume_record` (the
    records of a book read again from its start) and other parts' records (None) are dropped."""
    chunk, chars = [], 0
    for index, cursor, record in records:
        if index < resume_record or record is None:
            continue
        chunk.append(Pending(index, cursor, record))
        if isinstance(record, pairs.PairRecord):
            chars += len(record.text or "") + sum(len(p.pos) + len(p.query) for p in record.pairs)
        elif not isinstance(record, BadRecord):
            chars += len(record.text)
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


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
    previous = remote_manifest(manifest_url)
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
