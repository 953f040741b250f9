"""Programs shipped to hosts (the remote layer): stdlib-only, importing nothing of dtrain.

Each runs on a host as text (``python -c``, or read by ``watchdog.BOOTSTRAP``
from stdin), so hosts need no dtrain installed.  The launcher imports them
openly for their constants and helpers, and ``source`` gives their text.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """The payload ``name`` (``agent``, ``watchdog``, ``probe``, ``tf_server``...) as the
    program that is sent: its file's text, compiled there under the file's name, so that
    its tracebacks name ``remote/NAME.py`` with the right lines (not ``<string>``) and
    coverage counts it.  It runs as the bare text would: in the globals it is given."""
    text = (HERE / f"{name}.py").read_text(encoding="utf-8")
    return f"exec(compile({text!r}, {str(path(name))!r}, 'exec'))\n"


def path(name: str) -> Path:
    return HERE / f"{name}.py"
