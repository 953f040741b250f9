"""paramiko, loaded without loading invoke until it is used.

paramiko's ``config`` module imports ``invoke`` at its top, only to run the command of an
ssh config's ``Match exec`` line; invoke in turn loads asyncio, yaml and unittest.mock,
which is about a sixth of a remote launch's start-up.  Here ``invoke`` is registered as a
lazy module first: paramiko gets it, and it loads the moment ``Match exec`` calls it.
"""

from __future__ import annotations

from launcher.base.lazy import defer_import

defer_import("invoke")

import paramiko as paramiko  # noqa: E402  (after invoke is deferred; re-exported)
