"""ShardStream: exact resume (workers 0/1/2, world 1/2), elastic resume, mixture, equal batches, bad shards."""

import json
import multiprocessing
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pretrieve.data.shards import ShardError
from pretrieve.data.stream import ShardStream, StreamError, StreamLoader

BATCH = 8


def addresses(batch):
    return [(s["shard"], s["index"], s["pad"]) for s in batch]


def run_batches(stream, workers, limit=None, until_epoch=2):
    """Batches (as address lists) until `limit` batches or until the stream reaches epoch `until_epoch`."""
    loader = StreamLoader(stream, batch_size=BATCH, num_workers=workers)
    out = []
    while stream.epoch < until_epoch and limit != 0:
        it = iter(loader)
        for batch in it:
            out.append(addresses(batch))
            if limit is not None and len(out) == limit:
                it.close()
                return out
    return out


def make(manifests, rank=0, world=1, **kw):
    return ShardStream(manifests, seed=7, shuffle_buffer=50, rank=rank, world_size=world, **kw)


@pytest.fixture(scope="module")
def manifests(wiki_shards, books_shards):
    return [wiki_shards / "manifest.json", books_shards / "manifest.json"]


@pytest.fixture(scope="module")
def reference(manifests):
    """Uninterrupted two-epoch runs per (world, workers, rank)."""
    cache = {}

    def get(world, workers, rank):
        key = (world, workers, rank)
        if key not in cache:
            cache[key] = run_batches(make(manifests, rank, world), workers)
        return cache[key]
    return get


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.sampled_from([1, 2]), workers=st.sampled_from([0, 1, 2]), stop=st.floats(0, 1))
@example(world=1, workers=0, stop=0.3)
@example(world=1, workers=1, stop=0.6)
@example(world=1, workers=2, stop=0.45)  # stops inside epoch 0 (epoch boundary at 0.5)
@example(world=2, workers=0, stop=0.8)
@example(world=2, workers=1, stop=0.5)
@example(world=2, workers=2, stop=0.71)
def test_exact_resume(manifests, reference, world, workers, stop):
    for rank in range(world):
        full = reference(world, workers, rank)
        n = int(stop * (len(full) - 1))
        first = make(manifests, rank, world)
        assert run_batches(first, workers, limit=n) == full[:n]
        state = first.state_dict()
        resumed = make(manifests, rank, world)
        resumed.load_state_dict(state)
        assert run_batches(resumed, workers) == full[n:]


def test_reference_epochs_cover_the_data_once(manifests, reference):
    for workers in (0, 2):
        samples = [a for batch in reference(1, workers, 0) for a in batch]
        epoch_size = 648 + 69
        first, second = samples[:epoch_size], samples[epoch_size:]
        assert len(second) == epoch_size and set(first) == set(second) and len(set(first)) == epoch_size
        assert first != second  # a new order each epoch


