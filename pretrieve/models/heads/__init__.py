"""Pre-training heads, one file per method; importing this package imports every module in it, and each
method's module registers it (registry.py): adding a method is adding a file."""

import importlib
import pkgutil

from pretrieve.models.heads.registry import METHODS, Method, get_method, register_method  # noqa: F401

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
