"""The function's trip to the ranks and its results' way back (the edge's half;
``remote/fnrunner.py`` is the ranks').

The call ``(fn, args, kwargs)`` is pickled with cloudpickle: by reference when ``fn``'s
module can be imported (the ranks import it; its folder goes on their ``sys.path``), by
value when it cannot (a notebook cell, ``__main__``).  It travels in the ranks' environment
as ``-x`` variables (never on a command line: the values may be secrets), in pieces under
the kernel's limit for one variable, with a token that marks the job's result lines.  The
results come back in the job directory (``results/rank.N``, kept by the recorder).
"""

from __future__ import annotations

import base64
import json
import linecache
import pickle
import secrets
import sys
import sysconfig
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.base.errors import LauncherError, UsageError
from launcher.core.results import (
    PATHS_VARIABLE,
    PAYLOAD_VARIABLE,
    RESULT_LIMIT_VARIABLE,
    TOKEN_VARIABLE,
    VALUE,
    read_frames,
    result_file_name,
)

MAX_CALL_BYTES = 1 << 20  # the pickled call: it travels with every rank's environment
MAX_RESULT_BYTES = 16 << 20  # one rank's pickled return value (the ranks check it)
PIECE_CHARS = 100_000  # of base64 in one variable (Linux takes 128 KiB for one)


@dataclass(frozen=True)
class Packed:
    """The call as the ranks' variables (``NAME=VALUE``), and the token of its results."""

    variables: tuple[str, ...]
    token: str
    name: str  # the function's, for ps and dtrain jobs


def function_name(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def pack_call(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> Packed:
    """The call pickled into variables; a call that cannot travel is a UsageError."""
    if not callable(fn):
        raise UsageError(f"launch() runs a function, not {fn!r}", "pass the function itself")
    import cloudpickle  # type: ignore[import-untyped]  # (here: dtrain's CLI never loads it)

    try:
        call = (fn, tuple(args), dict(kwargs or {}), code_origins(fn))
        data = cloudpickle.dumps(call, protocol=4)
    except Exception as exc:  # pickle's errors have no common base
        raise UsageError(
            f"the function or its arguments cannot be pickled: {exc}",
            "pass what the ranks can rebuild (a path, not an open file or a lock)",
        ) from None
    if len(data) > MAX_CALL_BYTES:
        raise UsageError(
            f"the function and its arguments pickle to {len(data):,} bytes, over the "
            f"{MAX_CALL_BYTES:,} that travel with every rank",
            "pass large data as a path the ranks read, or load it inside the function",
        )
    text = base64.b64encode(data).decode("ascii")
    pieces = [text[i : i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
    token = secrets.token_hex(16)
    variables = [
        f"{PAYLOAD_VARIABLE}={len(pieces)}",
        *(f"{PAYLOAD_VARIABLE}_{index}={piece}" for index, piece in enumerate(pieces)),
        f"{TOKEN_VARIABLE}={token}",
        f"{RESULT_LIMIT_VARIABLE}={MAX_RESULT_BYTES}",
    ]
    paths = code_folders(fn)
    if paths:
        variables.append(f"{PATHS_VARIABLE}={':'.join(paths)}")
    return Packed(tuple(variables), token, function_name(fn))


MAX_SOURCE_CHARS = 256 * 1024  # of the source sent along with a function sent by value
Origins = tuple[dict[tuple[str, int], str], dict[str, str]]


def code_origins(fn: Callable[..., Any]) -> Origins:
    """For a function sent by value (a notebook's, ``__main__``'s): where its code and that
    of its module's functions comes from, and the text there.  cloudpickle names such code
    ``<dynamic-code>``; the rank puts the names and the lines back, so that its tracebacks
    say the cell or file and the line as here."""
    module = getattr(fn, "__module__", None)
    if module != "__main__" and module in sys.modules:
        return {}, {}  # by reference: the rank imports the module itself
    roots = [fn] + [
        value
        for value in getattr(fn, "__globals__", {}).values()
        if isinstance(value, types.FunctionType) and value.__module__ == module
    ]
    codes = {
        (code.co_name, code.co_firstlineno): code.co_filename
        for root in roots
        if isinstance(getattr(root, "__code__", None), types.CodeType)
        for code in nested(root.__code__)
    }
    sources: dict[str, str] = {}
    for filename in sorted(set(codes.values())):
        text = "".join(linecache.getlines(filename))
        if text and sum(map(len, sources.values())) + len(text) <= MAX_SOURCE_CHARS:
            sources[filename] = text
    return codes, sources


def nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from nested(const)


def code_folders(fn: Callable[..., Any]) -> list[str]:
    """The folder a function's own module is imported from, when that is not where Python
    keeps installed packages: the ranks look there too (a script's helper module)."""
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if name else None
    file = getattr(module, "__file__", None)
    if name is None or name == "__main__" or not file:
        return []
    root = Path(file).resolve().parent
    for _ in range(name.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    places = sysconfig.get_paths()
    installed = {
        Path(places[key]).resolve() for key in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    if any(root == folder or folder in root.parents for folder in installed):
        return []
    return [str(root)]


@dataclass(frozen=True)
class RankError:
    """What a rank's function raised, as the rank described it."""

    type: str
    message: str
    traceback: str


def read_result(job_path: Path, rank: int, token: str) -> tuple[str, Any] | None:
    """What rank ``rank`` sent back: (VALUE, the value) or (ERROR, a ``RankError``); None:
    nothing came whole."""
    try:
        lines = (job_path / result_file_name(rank)).read_bytes().splitlines()
    except OSError:
        return None
    sent = read_frames(lines, token)
    if sent is None:
        return None
    if sent.kind == VALUE:
        try:
            return sent.kind, pickle.loads(sent.data)  # (the job's own ranks': its token)
        except Exception as exc:  # unpickling raises anything the value's classes raise
            raise LauncherError(
                f"rank {rank}'s return value cannot be rebuilt here: {exc}",
                "return plain values (numbers, lists, dicts, arrays) or save to a file",
            ) from None
    try:
        record = json.loads(sent.data.decode("utf-8", "replace"))
    except ValueError:
        record = {}
    return sent.kind, RankError(
        str(record.get("type", "?")),
        str(record.get("message", "")),
        str(record.get("traceback", "")),
    )
