"""tools/see_parent_venv.py: a venv made by a venv's Python (a GPU image's /opt/torch/.venv) sees that venv's
packages, after its own; a venv made by a plain interpreter gets no .pth."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "see_parent_venv.py"


def _venv(python: str, path: Path) -> Path:
    subprocess.run([python, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], check=True,
                   timeout=120)
    return path / "bin" / "python"


def _site(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())


def _imports(python: Path, module: str) -> str:
    done = subprocess.run([str(python), "-c", f"import {module}; print({module}.WHERE)"], capture_output=True,
                          text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def test_a_venv_made_by_a_venvs_python_sees_the_parents_packages_after_its_own(tmp_path):
    image = _venv(sys.executable, tmp_path / "image")
    (_site(image) / "only_in_image.py").write_text("WHERE = 'image'\n")
    (_site(image) / "in_both.py").write_text("WHERE = 'image'\n")
    job = _venv(str(image), tmp_path / "job")
    assert _imports(job, "only_in_image") == ""  # --system-site-packages alone: the base interpreter's, not these
    subprocess.run([str(image), str(TOOL), str(tmp_path / "job")], check=True, timeout=60)
    (_site(job) / "in_both.py").write_text("WHERE = 'job'\n")
    assert _imports(job, "only_in_image") == "image"
    assert _imports(job, "in_both") == "job"  # the job's own install wins


def test_a_plain_interpreters_venv_is_left_as_it_is(tmp_path):
    python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    if not python.exists():
        pytest.skip(f"no base interpreter at {python}")
    job = _venv(str(python), tmp_path / "job")
    subprocess.run([str(python), str(TOOL), str(tmp_path / "job")], check=True, timeout=60)
    assert not (_site(job) / "parent-venv.pth").exists()
