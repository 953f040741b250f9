"""The ``dtrain`` command's entry point (``[project.scripts]``, ``python -m launcher``).

Importing click, dtrain's commands and their options makes thousands of long-lived
objects and no garbage, and the cyclic collector would look at them all again and again
meanwhile (and at every full collection after): about a twentieth of a short local job's
launcher.  So the command line loads with the collector off, and what the process holds
then is left out of the collections (``gc.freeze``), as ``cli/main.loading_for_good`` does
for the job's modules; a job's end gives it all back (``start_job``).  Only the command: a
program that imports ``launcher.cli.main`` (``launcher.launch``) loads it as any module.
"""

from __future__ import annotations

import gc
from types import ModuleType


def load_cli() -> ModuleType:
    """``launcher.cli.main``, imported with the collector off; what this process holds
    then is frozen, and the collector is back as it was."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        from launcher.cli import main
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    return main


def run_main() -> None:
    """Console-script entry point: ``cli/main.run_main`` (which never returns)."""
    load_cli().run_main()
