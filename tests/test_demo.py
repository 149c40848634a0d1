import subprocess
import sys

import pytest
from support import pretrain_env


@pytest.mark.integration
def test_demo_ends_in_a_report_of_the_export_beside_bm25(tmp_path):
    out = tmp_path / "demo-out"
    done = subprocess.run([sys.executable, "-m", "pretrieve.demo", "--out", str(out), "--steps", "5"],
                          env=pretrain_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["demo-out"]  # nothing beside it (MLflow's ./mlruns), so
    # `make clean` removes all of it
    lines = done.stdout.splitlines()
    assert lines[-2].startswith("next: mlflow ui --backend-store-uri sqlite:///")
    assert lines[-1].strip() == f"open {out.resolve() / 'report' / 'report.html'}"
    table = done.stdout.split("### ndcg@10")[1].split("###")[0]
    assert "| bm25 | " in table and "| tiny-dupmae | " in table
    page = (out / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<td>tiny-dupmae</td>" in page
