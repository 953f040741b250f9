"""One rank of ``launcher.launch(fn)``: ``python -m launcher.remote.fnrunner NAME``.

The function and its arguments come pickled in the rank's environment (which every
transport already carries, as JSON on the agent's channel for a remote rank: never on a
command line), in pieces under the kernel's limit for one variable; they are taken out of
the environment before the function runs, so its children do not inherit them.  What the
function returns (pickled) or raises (its type, message and traceback) goes back on the
stdout the rank started with, as lines of base64 that begin with a mark and the job's token
(``launcher/core/results.py`` reads them; the format is repeated here because this module
imports nothing of dtrain).  NAME (the function's name) is only there for ``ps`` and
``dtrain jobs``.

A function defined in a notebook or in ``__main__`` comes by value (cloudpickle's, which
``pickle`` imports to rebuild it): cloudpickle must be installed where the rank runs.
"""

from __future__ import annotations

import base64
import json
import linecache
import os
import pickle
import sys
import time
import traceback
import types
from typing import Any

MARK = b"\x1edtrain-result "  # core/results.RESULT_MARK
VALUE, ERROR = "value", "error"
PAYLOAD = "DTRAIN_FN_PAYLOAD"  # the number of pieces; the pieces are PAYLOAD_0, PAYLOAD_1...
TOKEN = "DTRAIN_FN_TOKEN"  # the job's: marks its result lines
PATHS = "DTRAIN_FN_PATH"  # folders of the function's module, for sys.path
RESULT_LIMIT = "DTRAIN_FN_RESULT_LIMIT"  # bytes a pickled return value may have
DEFAULT_RESULT_LIMIT = 16 << 20
LINE_CHUNK = 3000  # base64 characters a line: a line stays under PIPE_BUF, written whole
DYNAMIC = "<dynamic-code>"  # cloudpickle's name for the file of code it sent by value
TORCH_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # dtrain's summary reads it (local ranks)


def take_payload(environ: Any) -> bytes:
    """The pickled call, taken out of the environment."""
    count = int(environ.pop(PAYLOAD))
    pieces = [environ.pop(f"{PAYLOAD}_{index}") for index in range(count)]
    return base64.b64decode("".join(pieces))


def frame_lines(token: str, kind: str, data: bytes) -> list[bytes]:
    """``data`` as result lines: mark, token, kind, index/count, a piece of its base64."""
    text = base64.b64encode(data)
    pieces = [text[i : i + LINE_CHUNK] for i in range(0, len(text), LINE_CHUNK)] or [b""]
    head = MARK + token.encode("ascii") + b" " + kind.encode("ascii") + b" "
    return [head + b"%d/%d " % (i, len(pieces)) + piece + b"\n" for i, piece in enumerate(pieces)]


def send(fd: int, token: str, kind: str, data: bytes) -> None:
    for line in frame_lines(token, kind, data):
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]


def describe(exc: BaseException, skip_frames: int = 1) -> dict[str, str]:
    """An exception as the launcher shows it: type, message, traceback (this module's frame
    left out)."""
    tb = exc.__traceback__
    for _ in range(skip_frames):
        tb = tb.tb_next if tb is not None else None
    kind = type(exc)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    lines = traceback.format_exception(kind, exc, tb)
    return {"type": name, "message": str(exc), "traceback": "".join(lines)}


def send_error(fd: int, token: str, error: dict[str, str]) -> None:
    send(fd, token, ERROR, json.dumps(error).encode("utf-8"))


def write_torch_error_file(error: dict[str, str]) -> None:
    """The exception in torch's error-file format, where dtrain gave the rank one (its
    summary then says what was raised, and where), unless the function's ``@record`` did."""
    path = os.environ.get(TORCH_ERROR_FILE)
    if not path or os.path.exists(path):
        return
    message = {
        "message": f"{error['type']}: {error['message']}",
        "extraInfo": {"py_callstack": error["traceback"], "timestamp": str(int(time.time()))},
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message}, f)
    except OSError:
        pass


