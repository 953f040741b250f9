"""The project file at the edge: find it, read it, and lay its values under the command line's.

``dtrain.toml`` in the working directory or the nearest folder above it that has one, or
``pyproject.toml`` with a ``[tool.dtrain]`` table, whichever is nearer; in one folder,
``dtrain.toml`` wins (as ruff's ``ruff.toml`` wins over its ``pyproject.toml``).  The search
goes up to the file system's root, past ``$HOME`` (as git and ruff do): a ``~/dtrain.toml``
is a user's defaults for every project under home without one of its own.

A file found is used only if ``base/trust.py`` trusts it (the user's or root's, nothing above
it writable by others but sticky folders, or in a folder the user's config lists as
trusted); otherwise one line says it is ignored and why, and the search ends there.  It
also ends at a folder of another user's.  ``--config FILE`` reads the file named, whoever
owns it, but not one others may write.  Whenever the file gives the job a value, the job's
first line says so (``dtrain: settings from ../dtrain.toml (np, env)``).

Looking costs a launch three ``stat`` calls per folder above the working directory; a
``pyproject.toml`` is read only to see whether it names ``tool.dtrain``, and ``tomllib``
is imported only when there is a file to parse.  The keys are the keywords of the
command's options (``core/options.keywords``, the Python API's too), their values converted
by the options table, as a command line's are; checking them and merging is
``core/projectfile.py``'s.  The command line and ``launch()`` both call ``with_project_file``:
the one with its click context, the other with a ``Call`` that says what its keywords gave.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the rest is imported once a file is found: a launch without pays nothing)
    from collections.abc import Sequence

    from launcher.base.errors import UsageError
    from launcher.core.options import BadValue
    from launcher.core.projectfile import Caller, Key, Kind, PathKind, Setting, Source

FILE_NAME = "dtrain.toml"
PYPROJECT = "pyproject.toml"
PYPROJECT_TABLE = ("tool", "dtrain")
# A pyproject.toml is parsed only when a line of it starts dtrain's table or a key in it.
NAMES_DTRAIN = r"""^\s*((\[\s*)?tool\s*\.\s*["']?dtrain\b|["']?dtrain["']?\s*=)"""
MANUAL_HINT = "see docs/project-file.md"
PATH_METAVARS: dict[str, PathKind] = {
    "FILE": "file",
    "DIR": "file",
    "KEY": "file",
    "SCRIPT": "file",
    "PATH": "program",
}
# The project file's kind of value for a kind of the options table, where they differ.
KEY_KINDS = {"off": "flag", "toggle": "flag", "list": "text", "size": "text"}


@dataclass(frozen=True)
class Call:
    """Who gives the options the file's values go under: the command (run, ps, sweep), the
    options given (by field, whatever their value), how messages spell each, whether it is
    ``launch()`` (its keywords) and the values other launchers' spellings gave."""

    command: str
    given: frozenset[str]
    flags: Mapping[str, str]
    api: bool = False
    peers: Mapping[str, tuple[str, Any]] = field(default_factory=dict)

    @property
    def caller(self) -> Caller:
        from launcher.core.projectfile import API_CALLER, Caller

        return API_CALLER if self.api else Caller()


def command_line_call() -> Call:
    """The current click command's call: what its command line gave."""
    import click
    from click.core import ParameterSource

    from launcher.cli.dialects import PEER_VALUES

    ctx = click.get_current_context()
    peers: Mapping[str, tuple[str, Any]] = ctx.meta.get(PEER_VALUES, {})
    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name and p.opts}
    flags.update({field: spelled for field, (spelled, _) in peers.items()})
    unset = (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)  # (not given)
    given = frozenset(name for name in flags if ctx.get_parameter_source(name) not in unset)
    given |= set(peers)
    return Call(str(ctx.command.name), given, flags, peers=peers)


def with_project_file(options: dict[str, Any], call: Call | None = None) -> dict[str, Any]:
    """A command's options with the project file's values under them (``call``: who gives
    them; None: the current click command): the file ``--config`` names, else the one found
    here or above (if it is to be trusted); unchanged with ``--no-config`` or no file."""
    named = options.get("project_file")
    if options.get("no_config"):
        if named is not None:
            from launcher.base.errors import UsageError

            caller = (call or command_line_call()).caller
            raise UsageError(
                f"{caller.naming(str(named))} and {caller.ignore}: give one of them",
                f"{caller.named} reads the file it names, {caller.ignore} none",
            )
        return options
    if named is not None:
        source: Source | None = named_project_file(str(named), call)
    else:
        try:
            here = os.getcwd()
        except OSError:  # (the working directory was removed: no project around it)
            return options
        source = find_project_file(here, os.environ, call)
    if source is None:
        return options
    return apply_project_file(source, options, call or command_line_call())


