"""`train.deterministic: true`: PyTorch's documented switches for bit-exact GPU runs
(https://pytorch.org/docs/stable/notes/randomness.html), at some speed cost. Without them cuBLAS and some
CUDA kernels (atomics in scatter/index_add backward, cuDNN autotuning) may sum in another order from run to
run, so a resumed GPU run can drift from the uninterrupted one in the last bits. The fused attention kernel
reads the same switch: it then launches its first tile configuration instead of autotuning between two, whose
sums run in another order (kernels/fused.py). CPU runs are deterministic either way."""

from __future__ import annotations

import contextlib
import os

import torch

# cuBLAS picks its reduction order per workspace; a fixed workspace per stream makes it reproducible
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic(enabled: bool):
    """Set the switches for the run and restore the previous ones after it (the process may train again).
    Enter it before the first cuBLAS call: the workspace setting is read when the handle is created."""
    if not enabled:
        yield
        return
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
                os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)  # an op without a deterministic kernel raises, naming itself
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        algorithms, warn_only, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, workspace = previous
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
