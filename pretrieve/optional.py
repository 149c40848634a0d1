"""Dependencies that an extra of setup.py brings, not pretrieve itself (docs/offline.md#without-an-extra):
faiss (`cpu` or `gpu`: dense retrieval), matplotlib (`plots`: the figures of reports and scaling fits),
Liger-Kernel (`gpu`: the fused vocabulary loss, model.vocab_loss liger), mteb (`mteb`: `pretrieve eval --mteb`) and
datasets (`hf`: `prepare --hf-dataset`).
A command that needs one says which extra brings it; one that only draws figures with it goes on without."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

FAISS = ("faiss", "pip install 'pretrieve[cpu]' (or 'pretrieve[gpu]' on a CUDA 12 machine)")
MATPLOTLIB = ("matplotlib", "pip install 'pretrieve[plots]'")
LIGER = ("liger_kernel", "pip install 'pretrieve[gpu]' (or pip install liger-kernel)")
MTEB = ("mteb", "pip install 'pretrieve[mteb]'")
DATASETS = ("datasets", "pip install 'pretrieve[hf]'")


def _import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name != module:
            raise  # installed, but something it imports is missing: that error says more than ours would
        return None


def require(dependency: tuple[str, str], what: str) -> ModuleType:
    """The module of an optional dependency; a clear error naming its extra when it is not installed."""
    module, install = dependency
    found = _import(module)
    if found is None:
        raise ModuleNotFoundError(f"{what} needs {module}, which is not installed: {install}", name=module)
    return found


def available(dependency: tuple[str, str], skipped: str) -> bool:
    """Whether an optional dependency is installed; if not, says on stderr what is skipped without it."""
    module, install = dependency
    if _import(module) is None:
        print(f"pretrieve: {module} is not installed, so {skipped} are left out ({install})", file=sys.stderr)
        return False
    return True
