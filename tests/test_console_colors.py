"""A terminal's colours found and painted without loading rich, exactly as rich would."""

from __future__ import annotations

import io
import itertools

import pytest
from rich.color import ColorSystem
from rich.console import Console
from rich.style import Style

from launcher.view.lineviews import SGR_COLORS, LineView
from launcher.view.terminal import terminal_color_system

TERMS = ["xterm-256color", "xterm", "dumb", "DUMB", "unknown", "xterm-kitty", "screen-16color", ""]
COLORTERMS = ["", "truecolor", "24bit", "TrueColor ", "yes"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("term", "colorterm"), list(itertools.product(TERMS, COLORTERMS)))
def test_the_color_system_is_the_one_rich_finds(term: str, colorterm: str) -> None:
    environ = {"TERM": term, "COLORTERM": colorterm}
    assert terminal_color_system(environ) == Console(file=Terminal(), _environ=environ).color_system


@pytest.mark.parametrize("system", ["standard", "256", "truecolor"])
def test_tags_are_painted_as_rich_paints_them(system: str) -> None:
    rich_system = {"truecolor": ColorSystem.TRUECOLOR, "256": ColorSystem.EIGHT_BIT}.get(
        system, ColorSystem.STANDARD
    )
    view = LineView(Terminal(), Terminal(), color=True, color_system=system)
    for name in [*SGR_COLORS, "dark_orange"]:  # the last one is rich's to paint
        assert view.paint("[3]", name) == Style(color=name).render("[3]", color_system=rich_system)
