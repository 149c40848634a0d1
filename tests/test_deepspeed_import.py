"""engine/deepspeed_import.py: DeepSpeed loads without mlflow, which stays importable for tracking after it."""

import subprocess
import sys

import pytest
from support import pretrain_env

pytestmark = pytest.mark.system

SCRIPT = """
import sys
from pretrieve.engine.deepspeed_import import import_deepspeed
deepspeed = import_deepspeed()
from deepspeed.autotuning import autotuner
assert "mlflow" not in sys.modules and autotuner.has_mlflow is False
assert import_deepspeed() is deepspeed
import mlflow
assert sys.modules["mlflow"] is mlflow and hasattr(mlflow, "start_run")
print("ok")
"""


def test_deepspeed_loads_without_mlflow_which_imports_after_it():
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=pretrain_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "ok", done.stderr[-2000:]
