"""The project file (pure): ``dtrain.toml``, or ``[tool.dtrain]`` in ``pyproject.toml``, checked
against the options it may set, and its values laid under the command line's.

The file has a table per command (``[run]``, ``[ps]``, ``[sweep]``) and ``[defaults]`` for
every command that has the option.  A key is an option's keyword, as the Python API names
it (``np``, ``hosts``, ``env``, ``max_restarts``; ``max-restarts`` is the same key); the
edge (``cli/projectfile.py``) reads the file, describes each command's keys as ``Key``
values from its click options, and parses the values the file gives with the command's
own parser.  Here: which keys and values a file may hold (a wrong one is one line naming
the file and the line, with a did-you-mean), values of secrets refused (the file is
committed), relative paths made relative to the file's folder, and which of the file's
values a command line keeps, adds to or replaces (``settle``).

``tomllib`` gives no line numbers: ``key_line`` finds a key's line by a light scan of the
text for its table's header and ``key =`` (a key inside an inline table, or a header
spelled in an unusual way, gets its table's line, or none).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from launcher.base.errors import UsageError
from launcher.core.env import ENV_NAME, ENV_PATTERN, check_env_value, is_env_pattern
from launcher.core.options import MPI_ONLY, keywords

SECTIONS = ("defaults", "run", "ps", "sweep")  # [defaults]: every command with the option
MANUAL = "see docs/project-file.md"
# Choices for one run, not settings of a project (the table's rows not in_file): key -> flag.
NOT_IN_A_FILE = {
    key: " ".join(filter(None, (row.flag, row.metavar)))
    for key, (row, _) in {**keywords("sweep"), **keywords("run")}.items()
    if not row.in_file
}
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
# Options whose file items and command-line items both count (a user adding -x FOO on
# the command line still wants the file's PYTHONPATH): the file's first, so the command
# line's win where both set one variable.
ADDITIVE = frozenset({"exports", "env_files", "mca"})
# Options that mean one choice between them: one given on the command line replaces the
# file's others (-H on the command line: not also the file's hostfile).
RIVALS: tuple[frozenset[str], ...] = (
    frozenset({"host_lists", "hostfile", "host_discovery_script", "standalone"}),
    frozenset({"np", "nproc_per_node"}),
    frozenset({"python", "no_python"}),
    frozenset({"module", "no_python"}),
    frozenset({"gpus_per_rank", "gpu_binding"}),
)
REPLACES = {"rdzv_endpoint": frozenset({"master_addr", "master_port"})}  # torchrun's spelling

Kind = Literal["flag", "int", "seconds", "share", "text", "choice", "pairs", "env"]
PathKind = Literal["file", "program"]  # program: a path when it has a '/', else a command


@dataclass(frozen=True)
class Key:
    """One key a command's table may hold: the keyword of one of its options."""

    name: str  # as the file and the API spell it: np, hosts, env, no_color
    field: str  # the option it sets (np, host_lists, exports, color)
    kind: Kind
    multiple: bool = False  # one value, or a list of them
    choices: tuple[str, ...] = ()
    path: PathKind | None = None


@dataclass(frozen=True)
class Source:
    """A project file as read: where it is, its text, and dtrain's table in it."""

    path: str  # as messages show it (relative to the working directory)
    folder: str  # absolute: the file's relative paths are relative to it
    text: str
    table: Mapping[str, Any]  # the whole dtrain.toml, or pyproject.toml's [tool.dtrain]
    prefix: tuple[str, ...] = ()  # where that table is in the file
    shadowed: str | None = None  # a pyproject.toml beside it whose [tool.dtrain] is ignored

    def header(self, section: str) -> str:
        return "[" + ".".join((*self.prefix, section)) + "]"

    def where(self, section: str, key: str | None = None) -> str:
        """``dtrain.toml:3`` (the key's line, else its table's), or the file alone."""
        path = (*self.prefix, section)
        line = key_line(self.text, (*path, key)) if key is not None else None
        line = line or key_line(self.text, path)
        return f"{self.path}:{line}" if line else self.path


@dataclass(frozen=True)
class Setting:
    """One value the file gives: its key, the value (paths made absolute), where it is."""

    key: Key
    value: Any
    written: Any  # as the file has it
    section: str
    where: str  # dtrain.toml:3
    table: str = ""  # its table as the file names it: [run], [tool.dtrain.run]


@dataclass(frozen=True)
class Applied:
    """What became of one of the file's values in this command's options."""

    setting: Setting
    how: Literal["set", "added", "replaced", "unused"]
    by: str | None = None  # the option of the command line that replaced it


