"""paramiko, loaded without loading invoke until it is used.

paramiko's ``config`` module imports ``invoke`` at its top, only to run the command of an
ssh config's ``Match exec`` line; invoke in turn loads asyncio, yaml and unittest.mock,
which is about a sixth of a remote launch's start-up.  Here ``invoke`` is registered as a
lazy module first: paramiko gets it, and it loads the moment ``Match exec`` calls it.
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


defer_import("invoke")

import paramiko as paramiko  # noqa: E402  (after invoke is deferred; re-exported)