def test_equal_batches_per_rank_and_flagged_padding(manifests, reference):
    # 717 samples over 2 ranks: one pad sample; 2 workers per rank with uneven shards.
    r0, r1 = reference(2, 2, 0), reference(2, 2, 1)
    assert len(r0) == len(r1) == StreamLoader(make(manifests, 0, 2), BATCH, num_workers=2).batches_per_epoch() * 2
    epoch0 = [a for b in r0[:len(r0) // 2] + r1[:len(r1) // 2] for a in b]
    pads = [a for a in epoch0 if a[2]]
    real = [a[:2] for a in epoch0 if not a[2]]
    assert len(pads) == 1 and len(real) == len(set(real)) == 717


@pytest.mark.parametrize("old_world, new_world, workers", [(2, 1, 2), (1, 2, 1), (2, 1, 0)])
def test_elastic_resume_loses_and_repeats_nothing(manifests, old_world, new_world, workers):
    consumed, state = [], None
    for rank in range(old_world):
        stream = make(manifests, rank, old_world)
        consumed += [a for b in run_batches(stream, workers, limit=13, until_epoch=1) for a in b]
        state = stream.state_dict() if state is None else state
        assert stream.state_dict() == state  # ranks in lockstep agree on the position
    position = f"epoch 0, {13 * BATCH * old_world} of its 717 samples read"  # all ranks' samples, as logged on resume
    rest = []
    for rank in range(new_world):
        stream = make(manifests, rank, new_world)
        stream.load_state_dict(state)
        assert stream.describe_position() == position
        batches = run_batches(stream, workers, until_epoch=1)
        assert stream.epoch == 1 and stream.describe_position() == "epoch 1, 0 of its 717 samples read"
        rest += [a for b in batches for a in b]
    real = [a[:2] for a in consumed + rest if not a[2]]
    assert len(real) == len(set(real)) == 717


def test_mixture_weights_and_down_weighted_corpus_cycles(wiki_shards, books_shards):
    stream = ShardStream([wiki_shards, books_shards], weights=[0.8, 0.2], epoch_samples=300, seed=1, shuffle_buffer=64)
    seen_books = set()
    for epoch in range(3):
        samples = list(stream)
        sources = [s["source"] for s in samples]
        assert (sources.count("wikipedia"), sources.count("books")) == (240, 60)
        seen_books |= {(s["shard"], s["index"]) for s in samples if s["source"] == "books"}
    assert len(seen_books) == 69  # 60 a epoch from 69: every books sample appears by epoch 2
    assert stream.epoch == 3


def test_stream_command_counts_each_epoch(manifests, capsys):
    """`pretrieve stream` (data.stream_counts): one line per epoch, numbered as the stream numbers it, counting
    every sample of the mixture once, its tokens and its source, in the loader's batches."""
    from pretrieve.cli import main

    assert main(["stream", *map(str, manifests), "--epochs", "2", "--batch-size", "8", "--workers", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens = sum(json.loads(Path(m).read_text())["num_tokens"] for m in manifests)
    batches = StreamLoader(ShardStream(manifests), batch_size=8, num_workers=2).batches_per_epoch()
    assert [line["epoch"] for line in lines] == [0, 1]
    for line in lines:
        assert (line["batches"], line["samples"], line["tokens"]) == (batches, 717, tokens)
        assert line["sources"] == {"wikipedia": 648, "books": 69}
        assert line["seconds"] >= 0 and line["samples_per_s"] > 0


def test_plain_iteration_state(wiki_shards):
    stream = make([wiki_shards])
    it = iter(stream)
    head = [next(it)["index"] for _ in range(100)]
    resumed = make([wiki_shards])
    resumed.load_state_dict(stream.state_dict())
    full = [s["index"] for s in make([wiki_shards])]
    assert head + [s["index"] for s in resumed] == full


def test_refusals(wiki_shards, books_shards, tmp_path):
    from torch.utils.data import DataLoader

    with pytest.raises(Exception, match="needs StreamLoader"):
        next(iter(DataLoader(make([wiki_shards]), batch_size=4, num_workers=1, collate_fn=list)))
    with pytest.raises(ValueError, match="persistent_workers"):
        StreamLoader(make([wiki_shards]), batch_size=4, num_workers=1, persistent_workers=True)
    other = make([books_shards])
    with pytest.raises(StreamError, match="other data"):
        other.load_state_dict(make([wiki_shards]).state_dict())
    with pytest.raises(StreamError, match="manifest not found"):
        make([tmp_path / "nowhere"])
    good = json.loads((wiki_shards / "manifest.json").read_text())
    for damage, message in ((lambda m: m["shards"][1].pop("num_samples"), r"shards\[1\]: needs file, sha256"),
                            (lambda m: m.update(shards=None), "shards: a list is expected"),
                            (lambda m: m.update(format="other/9"), "format 'other/9'; this version reads"),
                            (lambda m: m.update(tokenizer="bert"), "tokenizer: no fingerprint")):
        manifest = json.loads(json.dumps(good))
        damage(manifest)
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(StreamError, match=f"{tmp_path / 'manifest.json'}: {message}"):
            make([tmp_path])


def test_tokenizer_fingerprint_must_match(wiki_shards, tmp_path):
    from pretrieve.data.tokenizer import DEFAULT_TOKENIZER

    make([wiki_shards], tokenizer=DEFAULT_TOKENIZER)  # the tokenizer the shards were made with
    other = tmp_path / "tok"
    other.mkdir()
    tokens = (Path(DEFAULT_TOKENIZER) / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens[2000], tokens[2001] = tokens[2001], tokens[2000]
    (other / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
    shutil.copy(Path(DEFAULT_TOKENIZER) / "tokenizer_config.json", other)
    with pytest.raises(StreamError, match="another vocabulary"):
        make([wiki_shards], tokenizer=str(other))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_shard_is_an_error_naming_it(books_shards, tmp_path, damage):
    copy = tmp_path / "books"
    shutil.copytree(books_shards, copy)
    victim = copy / "books-000002.tar"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[5000] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    victim.write_bytes(bytes(data))
    # the manifest records each shard's byte count: a short shard is named truncated, not a digest mismatch
    error = "sha256 differs" if damage == "flip" else f"truncated: {len(data):,} of the {2 * len(data):,} bytes"
    with pytest.raises(ShardError, match=f"books-000002.tar: {error}"):
        list(make([copy]))
    with pytest.raises(ShardError, match=f"books-000002.tar: {error}"):  # raised in a DataLoader worker
        list(StreamLoader(make([copy]), batch_size=BATCH, num_workers=1))
    # its worker is ended now: left for exit, multiprocessing's SIGTERM could not end it (workers ignore it)
    assert not multiprocessing.active_children()
    if damage == "truncate":  # without sha256 verification too
        with pytest.raises(ShardError, match="books-000002.tar: truncated"):
            list(make([copy], verify=False))
        manifest = json.loads((copy / "manifest.json").read_text())
        for shard in manifest["shards"]:  # a manifest without byte counts: the digest still catches it
            del shard["bytes"]
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ShardError, match="books-000002.tar: sha256 differs"):
            list(make([copy]))
        with pytest.raises(ShardError, match="books-000002.tar: .*the shard is truncated"):  # and the tar parser
            list(make([copy], verify=False))
