"""The cost of a new sqlite MLflow store at a run's start: MLflow making it (its schema migrations) against a copy
of the cached empty store (pretrieve/utils/mlflow_store.py).

    python -m benchmarks.tracking_start [--repeats 5]

Each measurement is a fresh process, as a run's first process is: it imports MLflow (timed apart), then opens a
store that does not exist yet and lists its experiments. The two ways alternate (A B B A ...), so that drift on a
shared machine falls on both; the cached empty store is made before the first measurement. Appends a JSON record
to benchmarks/results/tracking_start.json: per way the seconds of each open and their median, the import's median,
and the ratio copy / MLflow (< 1: faster).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pretrieve.utils.run_dir import write_atomic

ROOT = Path(__file__).resolve().parent.parent

OPEN = """
import json, sys, time
started = time.perf_counter()
import mlflow
imported = time.perf_counter()
if sys.argv[2] == "copy":
    from pretrieve.utils.mlflow_store import mlflow_client
    client = mlflow_client(sys.argv[1])
else:
    client = mlflow.MlflowClient(tracking_uri=sys.argv[1])
client.search_experiments()
print(json.dumps({"import_s": imported - started, "open_s": time.perf_counter() - imported}))
"""


def measure(way: str, store: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", OPEN, f"sqlite:///{store}", way], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tracking_start.json"))
    args = parser.parse_args()
    from pretrieve.utils.mlflow_store import empty_store

    empty_store()
    times: dict = {"mlflow": [], "copy": []}
    imports = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeats):
            for way in ("mlflow", "copy") if i % 2 == 0 else ("copy", "mlflow"):
                one = measure(way, Path(folder) / f"{way}-{i}.db")
                times[way].append(round(one["open_s"], 3))
                imports.append(one["import_s"])
                print(f"{way:6s} open {one['open_s']:6.2f} s  (import {one['import_s']:.2f} s)", flush=True)
    import mlflow

    median = {way: statistics.median(values) for way, values in times.items()}
    record = {"mlflow": mlflow.__version__, "repeats": args.repeats, "machine": f"{os.cpu_count()} cores",
              "python": platform.python_version(), "open_s": times, "median_open_s": median,
              "median_import_s": round(statistics.median(imports), 3),
              "ratio_copy_to_mlflow": round(median["copy"] / median["mlflow"], 4)}
    out = Path(args.out)
    records = json.loads(out.read_text()) if out.is_file() else []
    write_atomic(out, json.dumps(records + [record], indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
