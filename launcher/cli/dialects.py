"""Other launchers' spellings at the edge: ``core/peerflags.PEER_FLAGS`` as hidden click
options of ``dtrain run``, each remembering its value (``PEER_VALUES``) for the command to
merge with dtrain's own, or refusing with what to do instead; and the typo suggestions for
an unknown flag (only a typo of a flag of the same meaning).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click

from launcher.base.errors import UsageError
from launcher.cli.options import Decorator, click_type, stacked
from launcher.core.options import Kind, Option, options_of
from launcher.core.peerflags import PEER_FLAGS, PeerFlag

PEER_VALUES = "dtrain.peer_values"  # ctx.meta key: {field: (flag as the user spelled it, value)}


def peer_options() -> Decorator:
    """Every row of the table as a hidden click option of ``dtrain run``."""
    own = {row.field: row for row in options_of("run")}  # (dtrain's options, by field)
    return stacked(*(peer_option(row, own) for row in PEER_FLAGS))


def peer_option(row: PeerFlag, own: Mapping[str, Option]) -> Decorator:
    flags = row.flags.split()
    settings: dict[str, Any] = {"hidden": True, "expose_value": False, "metavar": "VALUE"}
    if row.kind == "flag":
        settings["is_flag"] = True
    else:
        settings["type"] = peer_type(row, flags[0], own.get(row.field or ""))
        settings["multiple"] = row.kind == "list"
    name = "peer_" + flags[0].lstrip("-").replace("-", "_")
    return click.option(*flags, name, callback=remember(row), **settings)


def peer_type(row: PeerFlag, flag: str, own: Option | None) -> Any:
    """A peer flag's value type: checked as dtrain's own option of its field (``own``) is
    (its bounds too), named as the peer's flag (``-n x: not a whole number``)."""
    if row.kind not in ("int", "float"):
        return str
    kind: Kind = "int" if row.kind == "int" else "seconds"
    base = own if own is not None and own.kind == kind else Option(flag, kind, low=0)
    return click_type(base._replace(decl=flag))


def remember(row: PeerFlag) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or value is False or value == ():
            return
        spelled = used_spelling(ctx, param)
        if row.kind == "text" and "args" not in row.flags and is_option(ctx, value):
            # ``--tee -np 2 train.py``: the flag took the next option as its value
            raise UsageError(
                f"{spelled} takes a value, not the option {value}",
                f"write e.g. {spelled} {row.example}" if row.example else None,
            )
        if row.refused is not None:
            raise UsageError(f"{spelled} ({row.peer}) has no dtrain equivalent", row.refused)
        if row.field is not None:
            given = row.value if row.kind == "flag" and row.value is not None else value
            ctx.meta.setdefault(PEER_VALUES, {})[row.field] = (spelled, given)

    return callback


def is_option(ctx: click.Context, value: object) -> bool:
    """Whether ``value`` is one of the command's options (as typed, before an ``=``)."""
    return isinstance(value, str) and any(
        value.split("=", 1)[0] in getattr(param, "opts", ()) for param in ctx.command.params
    )


def used_spelling(ctx: click.Context, param: click.Parameter) -> str:
    """The flag as typed (one of ``param.opts``; the edge passes the command line as
    ``obj``), for messages."""
    argv = ctx.obj if isinstance(ctx.obj, list) else []
    typed = {str(arg).split("=", 1)[0] for arg in argv}
    return next((opt for opt in param.opts if opt in typed), param.opts[0])


def suggestion(typed: str, command: click.Command) -> str | None:
    """A flag of ``command`` that ``typed`` misspells, only when the difference is a typo
    (``--gpus-per-rnk``), never another word (``--tee`` is not ``--tf``)."""
    refused = {flag for row in PEER_FLAGS if row.refused for flag in row.flags.split()}
    known = [
        opt
        for param in command.params
        for opt in [*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())]
        if opt.startswith("-") and opt not in refused
    ]
    bare: dict[str, list[str]] = {}
    for opt in known:
        bare.setdefault(normalized(opt), []).append(opt)
    import difflib

    found = difflib.get_close_matches(normalized(typed), list(bare), n=1, cutoff=0.85)
    if not found or len(normalized(typed)) < 4:
        return None
    # of one flag's spellings (--hostfile, -hostfile), the one written as the user writes
    return max(bare[found[0]], key=lambda opt: difflib.SequenceMatcher(None, typed, opt).ratio())


def normalized(flag: str) -> str:
    return flag.lstrip("-").lower().replace("_", "-")