def check_file(source: Source, keys: Mapping[str, Mapping[str, Key]]) -> dict[str, list[Setting]]:
    """Every table of the file checked against ``keys`` (command -> its keys by name), so a
    mistake in ``[sweep]`` is said by ``dtrain run`` too: the settings of each table."""
    checked: dict[str, list[Setting]] = {}
    for section, body in source.table.items():
        if section not in SECTIONS:
            raise unknown_section(source, section, body)
        if not isinstance(body, Mapping):
            raise UsageError(
                f"{source.where(section)}: {source.header(section)[1:-1]} is not a table",
                f"write it as a table: {source.header(section)}, then one key = value a line",
            )
        check_unique(source, section, list(body))
        checked[section] = [
            check_key(source, section, raw, value, keys) for raw, value in body.items()
        ]
    return checked


def unknown_section(source: Source, section: str, body: object) -> UsageError:
    where = source.where(section)
    if not isinstance(body, Mapping):  # np = 8 above every [table]
        return UsageError(
            f"{where}: {section} is outside the tables of commands",
            f"put it under [run] (or [ps], [sweep]), or [defaults] for every command; {MANUAL}",
        )
    import difflib  # (only for a mistake)

    guess = difflib.get_close_matches(section, SECTIONS, n=1)
    tables = ", ".join(f"[{name}]" for name in SECTIONS)
    hint = f"did you mean {source.header(guess[0])}?" if guess else f"the tables are {tables}"
    return UsageError(f"{where}: no table {source.header(section)} in a project file", hint)


def check_unique(source: Source, section: str, names: Sequence[str]) -> None:
    seen: dict[str, str] = {}
    for raw in names:
        name = raw.replace("-", "_")
        if name in seen:
            raise UsageError(
                f"{source.where(section, raw)}: {source.header(section)} has both "
                f"{seen[name]} and {raw}",
                "keep one of them",
            )
        seen[name] = raw


def check_key(
    source: Source, section: str, raw: str, value: Any, keys: Mapping[str, Mapping[str, Key]]
) -> Setting:
    """One ``key = value`` of a table: a key of its command (of any command, in
    ``[defaults]``), a value of the key's type (as each command takes it)."""
    name = raw.replace("-", "_")
    where = source.where(section, raw)
    if name in NOT_IN_A_FILE:
        raise UsageError(
            f"{where}: {raw} is a choice for one run, not a setting of the project",
            f"give {NOT_IN_A_FILE[name]} on the command line",
        )
    commands = list(keys) if section == "defaults" else [section]
    found = [keys[command][name] for command in commands if name in keys[command]]
    if not found:
        homes = [command for command, table in keys.items() if name in table]
        if homes:
            raise UsageError(
                f"{where}: {raw} is not an option of dtrain {section}",
                "put it under " + " or ".join(source.header(home) for home in homes),
            )
        known = sorted({known for command in commands for known in keys[command]})
        import difflib  # (only for a mistake)

        guess = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {guess[0]}?" if guess else None
        what = "any command" if section == "defaults" else f"dtrain {section}"
        raise UsageError(
            f"{where}: {source.header(section)} {raw}: not an option of {what}",
            hint or "keys are the long options with _ for - (dtrain run --help); " + MANUAL,
        )
    for key in found:
        check_value(source, section, raw, value, key)
    value_given = resolved(found[0], value, source.folder)
    return Setting(found[0], value_given, value, section, where, source.header(section))


def check_value(source: Source, section: str, raw: str, value: Any, key: Key) -> None:
    problem = value_problem(value, key)
    where = source.where(section, raw)
    named = f"{where}: {source.header(section)} {raw}"
    if problem is not None:
        shown = "" if key.kind == "env" else f" = {toml_text(value)}"  # (env: perhaps a secret)
        raise UsageError(f"{named}{shown}: expected {problem}", f"write e.g. {example(key)}")
    if key.kind == "env":
        check_env_items(value, named)
        for name in secret_names(value):
            raise UsageError(
                f"{named}: {name}=... looks like a secret, and a project file is "
                "committed with the code",
                f"name it instead (env = [{json.dumps(name)}]) and set it in dtrain's "
                'environment or an env file (env_file = ".env", not committed)',
            )


SINGLE: dict[Kind, tuple[str, type | tuple[type, ...]]] = {
    "flag": ("true or false", bool),
    "int": ("a whole number", int),
    "seconds": ("a number of seconds", (int, float)),
    "share": ("a number between 0 and 1", (int, float)),
    "text": ("a string", (str, int)),  # (nnodes = 2, nproc_per_node = 4: counts as text)
    "choice": ("a string", str),
}


