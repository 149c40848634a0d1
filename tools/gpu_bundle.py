"""`make gpu-bundle`: what a short GPU job carries besides the repository (docs/offline.md, "A short GPU
allocation"), made on a machine with network.

    python tools/gpu_bundle.py --out gpu-bundle --data ../shared/data [--have "torch==2.11.*,..."] [--wiki-mib 18]

    gpu-bundle/wheelhouse/     the wheels the node lacks, for its Python and platform (tools/wheelhouse.py), with
                               the speed extra (Liger-Kernel) alone: exact search needs no faiss
    gpu-bundle/data.tar.gz     the quality study's data in `pretrieve study run --data` form: the BEIR
                               collections (SciFact, CACM, Cranfield), the books, and the first Wikipedia articles
                               of the sample that fit --wiki-mib compressed (the study repeats its text anyway)
    gpu-bundle/bundle.json     what was taken: article counts, sizes, sha256

A job may carry 64 MiB in all, the repository included: the bundle's size and the total are printed, and a
bundle that does not fit is an error.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# run as a script, with tools/ first on sys.path: the GPU job's carry limit and sizes come from the repository root
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_job import CARRY_LIMIT_MIB, repository_mib, tree_mib

WIKI = Path("pretrain") / "enwiki-sample" / "enwiki_2015_wikiextractor_100shards.jsonl.gz"
COLLECTIONS = ("scifact", "cacm", "cranfield")
# the GPU node's own packages (pip list there): left out of the wheelhouse, pinned where the rest must match
NODE_HAVE = ("torch==2.11.*,triton==3.6.*,transformers==5.17.*,tokenizers,safetensors,sentence-transformers,peft,"
             "numpy,scipy,pandas,pyyaml,tqdm,rich,fsspec,pytest,pyarrow")


def wiki_subset(source: Path, out: Path, limit_mib: float) -> dict:
    """The first articles of `source` whose gzip stays under `limit_mib`."""
    articles = 0
    with gzip.open(source, "rt", encoding="utf-8") as lines, open(out, "wb") as raw, \
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as sink:
        for line in lines:
            sink.write(line.encode("utf-8"))
            articles += 1
            if raw.tell() > limit_mib * 2**20:
                break
    return {"articles": articles, "of": sum(1 for _ in gzip.open(source, "rt", encoding="utf-8")),
            "bytes": out.stat().st_size}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_archive(data: Path, out: Path, wiki_mib: float) -> dict:
    """data.tar.gz of the study's data (WIKI cut to `wiki_mib`), and its record."""
    missing = [str(data / p) for p in (WIKI, Path("pretrain") / "gutenberg", *(Path("beir") / c for c in COLLECTIONS))
               if not (data / p).exists()]
    if missing:
        raise SystemExit(f"--data {data}: missing {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as tmp:
        wiki = Path(tmp) / WIKI.name
        record = {"wikipedia": {"source": str(WIKI), **wiki_subset(data / WIKI, wiki, wiki_mib)}}
        record["wikipedia"]["sha256"] = sha256(wiki)
        archive = out / "data.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(wiki, arcname=f"data/{WIKI}")
            tar.add(data / "pretrain" / "gutenberg", arcname="data/pretrain/gutenberg")
            for name in COLLECTIONS:
                tar.add(data / "beir" / name, arcname=f"data/beir/{name}")
    record["archive"] = {"bytes": archive.stat().st_size, "sha256": sha256(archive)}
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "gpu-bundle")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="the shared data folder")
    p.add_argument("--have", default=NODE_HAVE, help="packages the node has (default: %(default)s)")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--platform", default="manylinux_2_28_x86_64")
    p.add_argument("--wiki-mib", type=float, default=18.0, help="the Wikipedia subset's compressed size")
    p.add_argument("--skip-wheelhouse", action="store_true", help="keep the bundle's wheelhouse as it is")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.skip_wheelhouse:
        subprocess.run([sys.executable, str(ROOT / "tools" / "wheelhouse.py"), "--out", str(args.out / "wheelhouse"),
                        "--project", str(ROOT), "--python-version", args.python_version, "--platform", args.platform,
                        "--have", args.have, "--target-has", str(ROOT / "tools" / "gpu_node_packages.txt"),
                        "--extras", "speed"], check=True)
    record = data_archive(args.data, args.out, args.wiki_mib)
    record["wheelhouse_mib"] = round(tree_mib(args.out / "wheelhouse"), 2)
    (args.out / "bundle.json").write_text(json.dumps(record, indent=1) + "\n")
    repo, bundle = repository_mib(), tree_mib(args.out)
    total = repo + bundle
    print(json.dumps({**record, "repository_mib": round(repo, 2), "bundle_mib": round(bundle, 2),
                      "total_mib": round(total, 2), "limit_mib": CARRY_LIMIT_MIB}))
    if total > CARRY_LIMIT_MIB:
        print(f"the repository and {args.out} are {total:.1f} MiB, over the {CARRY_LIMIT_MIB} MiB a job carries: "
              "lower --wiki-mib", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
