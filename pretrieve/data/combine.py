"""`pretrieve prepare --combine PART... --out OUT`: one corpus from the parts of a split prepare.

The parts are the outputs of `prepare --part i --parts n` (prepare.py), one folder (or URL) each. The combined
manifest is the one a single job would have written for the same input: its shards are the parts' shards in
record-group order, named by paths relative to OUT (absolute where a part lies elsewhere: another bucket, a
URL under another host), and its totals are the parts' sums. Its arguments and job id are the single job's, so
the stream reads it into the same samples in the same order, and `prepare` of the same input into OUT sees it
as its own complete output. Nothing is copied: the parts' folders must stay where they are.

Refused, naming the folders: a missing or repeated part, parts of other runs (arguments, inputs, tokenizer),
parts that counted a different number of input records (the input changed between them).
"""

from __future__ import annotations

import json
import os
import posixpath
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from pretrieve import __version__
from pretrieve.data import remote
from pretrieve.data.prepare_options import PrepareError
from pretrieve.data.prepare_state import MANIFEST, job_id_of, remote_manifest, write_json_atomic
from pretrieve.data.stream import StreamError, load_manifest

SUMMED = ("num_samples", "num_tokens", "num_documents", "truncated_documents", "prepare_seconds")
SAME = ("format", "num_records", "token_dtype", "max_len", "max_tokens_per_sample", "source", "tokenizer", "inputs")


def combine(parts: list[str], out: str) -> dict:
    """Write OUT's manifest over the parts' shards; returns it."""
    loaded = _load_parts(parts)
    first = loaded[0][1]
    arguments = {**first["arguments"], "part": 0, "parts": 1}
    shards = []
    for location, manifest in loaded:
        for shard in manifest["shards"]:
            shards.append({**shard, "file": _relative(remote.resolve(location, shard["file"]), out)})
    shards.sort(key=lambda s: s["group"])  # stable: a group's shards keep their order; a group is one part's
    skipped: dict[str, int] = {}
    for _, manifest in loaded:
        for reason, count in manifest["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    combined = {key: first[key] for key in SAME}
    combined.update({key: sum(m[key] for _, m in loaded) for key in SUMMED})
    combined.update({
        "arguments": arguments, "skipped": dict(sorted(skipped.items())), "shards": shards,
        "job_id": job_id_of(arguments, first["inputs"], first["tokenizer"]["fingerprint"]),
        "parts": [location for location, _ in loaded], "pretrieve_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    combined["prepare_seconds"] = round(combined["prepare_seconds"], 3)
    if combined["num_samples"] == 0:
        raise PrepareError(f"the parts {', '.join(parts)} hold no samples")
    _write(out, combined)
    return combined


def _load_parts(parts: list[str]) -> list[tuple[str, dict]]:
    """(manifest location, manifest) of every part, in part order, after the checks of the module docstring."""
    loaded = []
    for part in parts:
        try:
            location, manifest = load_manifest(part)
        except StreamError as e:
            raise PrepareError(f"--combine: {e}") from None
        if "parts" not in manifest.get("arguments", {}) or any("group" not in s for s in manifest["shards"]):
            raise PrepareError(f"{location}: not the output of `pretrieve prepare --part I --parts N`")
        loaded.append((location, manifest))
    n = loaded[0][1]["arguments"]["parts"]
    by_part: dict[int, str] = {}
    for location, manifest in loaded:
        _check_same_run(loaded[0], (location, manifest))
        part = manifest["arguments"]["part"]
        if part in by_part:
            raise PrepareError(f"part {part} of {n} given twice: {by_part[part]} and {location}")
        by_part[part] = location
    missing = sorted(set(range(n)) - set(by_part))
    if missing:
        raise PrepareError(f"parts {', '.join(map(str, missing))} of {n} missing (given: {', '.join(parts)}); "
                           "prepare them, or wait for their jobs to finish")
    return sorted(loaded, key=lambda item: item[1]["arguments"]["part"])


def _check_same_run(reference: tuple[str, dict], other: tuple[str, dict]) -> None:
    (ref_location, ref), (location, manifest) = reference, other
    ref_arguments = {k: v for k, v in ref["arguments"].items() if k != "part"}
    arguments = {k: v for k, v in manifest["arguments"].items() if k != "part"}
    differing = sorted(k for k in ref_arguments.keys() | arguments.keys() if ref_arguments.get(k) != arguments.get(k))
    differing += [k for k in SAME if ref.get(k) != manifest.get(k)]
    if differing:
        raise PrepareError(f"{location} and {ref_location} are parts of different runs: {', '.join(differing)} "
                           "differ" + (" (the input changed between the parts' runs)" if "num_records" in differing
                                       else ""))


def _relative(shard: str, out: str) -> str:
    """`shard`'s name in OUT's manifest: relative to OUT where both are on one filesystem, else absolute."""
    if not remote.is_remote(shard) and not remote.is_remote(out):
        return os.path.relpath(remote.local_path(shard), remote.local_path(out))
    a, b = urlsplit(shard), urlsplit(out)
    if remote.is_remote(shard) and remote.is_remote(out) and (a.scheme, a.netloc) == (b.scheme, b.netloc):
        return posixpath.relpath(a.path, b.path.rstrip("/") or "/")
    return shard if remote.is_remote(shard) else os.path.abspath(remote.local_path(shard))


def _write(out: str, manifest: dict) -> None:
    """OUT's manifest, atomically (a remote one under a temporary name, then moved into place)."""
    if not remote.is_remote(out):
        folder = Path(remote.local_path(out))
        _refuse_other_output(folder / MANIFEST, manifest["job_id"])
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / MANIFEST, manifest)
        return
    target = remote.child(out.rstrip("/"), MANIFEST)
    if (remote_manifest(target) or {}).get("job_id", manifest["job_id"]) != manifest["job_id"]:
        raise PrepareError(f"{target} belongs to another output; choose another --out")
    with tempfile.TemporaryDirectory() as tmp:
        write_json_atomic(Path(tmp) / MANIFEST, manifest)
        staged = remote.child(out.rstrip("/"), f".{MANIFEST}.tmp")
        remote.upload(Path(tmp) / MANIFEST, staged)
        remote.move(staged, target)


def _refuse_other_output(path: Path, job_id: str) -> None:
    if path.exists():
        try:
            previous = json.loads(path.read_text(encoding="utf-8")).get("job_id")
        except (ValueError, AttributeError):
            previous = None
        if previous != job_id:
            raise PrepareError(f"{path} belongs to another output; choose another --out")