def value_problem(value: Any, key: Key) -> str | None:
    """What ``key`` takes, when ``value`` is not it (None: it is)."""
    if key.kind == "env":
        if is_env_value(value):
            return None
        return "a list of variables: names to copy, patterns, or NAME=value (not secrets)"
    if key.kind == "pairs":
        if isinstance(value, Mapping) and all(is_scalar(v) for v in value.values()):
            return None
        if is_list(value) and all(is_list(p) and len(p) == 2 for p in value):
            return None
        return "a table of NAME = VALUE"
    what, types = SINGLE[key.kind]
    if key.kind == "choice" and key.choices:
        what = "one of " + ", ".join(json.dumps(c) for c in key.choices)
    if key.multiple:  # (hosts = 4 is no host list)
        types = str if key.kind == "text" else types
        items = value if is_list(value) else [value]
        if all(is_a(item, types) for item in items):
            return None
        return f"{what}, or a list of them"
    return None if is_a(value, types) else what


def is_a(value: Any, types: type | tuple[type, ...]) -> bool:
    # (TOML's true is a Python bool, which is an int: not a number of ranks)
    return isinstance(value, types) and not (isinstance(value, bool) and types is not bool)


def is_list(value: Any) -> bool:
    return isinstance(value, list | tuple)


def is_scalar(value: Any) -> bool:
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def is_env_value(value: Any) -> bool:
    if isinstance(value, str):
        return True
    if isinstance(value, Mapping):
        return all(is_scalar(item) for item in value.values())
    return is_list(value) and all(isinstance(item, str) for item in value)


EXAMPLES = {"hosts": '"h1:4,h2:4"', "hostfile": '"hosts"', "env_file": '".env"'}


def example(key: Key) -> str:
    if key.name in EXAMPLES:
        return f"{key.name} = {EXAMPLES[key.name]}"
    if key.kind == "env":
        return 'env = ["PYTHONPATH", "WANDB_*", "NCCL_DEBUG=INFO"]'
    if key.kind == "pairs":
        return f'{key.name} = {{btl = "tcp,self"}}'
    value = {"flag": "true", "int": "2", "seconds": "30", "share": "0.7"}.get(key.kind)
    if value is None:
        value = json.dumps(key.choices[0]) if key.choices else '"..."'
    return f"{key.name} = [{value}, {value}]" if key.multiple else f"{key.name} = {value}"


def toml_text(value: Any, limit: int = 60) -> str:
    """A value as TOML writes it, cut to ``limit`` characters."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k} = {toml_text(v, limit)}" for k, v in value.items()) + "}"
    elif is_list(value):
        text = "[" + ", ".join(toml_text(item, limit) for item in value) + "]"
    else:
        text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def looks_secret(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def env_pairs(value: Any) -> list[tuple[str, str | None]]:
    """``env``'s items as (name or pattern, value; None: copied from dtrain's environment)."""
    if isinstance(value, Mapping):
        return [(str(name), str(item)) for name, item in value.items()]
    items = [value] if isinstance(value, str) else list(value)
    return [(name, text if sep else None) for name, sep, text in (i.partition("=") for i in items)]


def check_env_items(value: Any, named: str) -> None:
    """Each of ``env``'s names as ``-x`` checks it, without showing a value."""
    for name, text in env_pairs(value):
        pattern = is_env_pattern(name)
        if not (ENV_PATTERN if pattern else ENV_NAME).match(name):
            raise UsageError(
                f"{named}: {name!r} is not a variable name, nor a pattern of names",
                "names are letters, digits and '_'; a pattern adds * ? [...], as \"WANDB_*\"",
            )
        if pattern and text is not None:
            raise UsageError(
                f"{named}: {name}=...: a pattern copies the variables it matches from dtrain's "
                "environment; it takes no value",
                f"write {json.dumps(name)}",
            )
        if text is not None:
            check_env_value(name, text, f"{named}: {name}")


def secret_names(value: Any) -> list[str]:
    """The variables ``env`` gives a value whose name says it is a secret."""
    return [name for name, text in env_pairs(value) if text and looks_secret(name)]


def resolved(key: Key, value: Any, folder: str) -> Any:
    """Relative paths made relative to the file's folder, not to where dtrain runs."""
    if key.path is None:
        return value
    if is_list(value):
        return [resolved(key, item, folder) for item in value]
    if not isinstance(value, str) or not value or value.startswith(("/", "~")):
        return value
    if key.path == "program" and "/" not in value:  # python3: a command found on PATH
        return value
    return posixpath.normpath(posixpath.join(folder, value))


def settings_for(
    command: str, keys: Mapping[str, Key], checked: Mapping[str, Sequence[Setting]]
) -> list[Setting]:
    """The settings ``dtrain COMMAND`` takes: ``[defaults]``' (those it has an option for)
    under its own table's, which replace their rivals there too (``[run]``'s hostfile:
    not also ``[defaults]``' hosts); an additive option (``env``) takes both."""
    chosen: dict[str, list[Setting]] = {}
    for section in ("defaults", command):
        for setting in checked.get(section, ()):
            key = keys.get(setting.key.name)
            if key is None:  # ([defaults]' np: dtrain ps has no -np)
                continue
            setting = replace(setting, key=key)
            earlier = chosen.get(key.field, []) if key.field in ADDITIVE else []
            chosen[key.field] = [*earlier, setting]
            if section == command:
                for rival in rivals_of(key.field):
                    if all(s.section == "defaults" for s in chosen.get(rival, [])):
                        chosen.pop(rival, None)
    return [setting for field in chosen.values() for setting in field]


