"""``env=``, the keyword of ``-x`` in the Python API and the project file: its forms (a dict
of values, names to copy) as ``-x`` items.  The keywords themselves are the options
table's (``core/options.keywords``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from launcher.base.errors import UsageError


def env_items(value: Any) -> list[str]:
    """``env=``: a mapping of values, or names (one, or several) copied from here."""
    if isinstance(value, Mapping):
        for key, item in value.items():  # (None or True would reach the ranks as "None")
            if not isinstance(item, str | int | float) or isinstance(item, bool):
                raise UsageError(
                    f"env={{{key!r}: {item!r}}}: a variable's value is text",
                    f"write env={{{key!r}: '...'}}, or leave {key} out",
                )
        return [f"{key}={item}" for key, item in value.items()]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple | set | frozenset):
        return [str(item) for item in value]
    raise UsageError(
        f"env={value!r}: not variables",
        "give a dict (env={'NCCL_DEBUG': 'INFO'}) or names to copy (env=['WANDB_API_KEY'])",
    )