def load_hint(exc: BaseException) -> str:
    """What to do when the function cannot be loaded on this host."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    if missing == "cloudpickle":
        return (
            "a function defined in a notebook or __main__ travels by value: "
            "install cloudpickle for this host's python (pip install cloudpickle)"
        )
    if missing:
        return (
            f"module {missing!r} is not importable here: install it on this host, "
            "or run from a folder every host shares"
        )
    return "the function or its arguments could not be rebuilt on this host"


def name_code(fn: Any, codes: dict[tuple[str, int], str], sources: dict[str, str]) -> None:
    """Code sent by value is named ``<dynamic-code>`` (cloudpickle's doing): give it and its
    module's functions back the file (a notebook's cell) and the text they come from, so
    that a traceback here says where, and shows the line."""
    for filename, text in sources.items():
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    for function in [fn, *getattr(fn, "__globals__", {}).values()]:
        if isinstance(function, types.FunctionType) and function.__code__.co_filename == DYNAMIC:
            function.__code__ = renamed(function.__code__, codes)


def renamed(code: types.CodeType, codes: dict[tuple[str, int], str]) -> types.CodeType:
    consts = tuple(
        renamed(c, codes) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    filename = codes.get((code.co_name, code.co_firstlineno), code.co_filename)
    return code.replace(co_filename=filename, co_consts=consts)


def dumps(value: Any) -> bytes:
    """The return value pickled (cloudpickle, where it is here, for what pickle cannot)."""
    try:
        return pickle.dumps(value, protocol=4)
    except Exception:
        if "cloudpickle" not in sys.modules:
            raise
        packer: Any = sys.modules["cloudpickle"]
        return bytes(packer.dumps(value, protocol=4))


def returned(fd: int, token: str, value: Any, limit: int) -> int:
    """Send what the function returned; a value that cannot go back fails the rank."""
    try:
        data = dumps(value)
    except Exception as exc:
        error = describe(exc, skip_frames=0)
        return refuse(fd, token, error, f"its return value cannot be pickled: {exc}")
    if len(data) > limit:
        message = (
            f"its return value pickles to {len(data)} bytes, over the limit of {limit} "
            "(hint: save large results to a file and return its path)"
        )
        return refuse(fd, token, {"type": "ValueError", "traceback": ""}, message)
    send(fd, token, VALUE, data)
    return 0


def refuse(fd: int, token: str, error: dict[str, str], message: str) -> int:
    """dtrain's own reason this rank fails (no call, or no value to send): said on its
    stderr, and sent as its error; the rank's exit code."""
    error["message"] = message
    print(f"dtrain: {message}", file=sys.stderr, flush=True)
    send_error(fd, token, error)
    return 1


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def main() -> int:
    out = os.dup(1)  # the result goes where stdout went at the start, whatever fn does to it
    token = os.environ.pop(TOKEN, "")
    limit = int(os.environ.pop(RESULT_LIMIT, DEFAULT_RESULT_LIMIT))
    for folder in reversed(os.environ.pop(PATHS, "").split(os.pathsep)):
        if folder and folder not in sys.path:
            sys.path.insert(1, folder)  # after the working directory, as for python -m
    try:
        fn, args, kwargs, origins = pickle.loads(take_payload(os.environ))
        name_code(fn, *origins)
    except Exception as exc:
        error = describe(exc, skip_frames=0)
        return refuse(out, token, error, f"cannot load the function: {exc} ({load_hint(exc)})")
    try:
        value = fn(*args, **kwargs)
    except Exception as exc:
        error = describe(exc)
        sys.stderr.write(error["traceback"])  # as Python shows it: the rank's log keeps it
        flush_streams()
        write_torch_error_file(error)
        send_error(out, token, error)
        return 1
    flush_streams()  # the function's last lines before its result
    return returned(out, token, value, limit)


if __name__ == "__main__":
    sys.exit(main())
