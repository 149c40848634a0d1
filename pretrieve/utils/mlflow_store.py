"""MLflow clients, with a new sqlite store made from a cached empty one.

MLflow makes a new sqlite store by running its whole chain of schema migrations (alembic) in the first process of
every new run folder, seconds on a small CPU. An empty store at the head revision, made once per MLflow version by
MLflow itself and copied, opens in 0.42x that time (benchmarks/tracking_start.py). The copy holds no experiment:
MLflow adds its Default experiment at the first open, with this store's paths, as it does in a store it made.
Where anything of this fails, MLflow makes the store itself, as before.
"""

import os
import secrets
import shutil
from pathlib import Path


def mlflow_client(uri: str):
    """MlflowClient(tracking_uri=uri), a new sqlite store seeded first."""
    from mlflow.tracking import MlflowClient

    seed_sqlite_store(uri)
    return MlflowClient(tracking_uri=uri)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrieve"


def seed_sqlite_store(uri: str) -> bool:
    """Copies the empty store to a sqlite URI's file when that file does not exist yet (its folder must). True when
    it did. Two processes seeding one store at once: the first link wins, and the other's copy is dropped."""
    if not uri.startswith("sqlite:///"):
        return False
    path = Path(uri[len("sqlite:///"):].split("?")[0])
    if path.exists() or not path.parent.is_dir():
        return False
    try:
        template = empty_store()
        staged = _staged(path)
        try:
            shutil.copyfile(template, staged)  # a new file: the umask's mode, as MLflow's own would have
            os.link(staged, path)  # never replaces a store that appeared meanwhile
        finally:
            staged.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - no cache, no hard links, an MLflow without these internals: MLflow makes it
        return False
    return True


def empty_store() -> Path:
    """The cached empty store of the installed MLflow, made on first use (MLflow's own table creation and
    migrations, into a temporary file renamed into place, so a reader never sees half of one)."""
    import mlflow

    template = cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"
    if template.is_file():
        return template
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    template.parent.mkdir(parents=True, exist_ok=True)
    staged = _staged(template)
    try:
        engine = sqlalchemy.create_engine(f"sqlite:///{staged}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(staged, template)
    finally:
        staged.unlink(missing_ok=True)
    return template


def _staged(path: Path) -> Path:
    """A hidden name beside PATH, this process's own, for a file written before it is put in place."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")


def artifact_root(uri: str) -> str | None:
    """Where a new experiment of the store `uri` keeps its artifacts: beside a sqlite store (its folder's
    mlartifacts/), not in ./mlruns under the caller's working directory (MLflow's default); a server or file
    store chooses its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
    return None
