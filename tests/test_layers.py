"""The house's layers (DESIGN.md), checked on the source.

A module's layer is its folder under ``launcher/``; each layer may import itself and
the layers DESIGN.md's table names for it, and nothing else of dtrain.  Imports are
read wherever they stand (top of the module, inside functions, under TYPE_CHECKING),
absolute and relative alike.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "launcher"

# DESIGN.md's "may import" column, layer by layer (base is open to all but remote).
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "core": {"base"},
    "remote": set(),  # shipped to hosts as text: nothing of dtrain, not even base
    "transport": {"remote", "core", "base"},
    "streams": {"core", "base"},
    "loop": {"transport", "streams", "core", "base"},
    "run": {"loop", "transport", "streams", "remote", "core", "base"},
    "view": {"streams", "core", "base"},
    # The edge reaches transports and payloads only through the job layer (run/).
    "cli": {"view", "run", "loop", "streams", "core", "base"},
    # The Python API, a second edge: the same config through cli's parser, the same job layer.
    "api": {"cli", "view", "run", "loop", "streams", "core", "base"},
    "": {"api", "cli", "base"},  # launcher/__init__.py (the API's names, lazily) and __main__.py
}
# base modules with effects (threads, signals to pids): not for the pure core.
EFFECTFUL_BASE = {"launcher.base.parallel", "launcher.base.pids"}
MAX_LINES = 600
MAX_EDGE_LINES = 450
MAX_FUNCTION_LINES = 80


def dotted_name(path: Path) -> str:
    parts = ("launcher", *path.relative_to(LAUNCHER).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """``launcher.core.plan`` -> ``core``; ``launcher`` or ``launcher.__main__`` -> ``""``."""
    parts = module.split(".")
    assert parts[0] == "launcher", module
    if len(parts) == 1 or parts[1] == "__main__":
        return ""
    if (LAUNCHER / parts[1]).is_dir():
        return parts[1]
    return "?" + parts[1]  # a module that sits flat in launcher/: in no layer


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module named by a (possibly relative) ``from ... import``."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imported(path: Path) -> set[str]:
    """The dtrain modules that ``path`` imports, anywhere in it."""
    return imported_by(path.read_text(), dotted_name(path), path.name == "__init__.py")


def imported_by(source: str, module: str, is_package: bool) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            source = resolve(node, module, is_package)
            if source.split(".")[0] != "launcher":
                continue
            folder = LAUNCHER.joinpath(*source.split(".")[1:])
            if folder.is_dir():  # from launcher.core import plan: the names are its modules
                found.update(f"{source}.{alias.name}" for alias in node.names)
            else:
                found.add(source)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "launcher")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("launcher")
        ):
            found.add(str(node.args[0].value))
    return found


MODULES = sorted(LAUNCHER.rglob("*.py"))
IDS = [dotted_name(p) for p in MODULES]


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_a_module_imports_only_what_its_folder_may(path: Path) -> None:
    module = dotted_name(path)
    layer = layer_of(module)
    assert layer in MAY_IMPORT, f"{module}: not in a layer's folder (see DESIGN.md)"
    allowed = MAY_IMPORT[layer] | {layer}
    wrong = sorted(m for m in imported(path) if layer_of(m) not in allowed)
    assert not wrong, f"{module} ({layer or 'top'}) may not import {wrong}"
    if layer == "remote":  # shipped as text: nothing of dtrain may come along
        assert imported(path) == set(), f"{module} imports dtrain modules"
    if layer == "core":  # pure: values in, values out
        effects = sorted(imported(path) & EFFECTFUL_BASE)
        assert not effects, f"{module} (pure) may not import {effects}"


def test_every_folder_is_a_layer() -> None:
    folders = {p.name for p in LAUNCHER.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(MAY_IMPORT) - {""}
    flat = {p.name for p in LAUNCHER.glob("*.py")}
    assert flat == {"__init__.py", "__main__.py"}


def test_the_checker_sees_what_it_must() -> None:
    """The reader above finds relative, nested and package imports (or the test is blind)."""
    source = (
        "from . import plan\n"
        "from ..transport import ssh\n"
        "def f():\n"
        "    from launcher import view\n"
        "    import launcher.loop.supervisor\n"
        "    importlib.import_module('launcher.run.job')\n"
    )
    assert imported_by(source, "launcher.core.probe", is_package=False) == {
        "launcher.core.plan",
        "launcher.transport.ssh",
        "launcher.view",
        "launcher.loop.supervisor",
        "launcher.run.job",
    }
    assert imported_by("from .plan import Plan", "launcher.core", is_package=True) == {
        "launcher.core.plan"
    }


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    limit = MAX_EDGE_LINES if layer_of(dotted_name(path)) in ("cli", "api") else MAX_LINES
    assert lines <= limit, f"{dotted_name(path)}: {lines} lines (at most {limit})"


def test_functions_stay_short() -> None:
    long = [
        f"{dotted_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for path in MODULES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []
