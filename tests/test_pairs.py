"""Pair shards (`prepare --pairs`) and pair streams: each source on the bundled samples, duplicates, bad records,
resume of a prepare, the pair samples of the stream, one-source batches, weights, exact resume, refusals."""

import gzip
import json
from collections import Counter

import numpy as np
import pytest

from support import SAMPLES
from pretrieve.cli import main as cli
from pretrieve.data.corpora import CorpusError
from pretrieve.data.pairs import is_heading, split_pair
from pretrieve.data.prepare import prepare
from pretrieve.data.prepare_options import PrepareError, PrepareOptions
from pretrieve.data.retrieval import load_beir
from pretrieve.data.shards import read_shard
from pretrieve.data.stream import ShardStream, StreamError, StreamLoader
from pretrieve.data.tokenizer import DEFAULT_TOKENIZER, load_backend

BACKEND = load_backend(DEFAULT_TOKENIZER)


def encode(text, max_tokens=510):
    return BACKEND.encode(text, add_special_tokens=False).ids[:max_tokens]


def prepare_pairs(out, source, inputs, **kwargs):
    return prepare(PrepareOptions(source=source, inputs=[str(i) for i in inputs], out=str(out), workers=0, pairs=True,
                                  **kwargs))


def pair_samples(out):
    """(query, pos, negs, meta) of every sample of a prepared folder, in order."""
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"]:
        for ids, meta in read_shard(out / shard["file"], sha256=shard["sha256"], num_samples=shard["num_samples"]):
            query, pos, negs = split_pair(ids, meta["parts"])
            yield query.tolist(), pos.tolist(), [n.tolist() for n in negs], meta


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """Pair shards of the bundled Wikipedia, books and BEIR samples."""
    root = tmp_path_factory.mktemp("pairs")
    prepare_pairs(root / "wikipedia", "wikipedia", [SAMPLES / "wikipedia"], shard_size=100)
    prepare_pairs(root / "books", "books", [SAMPLES / "books"], shard_size=16)
    prepare_pairs(root / "beir", "beir", [SAMPLES / "beir/scifact-sample"], qrels_split="test", shard_size=32)
    return root


def test_wikipedia_title_and_section_pairs(pair_dirs):
    out = pair_dirs / "wikipedia"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "pairs" and manifest["pairs"] == {"wikipedia": manifest["num_samples"]}
    assert set(manifest["pair_kinds"]) == {"title", "section"} and sum(manifest["pair_kinds"].values()) == \
        manifest["num_samples"]
    articles = {a["id"]: a for a in map(json.loads, gzip.open(SAMPLES / "wikipedia/wiki_00.jsonl.gz", "rt"))}
    samples = list(pair_samples(out))
    assert Counter(m["pair"] for *_, m in samples) == Counter(manifest["pair_kinds"])
    query, pos, negs, meta = samples[0]
    anarchism = articles[meta["doc"]]
    assert meta["source"] == "wikipedia" and meta["pair"] == "title" and negs == []
    assert query == encode(anarchism["title"]) and pos == encode(anarchism["text"].split("\n")[0])
    sections = {BACKEND.decode(q): p for q, p, _, m in samples if m["doc"] == meta["doc"] and m["pair"] == "section"}
    lines = anarchism["text"].split("\n")
    at = lines.index("Etymology and terminology.")
    end = next(i for i in range(at + 1, len(lines)) if is_heading(lines[i]))
    assert sections["anarchism : etymology and terminology"] == encode("\n".join(lines[at + 1:end]))
    assert "anarchism : history" not in sections  # "History." is followed by a subsection at once: no text
    assert is_heading("Origins.") and not is_heading("Albedo formula_4 can then be given as:")
    assert not is_heading("The term is old. It came from Greek.")


