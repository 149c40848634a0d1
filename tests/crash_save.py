"""`pretrieve pretrain ...` whose checkpoint at step 4 fails half-written: every file of that tag gets a few
bytes and then the write raises, as a full disk or a killed node would leave it."""

import sys

import torch

from pretrieve.cli import main

real_save = torch.save


def failing_save(obj, path, *args, **kwargs):
    if "step00000004" in str(path):
        with open(path, "wb") as partial:
            partial.write(b"half a checkpoint")
        raise OSError(28, "No space left on device (injected by tests/crash_save.py)")
    return real_save(obj, path, *args, **kwargs)


torch.save = failing_save
sys.exit(main(["pretrain", *sys.argv[1:]]))
