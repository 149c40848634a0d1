"""`import deepspeed` without the `import mlflow` of its autotuner.

DeepSpeed's package import loads its autotuner (deepspeed/autotuning/autotuner.py), which imports mlflow when it
is installed, as it is here (pretrieve tracks runs in MLflow). That import is about half of DeepSpeed's: 1.7 of
3.5 s on a 2-core machine, paid by every rank of every run, tracked or not. pretrieve never autotunes, and its
tracking imports mlflow itself when it is on, so the autotuner is shown no mlflow while DeepSpeed loads: it then
sets its `has_mlflow` to False, which only autotuning reads.
"""

from __future__ import annotations

import sys


def import_deepspeed():
    """The deepspeed module, imported once per process; before any other `deepspeed` import of the process."""
    if "deepspeed" not in sys.modules and "mlflow" not in sys.modules:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError here, which the autotuner catches
        try:
            import deepspeed  # noqa: F401
        finally:
            del sys.modules["mlflow"]
    import deepspeed

    return deepspeed