def test_book_spans_crop_and_ict(pair_dirs, tmp_path):
    books = {p.stem: encode(p.read_text(), 10 ** 9) for p in (SAMPLES / "books").glob("*.txt")}

    books = {name: "," + ",".join(map(str, ids)) + "," for name, ids in books.items()}

    def inside(span, text):
        return "," + ",".join(map(str, span)) + "," in text

    crops = list(pair_samples(pair_dirs / "books"))
    assert crops and all(m["pair"] == "crop" and m["source"] == "books" for *_, m in crops)
    for query, pos, negs, meta in crops:  # two independent crops of one block: each a stretch of the book
        assert inside(query, books[meta["doc"]]) and inside(pos, books[meta["doc"]]) and negs == []
        assert 0 < len(query) <= 255 and 0 < len(pos) <= 255  # at most half of a 510-token block
    ict = prepare_pairs(tmp_path / "ict", "books", [SAMPLES / "books"], span_method="ict", ict_keep_prob=0.0)
    assert ict["pair_kinds"] == {"ict": ict["num_samples"]}
    for query, pos, _, meta in pair_samples(tmp_path / "ict"):  # a sentence cut out of its block
        assert any(inside(pos[:k] + query + pos[k:], books[meta["doc"]]) for k in range(len(pos) + 1))
    kept = prepare_pairs(tmp_path / "kept", "books", [SAMPLES / "books"], span_method="ict", ict_keep_prob=1.0)
    assert kept["num_samples"] == ict["num_samples"]
    for (query, pos, _, meta), (q_cut, _, _, _) in zip(pair_samples(tmp_path / "kept"), pair_samples(tmp_path / "ict")):
        assert query == q_cut and inside(query, "," + ",".join(map(str, pos)) + ",")  # the same sentence, kept
    again = prepare_pairs(tmp_path / "again", "books", [SAMPLES / "books"], shard_size=16)
    assert [s["sha256"] for s in again["shards"]] == \
        [s["sha256"] for s in json.loads((pair_dirs / "books/manifest.json").read_text())["shards"]]


def test_beir_qrels_pairs(pair_dirs):
    data = load_beir(SAMPLES / "beir/scifact-sample", "test")
    expected = Counter((tuple(encode(data.queries[q])), d) for q, docs in data.qrels.items() for d, g in docs.items()
                       if g > 0)
    samples = list(pair_samples(pair_dirs / "beir"))
    assert Counter((tuple(q), m["doc"]) for q, _, _, m in samples) == expected
    corpus = {json.loads(line)["_id"]: json.loads(line) for line in open(SAMPLES / "beir/scifact-sample/corpus.jsonl")}
    for _, pos, _, meta in samples[:5]:
        doc = corpus[meta["doc"]]
        assert pos == encode(f"{doc['title']}\n{doc['text']}") and meta["pair"] == "qrels"


def test_msmarco_qrels_pairs_and_missing_judgements(tmp_path):
    folder = tmp_path / "msmarco"
    folder.mkdir()
    rows = (SAMPLES / "msmarco-passage/collection.tsv").read_text().splitlines()[:30]
    (folder / "collection.tsv").write_text("\n".join(rows) + "\n")
    pids = [r.split("\t")[0] for r in rows]
    (folder / "queries.train.tsv").write_text("".join(f"q{i}\twhat does passage {i} say\n" for i in range(6)))
    (folder / "qrels.train.tsv").write_text("".join(f"q{i}\t0\t{pids[3 * i]}\t1\n" for i in range(6)))
    m = prepare_pairs(tmp_path / "out", "msmarco", [folder])
    assert m["pairs"] == {"msmarco": 6} and m["pair_kinds"] == {"qrels": 6}
    texts = {r.split("\t")[0]: r.split("\t")[1] for r in rows}
    for q, pos, _, meta in pair_samples(tmp_path / "out"):
        assert pos == encode(texts[meta["doc"]]) and BACKEND.decode(q).startswith("what does passage")
    with open(folder / "qrels.train.tsv", "a") as f:
        f.write("q1\t0\tno-such-passage\t1\n")
    with pytest.raises(Exception, match=r"qrels.train.tsv:7: document not in corpus"):
        prepare_pairs(tmp_path / "bad", "msmarco", [folder])
    skipped = prepare_pairs(tmp_path / "skip", "msmarco", [folder], on_error="skip")
    assert skipped["skipped"] == {"qrels: document not in corpus": 1} and skipped["num_samples"] == 6


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_jsonl_pairs_duplicates_and_bad_records(tmp_path):
    records = [{"query": "q one", "pos": ["p one", "p two"], "neg": ["n one"]},
               {"query": "q two", "pos": "p three"},
               {"query": "q one", "pos": ["p one"], "neg": ["another negative"]},  # the same pair again: dropped
               {"query": "q two", "pos": "p three"}]  # again
    src = write_jsonl(tmp_path / "pairs.jsonl", records)
    m = prepare_pairs(tmp_path / "out", "jsonl", [src])
    assert m["num_samples"] == 3 and m["duplicate_pairs"] == 2 and m["pair_kinds"] == {"record": 3}
    samples = list(pair_samples(tmp_path / "out"))
    assert [(q, p, n) for q, p, n, _ in samples] == [
        (encode("q one"), encode("p one"), [encode("n one")]), (encode("q one"), encode("p two"), [encode("n one")]),
        (encode("q two"), encode("p three"), [])]
    bad = write_jsonl(tmp_path / "bad.jsonl", records[:2] + ['{"query": "no positive"}', "{oops"] + records[2:])
    with pytest.raises(CorpusError, match=r"bad\.jsonl:3: 'pos' must be .* \(missing_field\); .* --on-error skip"):
        prepare_pairs(tmp_path / "fail", "jsonl", [bad])
    skipped = prepare_pairs(tmp_path / "skipped", "jsonl", [bad], on_error="skip")
    assert skipped["skipped"] == {"missing_field": 1, "bad_json": 1} and skipped["num_samples"] == 3


