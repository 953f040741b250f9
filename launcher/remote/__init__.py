"""Programs shipped to hosts (the remote layer): stdlib-only, importing nothing of dtrain.

Each runs on a host as text (``python -c``, or read by ``watchdog.BOOTSTRAP``
from stdin), so hosts need no dtrain installed.  The launcher imports them
openly for their constants and helpers, and ``source`` gives their text.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The text of the payload ``name`` (``agent``, ``watchdog``, ``probe``, ``tf_server``)."""
    return (HERE / f"{name}.py").read_text(encoding="utf-8")


def path(name: str) -> Path:
    return HERE / f"{name}.py"
