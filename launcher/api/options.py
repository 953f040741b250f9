"""``launch``'s keyword options -> the options table -> the one frozen ``JobConfig``.

An option is named by its long flag with ``_`` for ``-`` (``--max-restarts`` ->
``max_restarts=2``, ``-np`` -> ``np``, ``--no-collapse`` -> ``no_collapse=True`` or
``collapse=False``), ``hosts`` is ``-H`` and ``env`` is ``-x`` (``core/options.keywords``,
the project file's keys too).  Each value is converted and checked by the options table,
as ``dtrain run``'s command line is (the same problem and hint, named by its keyword), the
project file's values go under them (a ``dtrain.toml`` above the caller's working
directory, as under a command line; ``no_config=True`` ignores it), and the options make
the config as ``dtrain run``'s do (``core/optionvalues.run_options_config``): no click.
The values never reach a process's command line (the payload's variables are among them).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Any

from launcher.base.errors import UsageError
from launcher.core.config import JobConfig
from launcher.core.options import Option, defaults, keywords, parse

# Options the API sets itself, with what to do instead.
NOT_FOR_A_FUNCTION = {
    "module": "the function is what the ranks run",
    "no_python": "the function runs in Python",
    "detach": "use launcher.start(fn, ...), which returns a handle at once",
}
HINT = "options are dtrain run's, named by the long flag with _ for - (see: dtrain run --help)"


def api_keywords() -> dict[str, tuple[Option, bool]]:
    """Every keyword ``launch()`` takes (``dtrain run``'s, but those the API sets)."""
    spelled = keywords("run")
    for name in NOT_FOR_A_FUNCTION:
        spelled.pop(name, None)
    return spelled


def unknown_option(name: str, known: Sequence[str]) -> UsageError:
    if name in NOT_FOR_A_FUNCTION:
        return UsageError(f"{name}= is not an option of launch()", NOT_FOR_A_FUNCTION[name])
    guess = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {guess[0]}=?" if guess else HINT
    return UsageError(f"no such option {name}=", hint)


def keyword_values(
    options: Mapping[str, Any], spelled: Mapping[str, tuple[Option, bool]] | None = None
) -> tuple[dict[str, Any], set[str]]:
    """The keywords given (None: not given) as option values by field, and those fields
    (``spelled``: ``api_keywords()``, if the caller has it)."""
    spelled = api_keywords() if spelled is None else spelled
    values: dict[str, Any] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name not in spelled:
            raise unknown_option(name, sorted(spelled))
        row, negative = spelled[name]
        if isinstance(value, os.PathLike):  # (hostfile=Path(...), env_file=[Path(...)])
            value = os.fspath(value)
        elif isinstance(value, list | tuple):
            value = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in value]
        parsed = parse(row, value, name)
        values[row.field] = not parsed if negative else parsed
    return values, set(values)


def build_config(
    options: Mapping[str, Any], program: Sequence[str], payload: Sequence[str] = ()
) -> JobConfig:
    """The job's config, exactly as ``dtrain run OPTIONS -m -- PROGRAM`` makes it; ``payload``:
    ``NAME=VALUE`` variables every rank gets (as ``-x``), after the user's."""
    from launcher.cli.projectfile import Call, with_project_file
    from launcher.core.optionvalues import run_options_config

    spelled = api_keywords()
    given, fields = keyword_values(options, spelled)
    values = {**defaults("run"), **given, "module": True, "command": tuple(program)}
    if payload:  # (given as -x would give them: the file's env is added, not instead)
        values["exports"] = (*values["exports"], *payload)
        fields.add("exports")
    # (the project file's messages name the keywords: launch(np=2) is what the caller wrote)
    flags = {row.field: f"{name}=" for name, (row, _) in spelled.items()}
    call = Call("run", frozenset(fields), flags, api=True)
    return run_options_config(with_project_file(values, call))
