"""Dependencies that an extra brings (pretrieve/optional.py, docs/offline.md#without-an-extra): without faiss,
dense retrieval names the extra to install; without matplotlib, `pretrieve report` and `pretrieve scale fit` write
everything but their figures. A module is made absent as Python sees an uninstalled one: None in sys.modules
makes its import raise ModuleNotFoundError (tests/test_offline_install.py runs the same on a real install
without the extras)."""

import sys

import numpy as np
import pytest

from pretrieve.cli import main as cli
from pretrieve.eval.search import dense_search
from pretrieve.optional import require


def test_exact_search_needs_no_faiss_and_an_index_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)
    assert dense_search(np.eye(2, 4), ["a", "b"], np.eye(1, 4), ["q"], k=1) == {"q": {"a": 1.0}}  # numpy alone
    with pytest.raises(ModuleNotFoundError, match=r"the hnsw index needs faiss, which is not installed: "
                                                  r"pip install 'pretrieve\[cpu\]' \(or 'pretrieve\[gpu\]'"):
        dense_search(np.eye(2, 4), ["a", "b"], np.ones((1, 4)), ["q"], k=1, index="hnsw")


def test_a_missing_import_inside_an_installed_module_is_its_own_error(tmp_path, monkeypatch):
    """Only the module itself missing means "install the extra"; what it fails to import is reported as is."""
    (tmp_path / "half_installed.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'not_a_module_anywhere'"):
        require(("half_installed", "pip install half-installed"), "this")


def _one_evaluation(uri: str) -> None:
    """One evaluation run in the store, tagged as `pretrieve farm` tags its runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("pretrieve-eval")
    run = client.create_run(experiment, tags={"pretrieve.farm": "eval", "checkpoint": "m", "dataset": "scifact",
                                              "stage": "zero-shot"}).info.run_id
    for key, value in (("ndcg_at_10", 0.25), ("mrr_at_10", 0.2), ("recall_at_100", 0.5)):
        client.log_metric(run, key, value)


def test_report_without_matplotlib_has_its_tables_and_no_plots(tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _one_evaluation(uri)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli(["report", "--uri", uri, "--out", str(tmp_path / "report"), "--no-mlflow"]) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed, so the report's plots are left out (pip install 'pretrieve[plots]')" in err
    assert not list((tmp_path / "report").glob("*.png"))
    assert (tmp_path / "report" / "ndcg@10.csv").read_text().splitlines()[1].startswith("m,0.25")
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h2>recall@100</h2>" in page and "<img" not in page


def test_scale_fit_without_matplotlib_writes_the_fit_and_no_plots(tmp_path, monkeypatch, capsys):
    N = np.repeat([1e6, 3e6, 1e7, 3e7], 3)
    D = np.tile([2e8, 6e8, 2e9], 4)
    loss = 1.8 + 480 * N ** -0.35 + 2000 * D ** -0.37
    points = tmp_path / "points.csv"
    points.write_text("N,D,loss\n" + "".join(f"{n},{d},{value}\n" for n, d, value in zip(N, D, loss)))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli(["scale", "fit", "--csv", str(points), "--out", str(tmp_path / "fit"), "--bootstrap", "0"]) == 0
    assert "matplotlib is not installed, so the fit's plots are left out" in capsys.readouterr().err
    assert (tmp_path / "fit" / "fit.json").is_file() and (tmp_path / "fit" / "points.csv").is_file()
    assert not list((tmp_path / "fit").glob("*.png"))
