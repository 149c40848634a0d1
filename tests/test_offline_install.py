"""An install with no network (docs/offline.md): `make wheelhouse` for this machine's Python, leaving out torch and
pytest, which the node already has; then, inside a network namespace with loopback alone (tests/netns.py), `make
install WHEELHOUSE=...` into that node's environment with pip's configuration cleared (no index, no other
find-links), `pretrieve --help`, a 2-step pre-training tracked to MLflow's sqlite store, and the GPU tests'
collection (`make test-gpu`'s files import with what the wheelhouse brought). The node's environment is a venv
holding torch (the build this machine's pip config installs) and pytest, as a GPU node holds its own."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from support import pretrain_env, result_line

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
PYPI = "151.101.0.223"  # one of pypi.org's addresses: an IP, so that the failure is the route, not DNS


def _run(command: list[str], timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """COMMAND, which must succeed; how long it took is printed (`pytest -s`), for the docs' install times. Past
    the timeout its whole process group is killed (make's pip, DeepSpeed's compiler), not make alone."""
    started = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    done = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    print(f"{time.monotonic() - started:6.0f} s  {' '.join(command)[-150:]}")
    return done


def _offline_env(**extra: str) -> dict:
    """No pip configuration of this machine (its find-links and local indexes) reaches the install."""
    env = {k: v for k, v in pretrain_env().items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def _node_environment(node: Path) -> None:
    """The node's own Python environment, made while there is network: torch, as installed here, and pytest."""
    from importlib.metadata import version

    _run([sys.executable, "-m", "venv", str(node)], timeout=300)
    torch = version("torch").split("+")[0]
    _run([str(node / "bin" / "python"), "-m", "pip", "install", "-q", f"torch=={torch}", "pytest"], timeout=1200)


@pytest.fixture
def offline_node():
    with netns.made_or_skipped(netns.offline_node) as node:
        yield node


def test_install_from_a_wheelhouse_with_no_network_then_train(offline_node, tmp_path, wiki_shards):
    wheelhouse, node = tmp_path / "wheelhouse", tmp_path / "node"
    try:
        built = _run(["make", "wheelhouse", f"WHEELHOUSE={wheelhouse}", "EXTRAS=", "HAVE=torch,pytest",
                      f"PYTHON={sys.executable}"], timeout=1800)
        print(built.stdout.splitlines()[-1])  # the wheelhouse's size
        wheels = sorted(path.name for path in wheelhouse.iterdir())
        assert not [w for w in wheels if re.match(r"(torch|pytest)-", w)], "the node's own packages were fetched"
        assert [w for w in wheels if re.match(r"deepspeed-.*-py3-none-any\.whl$", w)], wheels  # built from source
        assert all(w.endswith(".whl") for w in wheels)
        assert re.search(rf"{wheelhouse}: {len(wheels)} wheels, [\d.]+ MiB", built.stdout)
        _node_environment(node)

        python = str(node / "bin" / "python")
        env = _offline_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"))
        unreachable = subprocess.run(offline_node.command(python, "-c", "import socket; socket.create_connection("
                                                          f"('{PYPI}', 443), timeout=10)"),
                                     capture_output=True, text=True, timeout=60)
        assert unreachable.returncode != 0 and "Network is unreachable" in unreachable.stderr

        _run(offline_node.command("make", "install", f"VENV={node}", f"WHEELHOUSE={wheelhouse}", "EXTRAS=",
                                  f"PYTHON={python}"), timeout=1800, env=env)
        assert "pretrain" in _run(offline_node.command(str(node / "bin" / "pretrieve"), "--help"), 120, env).stdout

        run = tmp_path / "runs" / "tiny"
        trained = _run(offline_node.command(
            str(node / "bin" / "pretrieve"), "pretrain", str(ROOT / "configs/pretrain/tiny-mlm.yaml"),
            f"run_dir={run}", f"data.manifests=[{wiki_shards / 'manifest.json'}]", "data.weights=null",
            "method.max_len=64", "train.max_steps=2", "train.micro_batch_size=4", "data.num_workers=0"),
            timeout=900, env=env)
        assert result_line(trained.stdout)["step"] == 2
        assert "MLflow tracking disabled" not in trained.stderr and (run.parent / "mlflow.db").is_file()

        # without the `cpu` extra exact search runs on numpy, and an approximate index says which extra brings faiss
        missing = subprocess.run(offline_node.command(python, "-c", "import numpy as np; from pretrieve.eval.search "
                                                      "import dense_search; dense_search(np.ones((2, 4)), ['a', 'b'],"
                                                      " np.ones((1, 4)), ['q'], k=1); dense_search(np.ones((2, 4)), ['a', 'b'], np.ones((1, 4)), ['q'],"
                                                      " k=1, index='hnsw')"),
                                 capture_output=True, text=True, timeout=120, env=env)
        assert "the hnsw index needs faiss, which is not installed: pip install 'pretrieve[cpu]'" in missing.stderr
        # `make test-gpu`'s test files import with the node's packages and the wheelhouse's (here they skip: no GPU)
        _run(offline_node.command(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels_gpu.py",
                                  "tests/test_engine_gpu.py"), timeout=600, env=env)
    finally:
        shutil.rmtree(node, ignore_errors=True)  # a venv with torch: about a gigabyte
        shutil.rmtree(wheelhouse, ignore_errors=True)