def apply_project_file(source: Source, options: dict[str, Any], call: Call) -> dict[str, Any]:
    """``options`` with the file's values under them, said with --dry-run or --verbose."""
    import click

    from launcher.core.projectfile import SECTIONS, check_file, describe, settings_for, settle

    name = call.command
    keys = {section: keys_of(section) for section in SECTIONS[1:]}
    checked = check_file(source, keys)
    for other in SECTIONS[1:]:  # (its own table: converted as dtrain OTHER would)
        if other != name and checked.get(other):
            parsed_values(other, settings_for(other, keys[other], checked))
    settings = without_unset_names(settings_for(name, keys[name], checked), os.environ)
    values = parsed_values(name, settings)
    given = call.given
    mpi = options.get("mpi") if "mpi" in given else values.get("mpi", options.get("mpi"))
    mpi = bool(mpi) or call.peers.get("launcher", ("", ""))[1] == "openmpi"
    merged, applied = settle(values, settings, options, given, call.flags, mpi)
    if merged.get("dry_run") or merged.get("verbose"):
        for line in describe(source, name, applied, call.caller):
            click.echo(line, err=True)
    else:  # (the job's first line: whose settings steer it, every time)
        used = [a.setting.key.name for a in applied if a.how in ("set", "added")]
        if used:
            names = ", ".join(dict.fromkeys(used))
            click.echo(f"dtrain: settings from {source.path} ({names})", err=True)
    return merged


def without_unset_names(settings: list[Setting], environ: Mapping[str, str]) -> list[Setting]:
    """The file's ``env`` names a project may use (``PYTHONPATH``, ``WANDB_API_KEY``) need not
    be set in every shell: one that is not is left out with a note, not an error as an unset
    ``-x NAME`` typed on the command line is."""
    import click

    from launcher.core.env import is_env_pattern

    kept: list[Setting] = []
    for setting in settings:
        value = [setting.value] if isinstance(setting.value, str) else setting.value
        if setting.key.field == "exports" and isinstance(value, list | tuple):
            unset = [
                item
                for item in value
                if isinstance(item, str)
                and "=" not in item
                and not is_env_pattern(item)
                and item not in environ
            ]
            if unset:
                click.echo(
                    f"dtrain: note: {setting.where}: env {', '.join(unset)} not set here: "
                    "not passed",
                    err=True,
                )
                value = [item for item in value if item not in unset]
                if not value:
                    continue
                setting = replace(setting, value=value, written=value)
        kept.append(setting)
    return kept


def find_project_file(
    start: str, environ: Mapping[str, str], call: Call | None = None
) -> Source | None:
    """The nearest project file at or above ``start``, read (None: there is none, or the
    nearest is not to be trusted, said in one line).  The search stops at a folder of
    another user's (not root's): what is above it is not this project's."""
    from launcher.base.trust import foreign_folder

    folder = start
    while True:
        for path, prefix in candidates(folder):
            if not trusted_here(path, prefix, environ, call):
                return None
            source = read_project_file(path, prefix, start)
            if source is None:  # (a pyproject.toml without [tool.dtrain] after all)
                continue
            beside = os.path.join(folder, PYPROJECT)
            if not prefix and os.path.isfile(beside) and names_dtrain(beside):
                return replace(source, shadowed=os.path.relpath(beside, start))
            return source
        parent = os.path.dirname(folder)
        if parent == folder or foreign_folder(folder, environ) is not None:
            return None
        folder = parent


def candidates(folder: str) -> list[tuple[str, tuple[str, ...]]]:
    """A folder's project file: its ``dtrain.toml``, else its ``pyproject.toml`` if that may
    have a ``[tool.dtrain]`` table (with where dtrain's table is in it)."""
    candidate = os.path.join(folder, FILE_NAME)
    if os.path.isfile(candidate):
        return [(candidate, ())]
    candidate = os.path.join(folder, PYPROJECT)
    if os.path.isfile(candidate) and names_dtrain(candidate):
        return [(candidate, PYPROJECT_TABLE)]
    return []


def trusted_here(
    path: str, prefix: tuple[str, ...], environ: Mapping[str, str], call: Call | None = None
) -> bool:
    """Whether a project file the search found may steer the run (``base/trust.py``'s rule:
    the user's or root's, and nothing above it writable by others); if not, one line says
    it is ignored, why, and what to do."""
    import click

    from launcher.base.trust import others_may_write, trust_doubt

    doubt = trust_doubt(path, environ)
    if doubt is None:
        return True
    said = doubt.said()
    use = f"run with {(call or command_line_call()).caller.naming(path)} to use it"
    loose = others_may_write(path, environ)  # (then --config refuses it too)
    if loose is not None:
        hint = loose.fix()
        said = f"{said}, {loose.why()}" if doubt.owner is not None else loose.said()
    elif doubt.owner is not None:
        hint = use
    else:
        hint = f"{doubt.fix()}; or {use}"
    table = f"'s {'.'.join(prefix)}" if prefix else ""
    click.echo(f"dtrain: ignoring {path}{table}: {said} (hint: {hint})", err=True)
    return False