def test_interrupted_prepare_resumes_to_the_same_shards(tmp_path):
    """A run stopped by a bad record resumes from its last complete shard (the bad line then replaced by a good one
    of the same length): the pairs written before the stop still count as seen, so a duplicate of one of them
    after the resume point is dropped as in the uninterrupted run."""
    records = [json.dumps({"query": f"query {i}", "pos": f"passage number {i}"}) for i in range(40)]
    records[38] = json.dumps({"query": "query 2", "pos": "passage number 2"})  # a duplicate after the stop
    good = records[36]
    records[36] = "{" * len(good)  # stops the first run
    src = write_jsonl(tmp_path / "p.jsonl", records)
    opts = dict(shard_size=5)
    with pytest.raises(CorpusError, match="p.jsonl:37"):
        prepare_pairs(tmp_path / "out", "jsonl", [src], **opts)
    state = json.loads((tmp_path / "out/.prepare-state.json").read_text())
    assert len(state["shards"]) == 7 and not (tmp_path / "out/manifest.json").exists()
    records[36] = good
    write_jsonl(src, records)
    resumed = prepare_pairs(tmp_path / "out", "jsonl", [src], **opts)
    reference = prepare_pairs(tmp_path / "ref", "jsonl", [src], **opts)
    assert resumed["duplicate_pairs"] == reference["duplicate_pairs"] == 1 and resumed["num_samples"] == 39
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in reference["shards"]]


def test_pair_arguments_are_checked(tmp_path):
    with pytest.raises(PrepareError, match="--pair-method 'qrels': --source books takes spans"):
        prepare_pairs(tmp_path / "x", "books", [SAMPLES / "books"], pair_method="qrels")
    with pytest.raises(PrepareError, match="--pairs prepares in one job"):
        prepare_pairs(tmp_path / "x", "books", [SAMPLES / "books"], parts=2)
    with pytest.raises(CorpusError, match="qrels/train.tsv"):
        prepare_pairs(tmp_path / "x", "beir", [SAMPLES / "beir/scifact-sample"])
    assert cli(["prepare", "--pairs", "--source", "books", "--input", str(SAMPLES / "books"), "--out",
                str(tmp_path / "cli"), "--workers", "0", "--span-method", "ict"]) == 0
    assert json.loads((tmp_path / "cli/manifest.json").read_text())["pair_kinds"].keys() == {"ict"}
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"id": "a", "text": "One sentence here. And another one there."}])
    spans = prepare_pairs(tmp_path / "spans", "jsonl", [texts], pair_method="spans", span_method="ict")
    assert spans["pair_kinds"] == {"ict": 1} and next(pair_samples(tmp_path / "spans"))[3]["doc"] == "a"


# --- the stream ---------------------------------------------------------------------------------------------------
def manifests_of(pair_dirs):
    return [pair_dirs / name / "manifest.json" for name in ("wikipedia", "books", "beir")]


def keys(batches):
    return [[(s["source"], s["shard"], s["index"], s["pad"]) for s in b] for b in batches]


def test_stream_yields_pair_samples_and_refuses_mixed_kinds(pair_dirs, wiki_shards):
    stream = ShardStream(manifests_of(pair_dirs), seed=3, shuffle_buffer=20)
    samples = list(stream)
    sizes = [json.loads(m.read_text())["num_samples"] for m in manifests_of(pair_dirs)]
    assert stream.kind == "pairs" and len(samples) == sum(sizes)
    first = samples[0]
    assert {"query", "pos", "negs", "source", "doc"} <= first.keys() and "ids" not in first
    assert all(isinstance(s["query"], np.ndarray) and len(s["pos"]) and s["negs"] == [] for s in samples)
    by_address = {(s["shard_file"].rsplit("/", 1)[-1], s["index"]): s for s in samples}
    for q, p, _, meta in list(pair_samples(pair_dirs / "beir"))[:3]:
        hit = [s for (f, _), s in by_address.items() if f.startswith("beir") and s["query"].tolist() == q]
        assert hit and hit[0]["pos"].tolist() == p and hit[0]["doc"] == meta["doc"]
    with pytest.raises(StreamError, match=rf"{wiki_shards}/manifest.json holds text and .*wikipedia/manifest.json "
                                          "holds pairs"):
        ShardStream([pair_dirs / "wikipedia", wiki_shards / "manifest.json"])


