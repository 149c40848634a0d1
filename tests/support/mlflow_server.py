"""A real `mlflow server` in a folder of the test's, and its cleanup."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from .runs import free_port

# where `mlflow server` keeps its job runner's queue: a folder it makes in /dev/shm and never removes (0.5 MB each)
MLFLOW_JOB_STORE = "_MLFLOW_HUEY_STORAGE_PATH"


@contextlib.contextmanager
def running_mlflow_server(folder: Path):
    """`mlflow server` in `folder` until the block ends: then stopped, and its job store in /dev/shm removed."""
    store, port = folder / "mlflow.db", free_port()
    mlflow = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    if mlflow is None:
        pytest.skip("the mlflow command is not installed beside this interpreter")
    with open(folder / "server.log", "w") as log:  # its own process group: uvicorn and the job runner go with it
        server = subprocess.Popen([mlflow, "server", "--backend-store-uri", f"sqlite:///{store}",
                                   "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1",
                                   "--port", port, "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    url, job_stores = f"http://127.0.0.1:{port}", set()
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as health:
                    if health.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.time() < deadline, (folder / "server.log").read_text()[-3000:]
            time.sleep(0.2)
        job_stores = mlflow_job_stores(server)  # read now: a test may stop the server itself
        yield url, server, store
    finally:
        stop_server(server)
        for path in job_stores | mlflow_job_stores(server):
            shutil.rmtree(path, ignore_errors=True)


def mlflow_job_stores(server: subprocess.Popen) -> set[str]:
    """The job stores the server's processes were handed (its children's environment names them)."""
    found = set()
    try:
        children = psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            path = child.environ().get(MLFLOW_JOB_STORE)
        except psutil.Error:
            continue
        if path:
            found.add(path)
    return found


def stop_server(server: subprocess.Popen) -> None:
    """Kill the server's process group, also when it is frozen."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
    server.wait()
