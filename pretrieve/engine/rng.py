"""The random states a checkpoint saves and a resume restores, so that a resumed run draws what an
uninterrupted one would: Python, NumPy, torch's CPU generator and, on GPU machines, every CUDA device's
generator (dropout on a GPU draws from the device's generator, not the CPU one)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Python, NumPy, the CPU and every CUDA generator (torch.manual_seed seeds the devices too)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_generators() -> list[torch.Generator]:
    """The default generator of each CUDA device; none without CUDA."""
    if not torch.cuda.is_available():
        return []
    torch.cuda.init()  # the default generators exist once CUDA is initialised
    return list(torch.cuda.default_generators)


def generator_states(generators: list[torch.Generator]) -> list[torch.Tensor]:
    return [g.get_state() for g in generators]


def set_generator_states(generators: list[torch.Generator], states: list[torch.Tensor], where: str) -> None:
    """Restore `states` into `generators`, one each; a count that differs (the checkpoint saw another number of
    devices per process) is refused by name rather than left half-restored."""
    if len(states) != len(generators):
        raise ValueError(f"{where}: the checkpoint holds {len(states)} device RNG states, this process has "
                         f"{len(generators)} devices; resume with the same devices per process, or convert the "
                         "checkpoint with `pretrieve universal` (which reseeds)")
    for generator, state in zip(generators, states):
        generator.set_state(state)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "devices": generator_states(device_generators())}


def set_rng_state(state: dict, where: str) -> None:
    """`where` names the checkpoint in errors. Checkpoints written before device states were saved have no
    "devices" entry: their device generators keep the run's seed."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "devices" in state:
        set_generator_states(device_generators(), state["devices"], where)
