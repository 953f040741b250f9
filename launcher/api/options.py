"""``launch``'s keyword options -> ``dtrain run``'s own parser -> the one frozen ``JobConfig``.

An option is named by its long flag with ``_`` for ``-`` (``--max-restarts`` ->
``max_restarts=2``, ``-np`` -> ``np``, ``--no-collapse`` -> ``no_collapse=True`` or
``collapse=False``), ``hosts`` is ``-H`` and ``env`` is ``-x``.  The options become the
arguments ``dtrain run`` would have had, parsed by its click command without running it
and turned into the config by ``cli.main.run_config``: the checks, the dialect rules and
the errors are the command line's, raised as ``UsageError`` before anything starts.  The
arguments never reach a process's command line (the payload's variables are among them).
The keyword table is ``cli/keywords.py``'s, the project file's keys too: a ``dtrain.toml``
above the caller's working directory gives its values under the keywords (as under a
command line), and ``no_config=True`` (``--no-config``) ignores it.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import click

from launcher.base.errors import UsageError
from launcher.cli.keywords import Flag, option_arguments
from launcher.cli.keywords import option_flags as keyword_flags
from launcher.cli.projectfile import API_CALL, GROUP
from launcher.core.config import JobConfig

# Options the API sets itself, with what to do instead.
NOT_FOR_A_FUNCTION = {
    "module": "the function is what the ranks run",
    "no_python": "the function runs in Python",
    "detach": "use launcher.start(fn, ...), which returns a handle at once",
}
HINT = "options are dtrain run's, named by the long flag with _ for - (see: dtrain run --help)"


def option_flags(command: click.Command) -> dict[str, Flag]:
    """Every keyword ``command``'s visible options take, by name, but those the API sets."""
    flags = keyword_flags(command)
    for name in NOT_FOR_A_FUNCTION:
        flags.pop(name, None)
    return flags


def unknown_option(name: str, known: Sequence[str]) -> UsageError:
    if name in NOT_FOR_A_FUNCTION:
        return UsageError(f"{name}= is not an option of launch()", NOT_FOR_A_FUNCTION[name])
    guess = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {guess[0]}=?" if guess else HINT
    return UsageError(f"no such option {name}=", hint)


def run_arguments(options: Mapping[str, Any], command: click.Command) -> list[str]:
    """The keyword options as ``dtrain run``'s arguments (None: not given)."""
    flags = option_flags(command)
    args: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if name not in flags:
            raise unknown_option(name, sorted(flags))
        args += option_arguments(name, value, flags[name])
    return args


def given_options(options: Mapping[str, Any], command: click.Command) -> frozenset[str]:
    """The options (by name) the keywords given set, whatever their value."""
    flags = option_flags(command)
    return frozenset(
        str(flags[name].param.name)
        for name, value in options.items()
        if value is not None and name in flags
    )


def build_config(
    options: Mapping[str, Any], program: Sequence[str], payload: Sequence[str] = ()
) -> JobConfig:
    """The job's config, exactly as ``dtrain run OPTIONS -m -- PROGRAM`` makes it; ``payload``:
    ``NAME=VALUE`` variables every rank gets (as ``-x``), after the user's."""
    from launcher.cli.main import cli, run, run_config

    args = run_arguments(options, run)
    args += [arg for item in payload for arg in ("-x", item)]
    try:
        context = run.make_context("run", [*args, "--module", "--", *program], obj=args)
        # The project file's values go under every keyword given, quiet=False too (a flag
        # without a --no- form has no argument for False): its messages name keywords.
        context.meta[API_CALL] = given_options(options, run)
        context.meta[GROUP] = cli  # (the project file's other tables are its commands')
        with context:
            return run_config(dict(context.params))
    except click.ClickException as exc:
        message = exc.format_message().replace("\n", " ")
        raise UsageError(message, HINT) from None
