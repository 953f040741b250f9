"""Modules that a library imports at its top but dtrain seldom uses, loaded when first used.

paramiko's ``config`` imports ``invoke`` (asyncio, yaml, unittest.mock) only to run an ssh
config's ``Match exec``; click's ``types`` imports ``uuid`` and ``datetime`` for parameter
types dtrain has none of.  Registered here before the library is imported, such a module is
a stand-in that imports the real one the moment any of its attributes is read, so nothing
changes for a caller but when the cost is paid.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


def defer_import(name: str) -> None:
    """Make ``import name`` give a stand-in module that imports the real one on its first
    attribute access (if it is installed and not loaded yet).  (importlib's LazyLoader does
    not do: the import statement itself reads the module's ``__spec__``, which loads it.)"""
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return
    stand_in = types.ModuleType(name, f"{name}, imported when first used")

    def load(attr: str) -> Any:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)

    stand_in.__getattr__ = load  # type: ignore[method-assign]  # PEP 562: missing attributes
    sys.modules[name] = stand_in
