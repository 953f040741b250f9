"""torchrun's error files (pure): where each rank's ``TORCHELASTIC_ERROR_FILE`` is, and what
torch's ``@record`` wrote there, read as the failure summary shows it.

A script whose main function is decorated with
``torch.distributed.elastic.multiprocessing.errors.record`` writes its uncaught exception
as JSON to the file this variable names (``{"message": {"message": "ValueError: ...",
"extraInfo": {"py_callstack": "Traceback ...", "timestamp": "..."}}}``).  dtrain gives
every rank on this machine a file of its own in the job directory, and the summary of a
failed job shows the first failed rank's exception and where it was raised, as torchrun's
root-cause report does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
ERRORS_FOLDER = "errors"  # in the job directory: rank.N.json
FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)')


@dataclass(frozen=True)
class RaisedError:
    """What a rank's error file says: the exception and where it was raised."""

    message: str  # "ValueError: bad batch" (its first line)
    raised_at: str | None = None  # "/work/train.py:12 in load": the traceback's last frame


def error_file_name(rank: int) -> str:
    """The rank's error file, relative to the job directory."""
    return f"{ERRORS_FOLDER}/rank.{rank}.json"


def parse_error_file(text: str) -> RaisedError | None:
    """torch's error file read back (None: not one, or without a message)."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, str):  # the newer format: the message itself
        return RaisedError(message.splitlines()[0]) if message.strip() else None
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    text = message["message"].strip()
    if not text:
        return None
    extra = message.get("extraInfo")
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    frames = (
        [FRAME.fullmatch(line) for line in stack.splitlines()] if isinstance(stack, str) else []
    )
    last = [frame for frame in frames if frame is not None][-1:]
    where = f"{last[0]['file']}:{last[0]['line']} in {last[0]['function']}" if last else None
    return RaisedError(text.splitlines()[0], where)
