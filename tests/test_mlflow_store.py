"""A new sqlite MLflow store is a copy of a cached empty one that MLflow made (pretrieve/utils/mlflow_store.py)."""

import sqlite3
import time

import pytest

from pretrieve.utils.mlflow_store import cache_dir, mlflow_client, seed_sqlite_store


def _tables(path) -> dict:
    with sqlite3.connect(path) as db:
        names = [row[0] for row in db.execute("select name from sqlite_master where type = 'table'")]
        return {name: db.execute(f'select count(*) from "{name}"').fetchone()[0] for name in names}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "pretrieve"


def test_a_new_store_is_the_empty_store_and_mlflow_adds_its_own_default_experiment(cache, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    assert cache_dir() == cache
    first = tmp_path / "a" / "mlflow.db"
    first.parent.mkdir()
    started = int(time.time() * 1000)
    client = mlflow_client(f"sqlite:///{first}")
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    assert template.is_file()
    empty = _tables(template)
    assert empty["alembic_version"] == 1 and "experiments" in empty and empty["experiments"] == 0

    default = client.get_experiment("0")  # made at this open, with this store's artifact root and time
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    assert default.creation_time >= started
    run = client.create_run(client.create_experiment("e")).info.run_id
    client.log_metric(run, "loss", 1.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run, "loss")] == [(3, 1.5)]

    # the next store is a copy: the same tables as MLflow's own making, none of the first store's rows
    second = tmp_path / "b" / "mlflow.db"
    second.parent.mkdir()
    assert seed_sqlite_store(f"sqlite:///{second}")
    assert _tables(second) == empty
    assert sorted(p.name for p in second.parent.iterdir()) == ["mlflow.db"]  # no staged copy left
    made_by_mlflow = tmp_path / "c.db"
    mlflow.MlflowClient(f"sqlite:///{made_by_mlflow}").search_experiments()
    assert _tables(made_by_mlflow) == {**empty, "experiments": 1}  # its Default experiment, added at the open


def test_an_existing_store_or_another_backend_is_left_alone(cache, tmp_path):
    store = tmp_path / "mlflow.db"
    store.write_bytes(b"not replaced")
    assert not seed_sqlite_store(f"sqlite:///{store}")
    assert store.read_bytes() == b"not replaced"
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}")  # MLflow names the folder
    assert not seed_sqlite_store("http://127.0.0.1:5000") and not seed_sqlite_store(str(tmp_path / "mlruns"))
    assert not cache.exists()


def test_without_a_cache_mlflow_makes_the_store_itself(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # the cache cannot be made under a file
    store = tmp_path / "mlflow.db"
    assert not seed_sqlite_store(f"sqlite:///{store}")
    assert not store.exists()
    client = mlflow_client(f"sqlite:///{store}")
    assert client.get_experiment("0").name == "Default" and store.is_file()
