"""What this process's terminal can show: whether rich would take a file for a terminal,
its colour system (as rich finds it, without loading rich) and its width."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO


def forced_terminal() -> bool:
    """Variables by which rich takes any file for a terminal (force-color.org)."""
    return os.environ.get("TTY_COMPATIBLE") == "1" or bool(os.environ.get("FORCE_COLOR"))


def rich_overrides() -> bool:
    """Variables by which rich decides other than by the terminal alone: rich reads them."""
    return any(name in os.environ for name in ("TTY_COMPATIBLE", "FORCE_COLOR"))


def terminal_color_system(environ: Mapping[str, str] | None = None) -> str | None:
    """The colour system rich finds for a terminal (``Console._detect_color_system``)."""
    env = os.environ if environ is None else environ
    term = env.get("TERM", "").strip().lower()
    if env.get("TERM", "").lower() in ("dumb", "unknown"):
        return None
    if env.get("COLORTERM", "").strip().lower() in ("truecolor", "24bit"):
        return "truecolor"
    return {"kitty": "256", "256color": "256"}.get(term.rpartition("-")[2], "standard")


def terminal_width(out: TextIO) -> int:
    """The terminal's columns as rich finds them (``COLUMNS`` first), else 80."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(out.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80