def settle(
    values: Mapping[str, Any],
    settings: Sequence[Setting],
    options: Mapping[str, Any],
    given: Collection[str],
    flags: Mapping[str, str],
    mpi: bool,
) -> tuple[dict[str, Any], list[Applied]]:
    """The command's options with the file's ``values`` (by option) laid under them: an
    option ``given`` on the command line wins (even with its default value), an additive one
    adds to the file's, one given replaces the file's rivals.  With what became of each
    setting (``flags``: an option's flag, for saying what replaced it)."""
    merged = dict(options)
    applied: list[Applied] = []
    for setting in settings:
        field = setting.key.field
        rival = next((g for g in sorted(given) if field in rivals_of(g)), None)
        if field in {row.field for row in MPI_ONLY} and not mpi:  # (used when the job is MPI)
            applied.append(Applied(setting, "unused", "--mpi"))
        elif field in given and field in ADDITIVE:
            applied.append(Applied(setting, "added", flags.get(field, field)))
        elif field in given or rival is not None:
            by = field if field in given else rival
            applied.append(Applied(setting, "replaced", flags.get(str(by), str(by))))
        else:
            applied.append(Applied(setting, "set"))
    for field, value in values.items():
        outcome = {a.how for a in applied if a.setting.key.field == field}
        if outcome == {"added"}:
            merged[field] = (*value, *options.get(field, ()))
        elif outcome == {"set"}:
            merged[field] = value
    return merged, applied


def rivals_of(field: str) -> frozenset[str]:
    """The options whose file values ``field`` given on the command line replaces."""
    found = REPLACES.get(field, frozenset())
    for group in RIVALS:
        if field in group:
            found |= group - {field}
    return found


@dataclass(frozen=True)
class Caller:
    """Who gives the options the file's are laid under, as messages name it."""

    whose: str = "the command line's"
    ignore: str = "--no-config"
    named: str = "--config"  # (the file to read instead: --config FILE, config='FILE')

    def naming(self, path: str) -> str:
        """``--config PATH``, or ``config='PATH'``."""
        return f"{self.named} {path}" if self.named.startswith("-") else f"{self.named}={path!r}"


API_CALLER = Caller("launch()'s", "no_config=True", "config")


def describe(
    source: Source, command: str, applied: Sequence[Applied], caller: Caller = Caller()
) -> list[str]:
    """``--dry-run``/``--verbose``: the file read and each value it gave, with where it is;
    values only as the file writes them (no value of the environment or an env file)."""
    tables = sorted({a.setting.section for a in applied}, key=SECTIONS.index)
    named = " and ".join(source.header(t) for t in tables) or f"nothing for dtrain {command}"
    lines = [f"dtrain: project file {source.path}: {named} ({caller.ignore} ignores it)"]
    if source.shadowed:
        lines.append(f"dtrain:   ({source.shadowed} beside it: its [tool.dtrain] is not read)")
    for item in applied:
        setting = item.setting
        shown = toml_text(setting.written)
        text = f"dtrain:   {setting.key.name} = {shown}  ({setting.where} {setting.table})"
        if item.how == "added":
            text += f", with {caller.whose} {item.by}"
        elif item.how == "replaced":
            text += f": {caller.whose} {item.by} instead"
        elif item.how == "unused":
            text += f": unused without {item.by}"
        lines.append(text)
    return lines


HEADER = re.compile(r"\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
ASSIGNMENT = re.compile(
    r"\s*((?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|\"[^\"]*\"|'[^']*'))*)\s*="
)


def key_line(text: str, path: Sequence[str]) -> int | None:
    """The line (from 1) of the key or table at ``path`` (``("run", "np")``): a table's header,
    or a ``key =`` line under the header its path begins with (dotted keys too)."""
    wanted = list(path)
    table: list[str] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if line.lstrip().startswith("[["):
            table = ["[["]  # an array of tables: no key of ours is in it
            continue
        header = HEADER.match(line)
        if header:
            table = dotted(header[1])
            if table == wanted:
                return number
            continue
        assignment = ASSIGNMENT.match(line)
        if assignment:
            full = table + dotted(assignment[1])
            if full[: len(wanted)] == wanted:
                return number
    return None


def dotted(key: str) -> list[str]:
    """``tool . "dtrain" . run`` -> ``["tool", "dtrain", "run"]``."""
    parts = re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+)", key)
    return [next(p for p in part if p) if any(part) else "" for part in parts]
