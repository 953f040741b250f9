"""A function's result as lines (pure): how ``launcher.launch(fn)``'s ranks send back what
``fn`` returned or raised.

Each rank runs ``remote/fnrunner.py``, which writes what ``fn`` returned (pickled) or
raised (its type, message and traceback, as JSON) to its stdout, the one channel every
transport already carries (local pipes, the SSH agents, srun), as base64 lines that begin
with ``RESULT_MARK`` and the job's token (a secret of the job's ranks: another program's
line is never taken for a result).  The job directory's recorder keeps these lines apart
from the rank's log (``results/rank.N``) and the view leaves them out; the edge reads them
back with ``read_frames``.  ``remote/fnrunner.py`` writes them (it may import nothing of
dtrain, so it has its own copy of the format; a test holds the two together).
"""

from __future__ import annotations

import binascii
from collections.abc import Iterable
from dataclasses import dataclass

RESULT_MARK = b"\x1edtrain-result "  # (an ASCII record separator: no program's usual output)
RESULTS_FOLDER = "results"  # in the job directory: rank.N, one per rank that sent a result
VALUE = "value"  # what fn returned, pickled
ERROR = "error"  # what fn raised: JSON {"type", "message", "traceback"}
KINDS = (VALUE, ERROR)
# The ranks' variables (remote/fnrunner.py has the same names).
PAYLOAD_VARIABLE = "DTRAIN_FN_PAYLOAD"  # the number of pieces; the pieces: _0, _1...
TOKEN_VARIABLE = "DTRAIN_FN_TOKEN"  # the job's: marks its result lines
PATHS_VARIABLE = "DTRAIN_FN_PATH"  # folders of the function's module, for sys.path
RESULT_LIMIT_VARIABLE = "DTRAIN_FN_RESULT_LIMIT"  # bytes a pickled return value may have
RUNNER = "launcher.remote.fnrunner"  # what every rank runs: python -m RUNNER NAME


def result_file_name(rank: int) -> str:
    """The rank's result lines, relative to the job directory."""
    return f"{RESULTS_FOLDER}/rank.{rank}"


def is_result_line(line: bytes) -> bool:
    return line.startswith(RESULT_MARK)


def may_hold_results(text: bytes) -> bool:
    """Could a line of ``text`` be a result?  (Its first byte, a record separator, is looked
    for first: one ``memchr`` over a batch where the whole mark would be a slower search.)"""
    return RESULT_MARK[:1] in text and RESULT_MARK in text


@dataclass(frozen=True)
class Sent:
    """What one rank sent back: ``kind`` (VALUE or ERROR) and its bytes."""

    kind: str
    data: bytes


def read_frames(lines: Iterable[bytes], token: str) -> Sent | None:
    """The result that ``lines`` (one rank's result lines) carry with ``token``: the last one
    whose every piece came, in order (None: none came whole)."""
    pieces: dict[str, list[bytes]] = {}
    complete: Sent | None = None
    expected = token.encode("ascii")
    for line in lines:
        fields = line[len(RESULT_MARK) :].split(b" ")
        if not is_result_line(line) or len(fields) != 4 or fields[0] != expected:
            continue
        kind, place, chunk = fields[1].decode("ascii", "replace"), fields[2], fields[3]
        index, _, count = place.partition(b"/")
        if kind not in KINDS or not index.isdigit() or not count.isdigit():
            continue
        got = pieces.setdefault(kind, [])
        if int(index) == 0:
            got.clear()
        if int(index) != len(got):
            continue  # a piece missing in between: this one cannot be placed
        got.append(chunk)
        if len(got) == int(count):
            try:
                import base64  # (here: only a job whose ranks send results loads it)

                complete = Sent(kind, base64.b64decode(b"".join(got), validate=True))
            except (binascii.Error, ValueError):
                complete = None
            got.clear()
    return complete
