"""``core/`` is pure (DESIGN.md): values in, values out, checked on its source.

A pure module takes the environment, the working directory, the clock and the host's
name as arguments.  It never reads ``os.environ``, never opens a file or a socket, never
starts a process or a thread, never reads the clock and never prints.  What counts:

* importing a module whose every use is an effect (``os``, ``sys``, ``time``, ``socket``,
  ``subprocess``, ``pathlib``, ...: ``FORBIDDEN``), in any form (``import os``,
  ``from os import environ``, ``import os.path as p``), anywhere in the module;
* from a module that is mostly pure, a name that is not (``PARTLY_PURE``): ``signal``
  gives its names (``signal.Signals``) but not ``signal.signal`` or ``signal.kill``;
  ``random`` its seeded ``Random(seed)`` only; ``posixpath`` path arithmetic, not
  ``exists`` or ``expanduser``;
* the builtins that act (``open``, ``print``, ``input``, ...), called or passed on;
* the clock by any object: ``.now()``, ``.today()``, ``.utcnow()``, and a time shown in the
  local zone (``fromtimestamp`` without a zone, ``astimezone()``: the zone is a file);
* of dtrain's ``base/``, only its modules that pass this same check themselves.

A function that takes ``environ: Mapping[str, str]`` is pure; one that reads ``os.environ``
is not.  ``EXCEPTIONS`` names what stays, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "launcher"
CORE = sorted((LAUNCHER / "core").glob("*.py"))
BASE = sorted((LAUNCHER / "base").glob("*.py"))

# Modules whose every use is an effect (or a door to one), and what they reach.
FORBIDDEN = {
    **dict.fromkeys(["os", "sys", "io", "builtins", "fileinput", "pathlib"], "files, environ"),
    **dict.fromkeys(["shutil", "tempfile", "glob", "mmap", "fcntl", "sqlite3", "shelve"], "files"),
    **dict.fromkeys(["socket", "ssl", "socketserver", "select", "selectors"], "sockets"),
    **dict.fromkeys(["http", "urllib", "ftplib", "smtplib", "webbrowser"], "the network"),
    **dict.fromkeys(["subprocess", "multiprocessing", "pty", "runpy"], "processes"),
    **dict.fromkeys(["threading", "_thread", "concurrent", "asyncio", "sched"], "threads"),
    **dict.fromkeys(["time", "uuid", "secrets"], "the clock, entropy"),
    **dict.fromkeys(["getpass", "pwd", "grp", "platform", "resource", "locale"], "the host"),
    **dict.fromkeys(["logging", "warnings", "tty", "termios", "curses"], "output"),
    **dict.fromkeys(["importlib", "gc", "atexit", "ctypes"], "the interpreter"),
}
# Mostly pure modules: the names of theirs a pure module may use.
PARTLY_PURE: dict[str, set[str] | str] = {
    "signal": "Signals and SIG* constants",  # signal.signal, kill, alarm: no
    "random": {"Random"},  # seeded by the caller (Random() without a seed reads the OS)
    "posixpath": {"join", "normpath", "basename", "dirname", "split", "splitext", "isabs"}
    | {"commonpath", "commonprefix", "sep"},  # not exists, expanduser, realpath, abspath
}
BUILTINS = {"open", "print", "input", "breakpoint", "exit", "quit", "__import__"}
CLOCK = {"now", "today", "utcnow"}  # datetime's, date's, or anyone's
LOCAL_ZONE = {"fromtimestamp": 2, "astimezone": 1}  # arguments that name a zone

# What core/ does that the check refuses, and why it stays (module, what): reason.
EXCEPTIONS = {
    ("launcher.core.synctree", "posixpath.relpath"): "synced_workdir's paths are absolute"
    " (run/syncing.py passes the request's absolute folder and workdir): relpath reads the"
    " working directory only for a relative one",
}


def allowed(module: str, name: str) -> bool:
    names = PARTLY_PURE[module]
    if isinstance(names, str):  # signal
        return name == "Signals" or name.startswith("SIG")
    return name in names


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a chain of names and attributes."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def impurities(source: str) -> list[tuple[int, str]]:
    """(line, what) for each effect ``source`` reaches; what is e.g. ``os``, ``open``,
    ``signal.kill``, ``.now()``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # a name bound by an import -> the module it is
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FORBIDDEN:
                    found.append((node.lineno, alias.name))
                aliases[alias.asname or top] = alias.name if alias.asname else top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            for alias in node.names:
                partly = node.module in PARTLY_PURE
                if top in FORBIDDEN or (partly and not allowed(node.module, alias.name)):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
                elif node.module == "random" and alias.name == "Random":
                    aliases[alias.asname or alias.name] = "random.Random"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module in PARTLY_PURE and not allowed(module, node.attr):
                found.append((node.lineno, f"{module}.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in BUILTINS:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = dotted(node.func) or ""
            resolved = aliases.get(name.split(".")[0], name.split(".")[0])
            called = ".".join([resolved, *name.split(".")[1:]])
            attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
            given = len(node.args) + len(node.keywords)
            if attr in CLOCK:
                found.append((node.lineno, f".{attr}()"))
            elif attr in LOCAL_ZONE and given < LOCAL_ZONE[attr]:
                found.append((node.lineno, f".{attr}() in the local zone"))
            elif called == "random.Random" and given == 0:
                found.append((node.lineno, "random.Random() unseeded"))
    return sorted(found)


def module_name(path: Path) -> str:
    parts = ("launcher", *path.relative_to(LAUNCHER).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PURE_BASE = {module_name(p) for p in BASE if not impurities(p.read_text())}


def dtrain_imports(source: str) -> set[str]:
    """The ``launcher.`` modules that ``source``, a module of core/, imports (relative
    imports read from core/)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            within = ["launcher", "core"][: max(0, 3 - node.level)] if node.level else []
            module = ".".join([*within, *([node.module] if node.module else [])])
            package = LAUNCHER.joinpath(*module.split(".")[1:]).is_dir()
            found.update(  # from launcher.base import clock: the module base.clock
                [f"{module}.{alias.name}" for alias in node.names] if package else [module]
            )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "launcher"}


@pytest.mark.parametrize("path", CORE, ids=[p.stem for p in CORE])
def test_core_reaches_no_effect(path: Path) -> None:
    module = module_name(path)
    kept = {what for (where, what) in EXCEPTIONS if where == module}
    wrong = [f"line {line}: {what}" for line, what in impurities(path.read_text())]
    wrong = [w for w in wrong if w.split(": ", 1)[1] not in kept]
    assert wrong == [], f"{module} (pure: take it as an argument) reaches {wrong}"


@pytest.mark.parametrize("path", CORE, ids=[p.stem for p in CORE])
def test_core_uses_only_pure_base(path: Path) -> None:
    base = {m for m in dtrain_imports(path.read_text()) if m.startswith("launcher.base")}
    assert base <= PURE_BASE, f"{module_name(path)}: {sorted(base - PURE_BASE)} have effects"


def test_exceptions_are_still_needed() -> None:
    for (module, what), reason in EXCEPTIONS.items():
        path = LAUNCHER.joinpath(*module.split(".")[1:]).with_suffix(".py")
        assert what in {w for _, w in impurities(path.read_text())}, f"{module}: {reason}"


def test_the_purity_check_sees_what_it_must() -> None:
    """The check finds each kind of effect, however it is spelled (or it is blind)."""
    source = (
        "import os\n"
        "import os.path as osp\n"
        "from os import environ\n"
        "import subprocess, socket\n"
        "from time import monotonic\n"
        "import time as t\n"
        "import signal\n"
        "import random\n"
        "import posixpath\n"
        "from datetime import datetime\n"
        "from launcher.base.errors import UsageError\n"
        "def f(environ):\n"
        "    print(environ['HOME'])\n"
        "    with open('/etc/hosts') as f:\n"
        "        pass\n"
        "    signal.kill(1, signal.SIGTERM)\n"
        "    random.random()\n"
        "    random.Random()\n"
        "    posixpath.expanduser('~')\n"
        "    datetime.now()\n"
        "    datetime.fromtimestamp(0)\n"
        "    write = print\n"
        "    __import__('os')\n"
    )
    assert [what for _, what in impurities(source)] == [
        "os",
        "os.path",
        "os.environ",
        "socket",  # (a line's finds in order of their names)
        "subprocess",
        "time.monotonic",
        "time",
        "print",
        "open",
        "signal.kill",
        "random.random",
        "random.Random() unseeded",
        "posixpath.expanduser",
        ".now()",
        ".fromtimestamp() in the local zone",
        "print",
        "__import__",
    ]
    pure = (
        "import signal\n"
        "import random\n"
        "import posixpath\n"
        "from collections.abc import Mapping\n"
        "from datetime import datetime, timezone\n"
        "def f(environ: Mapping[str, str], now: float, status: int) -> str:\n"
        "    rng = random.Random(7)\n"
        "    name = signal.Signals(-status).name if status != signal.SIGTERM else ''\n"
        "    when = datetime.fromtimestamp(now, timezone.utc).isoformat()\n"
        "    return posixpath.join(environ.get('HOME', '/'), name, when, str(rng.random()))\n"
    )
    assert impurities(pure) == []
    assert {"launcher.base.errors", "launcher.base.frozen"} <= PURE_BASE
    assert "launcher.base.clock" not in PURE_BASE  # (time, threading)
    assert "launcher.base.userfiles" not in PURE_BASE  # (os: opens files)
    imports = (
        "from launcher.base import clock\nimport launcher.base.log\nfrom ..base.jobid import j"
    )
    assert dtrain_imports(imports) == {
        "launcher.base.clock",
        "launcher.base.log",
        "launcher.base.jobid",
    }