def named_project_file(given: str, call: Call | None = None) -> Source:
    """The project file ``--config`` names, read as given, whoever owns it; but not one others
    can write (its group may where the group is its owner's own, or a trusted folder's)."""
    from launcher.base.errors import UsageError
    from launcher.base.trust import others_may_write

    named = (call or command_line_call()).caller.named
    shown = f"{named} {given}"
    doubt = others_may_write(given, os.environ)
    if doubt is not None:
        raise UsageError(
            f"{shown}: {doubt.why()}: another user could change what it runs",
            f"{doubt.fix()}; or copy it to a file of your own",
        )
    prefix = PYPROJECT_TABLE if os.path.basename(given) == PYPROJECT else ()
    source = read_project_file(given, prefix, os.getcwd(), named)
    if source is None:
        raise UsageError(f"{shown}: no [tool.dtrain] table in it", MANUAL_HINT)
    return source


def names_dtrain(path: str) -> bool:
    """Whether a pyproject.toml may have a ``[tool.dtrain]`` table (without parsing it; read
    as any found file is: a regular file, with a bound, never blocking)."""
    import re

    from launcher.base.errors import UsageError
    from launcher.base.userfiles import read_user_bytes

    try:
        text = read_user_bytes(path, "project file").decode("utf-8", errors="replace")
    except UsageError:  # (unreadable, or no file after all: not a project file)
        return False
    return re.search(NAMES_DTRAIN, text, re.MULTILINE) is not None


def read_project_file(
    path: str, prefix: tuple[str, ...], here: str, named: str | None = None
) -> Source | None:
    """The file parsed; for a pyproject.toml, its ``[tool.dtrain]`` table (None when it has
    none after all: the search goes on above, as ruff's does).  ``named``: the option that
    named it (``--config``; the path is then shown as given)."""
    import sys

    from launcher.base.errors import UsageError
    from launcher.base.userfiles import read_user_text
    from launcher.core.projectfile import MANUAL, Source

    shown = path if named is not None else os.path.relpath(path, here)
    text = read_user_text(shown, named or "project file", null_ok=named is not None)
    text = text.removeprefix("\ufeff")  # (a byte-order mark some editors write: not TOML's)
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover (Python 3.10: tomli, which became tomllib)
        import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]
    try:
        table: Any = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{shown}:{toml_error(exc)}", f"fix the TOML syntax; {MANUAL}") from None
    for part in prefix:
        table = table.get(part) if isinstance(table, dict) else None
    if table is None:
        return None
    if not isinstance(table, dict):
        raise UsageError(f"{shown}: {'.'.join(prefix)} is not a table", MANUAL)
    return Source(shown, os.path.dirname(os.path.abspath(path)), text, table, prefix)


def toml_error(exc: ValueError) -> str:
    """``3:6: Invalid value`` from tomllib's 'Invalid value (at line 3, column 6)'."""
    import re

    message = str(exc)
    found = re.search(r"\s*\(at line (\d+), column (\d+)\)", message)
    if found is None:
        return f" {message}"
    return f"{found[1]}:{found[2]}: {message[: found.start()] + message[found.end() :]}"


def keys_of(command: str) -> dict[str, Key]:
    """A command's keys: its options' keywords, each with the kind of value it takes."""
    from launcher.core.options import keywords
    from launcher.core.projectfile import Key

    keys: dict[str, Key] = {}
    for name, (row, _) in keywords(command).items():
        kind: Kind = "env" if name == "env" else KEY_KINDS.get(row.kind, row.kind)  # type: ignore[assignment]
        path = PATH_METAVARS.get(str(row.metavar)) if kind == "text" else None
        multiple = row.kind in ("list", "pairs")
        keys[name] = Key(name, row.field, kind, multiple, row.choices, path)
    return keys


def parsed_values(command: str, settings: Sequence[Setting]) -> dict[str, Any]:
    """The settings' values as the options table converts the same options given on a
    command line (their kinds, bounds and choices): option -> value."""
    from launcher.core.options import BadValue, convert, keywords

    spelled = keywords(command)
    values: dict[str, Any] = {}
    for setting in settings:
        name = setting.key.name
        row, negative = spelled[name]
        try:
            value = convert(row, setting.value)
        except BadValue as bad:
            raise bad_setting(setting, bad) from None
        values[setting.key.field] = not value if negative else value
    return values


def bad_setting(setting: Setting, bad: BadValue) -> UsageError:
    """A file's value the options table refuses: where, the key as written, and the hint."""
    from launcher.base.errors import UsageError
    from launcher.core.projectfile import toml_text

    name, written = setting.key.name, toml_text(setting.written)
    return UsageError(
        f"{setting.where}: {setting.table} {name} = {written}: {bad.problem}",
        bad.said(lambda example: f"{name} = {toml_text(example)}"),
    )
