"""The house's layers (DESIGN.md), checked on the source: no module imports one above it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAUNCHER = Path(__file__).resolve().parent.parent / "launcher"
# Lowest first; a module may import its own layer and those below it.
LAYERS = [
    ("base", {"errors", "codecache", "lazy", "log"}),
    (
        "pure",
        {
            "config",
            "jobid",
            "hostlist",
            "hosts",
            "plan",
            "env",
            "command",
            "policy",
            "outcome",
            "specs",
            "stacks",
            "collapse",
            "export",
            "sweep",
        },
    ),
    ("remote", {"remote", "remote.agent", "remote.watchdog", "remote.probe", "remote.tf_server"}),
    (
        "effects",
        {
            "transport",
            "transport.base",
            "transport.local",
            "transport.ssh",
            "transport.slurm",
            "transport.feeds",
            "transport.localagent",
            "transport.sshlib",
            "mpi",
        },
    ),
    ("streams", {"logs", "jobs", "outlets"}),
    ("loop", {"clock", "rankrun", "supervisor"}),
    ("job", {"job", "survey", "background", "control", "sweeprun"}),
    ("view", {"console", "topview", "sweepview"}),
    ("edge", {"cli", "options", "dialects", "__main__", ""}),
]
LEVEL = {name: level for level, (_, names) in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = path.relative_to(LAUNCHER).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The launcher modules that ``path`` imports, at the top or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "launcher":
                found.update(alias.name for alias in node.names)
            elif node.module.startswith("launcher."):
                found.add(node.module.removeprefix("launcher."))
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("launcher.")
                for a in node.names
                if a.name.startswith("launcher.")
            )
    return found


MODULES = sorted(LAUNCHER.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[module_name(p) or "launcher" for p in MODULES])
def test_no_module_imports_a_layer_above_it(path: Path) -> None:
    name = module_name(path)
    assert name in LEVEL, f"{name}: not placed in a layer (add it to LAYERS and DESIGN.md)"
    above = {m for m in imported(path) if LEVEL[m] > LEVEL[name]}
    assert not above, f"{name} ({LAYERS[LEVEL[name]][0]}) imports {sorted(above)} from above"
    if name.startswith("remote"):  # shipped as text: nothing of dtrain may come along
        assert imported(path) == set(), f"{name} imports dtrain modules"


def test_functions_stay_short() -> None:
    long = [
        f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for path in MODULES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []
