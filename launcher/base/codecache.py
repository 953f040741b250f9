"""Dataclass methods compiled once, not at every start.

``@dataclass`` writes each class's ``__init__``, ``__eq__``, ``__repr__``, ``__hash__``...
as source text and compiles it with ``exec`` whenever the class is defined: for dtrain's
fifty-odd dataclasses that is about 25 ms of every start, a fifth of a short local job's
launch.  Here ``dataclasses`` gets an ``exec`` that looks the text up in a table of code
objects kept beside the package's bytecode (``launcher/__pycache__``, as Python keeps
``.pyc`` files, and not written where those are not: ``PYTHONDONTWRITEBYTECODE``, a
read-only install).  The key is the whole source text, so a changed class or another
Python's dataclasses only miss; the file's name carries the interpreter's bytecode tag
and magic number.  Nothing of dtrain is imported here: ``launcher/__init__.py`` installs
it before any module defines a class.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import marshal
import os
import sys
from pathlib import Path
from types import CodeType
from typing import Any

CACHE = (
    Path(__file__).resolve().parent
    / "__pycache__"
    / f"dataclass-code.{sys.implementation.cache_tag}.{importlib.util.MAGIC_NUMBER.hex()}.bin"
)
MAX_ENTRIES = 4096  # a bound on the file, whatever defines dataclasses in this process


class CodeCache:
    """The table of compiled dataclass methods: source text -> code object."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.codes: dict[str, CodeType] = {}
        self.added = False
        try:
            loaded = marshal.loads(path.read_bytes())
        except (OSError, EOFError, ValueError, TypeError):
            return  # none yet, or unreadable: compiled as usual, written anew
        if isinstance(loaded, dict):
            self.codes = {k: v for k, v in loaded.items() if isinstance(v, CodeType)}

    def exec(self, source: Any, globals: dict[str, Any] | None = None, locals: Any = None) -> None:
        """``exec`` as ``dataclasses`` calls it, with the compiled text looked up first."""
        if isinstance(source, str):
            code = self.codes.get(source)
            if code is None:
                # As exec compiles a string in dataclasses (no __future__ flags there).
                code = compile(source, "<string>", "exec", dont_inherit=True)
                if len(self.codes) < MAX_ENTRIES:
                    self.codes[source] = code
                    self.added = True
            source = code
        exec(source, globals, locals)

    def save(self) -> None:
        """Write the table if it grew (atomically; quietly not, where it cannot be)."""
        if not self.added or sys.dont_write_bytecode:
            return
        self.added = False
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(exist_ok=True)
            temporary.write_bytes(marshal.dumps(self.codes))
            os.replace(temporary, self.path)
        except OSError:
            try:
                temporary.unlink()
            except OSError:
                pass


ACTIVE: CodeCache | None = None


def install(path: Path = CACHE) -> CodeCache:
    """Give ``dataclasses`` the cached ``exec`` (once per process)."""
    global ACTIVE
    if ACTIVE is None:
        ACTIVE = CodeCache(path)
        setattr(dataclasses, "exec", ACTIVE.exec)  # noqa: B010  (the module's global exec)
    return ACTIVE


def save() -> None:
    """Keep what this process compiled for the next start."""
    if ACTIVE is not None:
        ACTIVE.save()
