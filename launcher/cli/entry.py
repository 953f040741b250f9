"""The ``dtrain`` command's entry point (``[project.scripts]``, ``python -m launcher``).

The command line (click, dtrain's commands and their options: thousands of long-lived
objects) loads with the collector off and is then frozen (``base/interpreter.py``).  Only
the command: a program that imports ``launcher.cli.main`` (``launcher.launch``) loads it
as any module.
"""

from __future__ import annotations

from types import ModuleType

from launcher.base.interpreter import loading


def load_cli() -> ModuleType:
    """``launcher.cli.main``, imported with the collector off; what this process holds
    then is frozen, and the collector is back as it was."""
    with loading(freeze=True):
        from launcher.cli import main
    return main


def run_main() -> None:
    """Console-script entry point: ``cli/main.run_main`` (which never returns)."""
    load_cli().run_main()
