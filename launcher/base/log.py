"""dtrain's own log (``--verbose``) and its phase line, without loading ``logging`` for a
job that shows neither (4 ms of a short job's start).

``Log`` stands for ``logging.getLogger(name)``.  Debug and info records go to ``logging``
only once something has loaded it: before that no handler can exist, so nothing could show
them (``--verbose`` loads it and sets its handler).  Warnings and errors always go, as
``logging`` would print them without any handler.  The phase line on a terminal
(``TerminalFrontend.show_phases``) is a ``sink`` on ``PHASES``: a plain callable.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import logging


class Log:
    """A named logger, loaded when a record could be shown."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sink: Callable[[str], None] | None = None  # sees info records, if set

    def logger(self) -> logging.Logger:
        import logging

        return logging.getLogger(self.name)

    def debug(self, message: str, *args: object) -> None:
        if "logging" in sys.modules:  # else no handler was ever set: nothing would show it
            self.logger().debug(message, *args)

    def info(self, message: str, *args: object) -> None:
        if self.sink is not None:
            self.sink(message % args if args else message)
        elif "logging" in sys.modules:
            self.logger().info(message, *args)

    def warning(self, message: str, *args: object) -> None:
        self.logger().warning(message, *args)

    def exception(self, message: str, *args: object) -> None:
        self.logger().exception(message, *args)


LOG = Log("dtrain")  # --verbose shows it
PHASES = Log("dtrain.phase")  # what the survey is at: the terminal's phase line