def one_source(pair_dirs, rank=0, world=1, batch=8, **kw):
    return ShardStream(manifests_of(pair_dirs), seed=5, shuffle_buffer=30, rank=rank, world_size=world,
                       one_source_batches=True, batch_size=batch, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_one_source_batches_and_weights(pair_dirs, workers):
    weights, epoch_samples = [0.5, 0.3, 0.2], 500
    streams = [one_source(pair_dirs, rank, 2, weights=weights, epoch_samples=epoch_samples) for rank in (0, 1)]
    loaders = [StreamLoader(s, batch_size=8, num_workers=workers) for s in streams]
    assert [loader.batches_per_epoch() for loader in loaders] == [33, 33]
    epochs = [[keys(loader) for _ in range(2)] for loader in loaders]
    for rank_epochs in epochs:
        for batches in rank_epochs:
            assert all(len(b) == 8 and len({s[0] for s in b}) == 1 for b in batches)
    # quotas 250, 150, 100 rounded up to whole batches: 32, 19 and 13 batches, over 2 ranks 16 + 10 + 7 each
    # (books and beir topped up with one batch repeated, flagged pad)
    assert len(epochs[0][0]) == len(epochs[1][0]) == 33
    drawn = Counter(s[0] for r in (0, 1) for b in epochs[r][0] for s in b if not s[3])
    assert drawn == {"wikipedia": 256, "books": 152, "beir": 104}
    for r in (0, 1):
        assert Counter(b[0][0] for b in epochs[r][0]) == {"wikipedia": 16, "books": 10, "beir": 7}
        sources_in_order = [b[0][0] for b in epochs[r][0]]
        assert sources_in_order != sorted(sources_in_order, key=["wikipedia", "books", "beir"].index)  # mixed
    wiki_epoch0 = {s[1:3] for r in (0, 1) for b in epochs[r][0] for s in b if s[0] == "wikipedia"}
    wiki_epoch1 = {s[1:3] for r in (0, 1) for b in epochs[r][1] for s in b if s[0] == "wikipedia"}
    assert len(wiki_epoch0) == 256 and not wiki_epoch0 & wiki_epoch1  # 256 of 930: the next epoch moves on
    plain = keys(StreamLoader(ShardStream(manifests_of(pair_dirs), seed=5, shuffle_buffer=30, weights=weights,
                                          epoch_samples=epoch_samples), batch_size=8))
    assert any(len({s[0] for s in b}) > 1 for b in plain)  # without the option batches mix sources


@pytest.mark.parametrize("one", [False, True])
@pytest.mark.parametrize("workers,stop", [(0, 5), (2, 7), (1, 13)])
def test_exact_mid_epoch_resume_of_pairs(pair_dirs, one, workers, stop):
    def make():
        if one:
            return one_source(pair_dirs, weights=[1, 1, 1], epoch_samples=300)
        return ShardStream(manifests_of(pair_dirs), seed=5, shuffle_buffer=30, weights=[1, 1, 1], epoch_samples=300)

    full = keys(StreamLoader(make(), batch_size=8, num_workers=workers))
    stream = make()
    it = iter(StreamLoader(stream, batch_size=8, num_workers=workers))
    head = keys([next(it) for _ in range(stop)])
    it.close()
    state = json.loads(json.dumps(stream.state_dict()))
    resumed = make()
    resumed.load_state_dict(state)
    rest = keys(StreamLoader(resumed, batch_size=8, num_workers=workers))
    assert head + rest == full and 0 < len(rest) < len(full)


def test_one_source_plain_iteration_resume_and_refusals(pair_dirs):
    stream = one_source(pair_dirs, batch=4)
    full = [(s["source"], s["shard"], s["index"]) for s in one_source(pair_dirs, batch=4)]
    assert all(len({x[0] for x in full[i:i + 4]}) == 1 for i in range(0, len(full), 4))
    it = iter(stream)
    head = [(s["source"], s["shard"], s["index"]) for s in (next(it) for _ in range(10))]  # stops inside a batch
    state = stream.state_dict()
    resumed = one_source(pair_dirs, batch=4)
    resumed.load_state_dict(state)
    assert head + [(s["source"], s["shard"], s["index"]) for s in resumed] == full
    elastic = one_source(pair_dirs, batch=4, world=2)
    elastic.load_state_dict(state)
    with pytest.raises(StreamError, match="world size 1 and 1 reader"):
        list(elastic)
    with pytest.raises(StreamError, match="needs the batch size"):
        ShardStream(manifests_of(pair_dirs), one_source_batches=True)
    with pytest.raises(ValueError, match="one-source runs are 4 samples"):
        StreamLoader(one_source(pair_dirs, batch=4), batch_size=3)
