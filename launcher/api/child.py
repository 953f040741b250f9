"""The background launcher of ``launcher.start``: ``python -m launcher.api.child LAUNCH_FILE``.

It runs the job the file describes exactly as ``launch`` runs one (``run/job.run_job``),
quietly (the job directory keeps every line), and stops it when its caller is gone
(``run/attached.watch_caller``) or on ``dtrain stop``.  Its own output (an error before the
job started, the summary) goes to the job directory's ``launcher.log``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from launcher.base.errors import LauncherError


def main(argv: Sequence[str]) -> int:
    from launcher.run.attached import watch_caller
    from launcher.run.background import take_launch_file

    watch_caller(sys.stdin.fileno())
    try:
        config = take_launch_file(argv[0])
        config = replace(config, view=replace(config.view, quiet=True))
        from launcher.run.attempt import DryRun
        from launcher.run.job import run_job
        from launcher.view.callerview import CallerFrontend
        from launcher.view.reports import format_failure

        frontend = CallerFrontend(config.view, sys.stdout, sys.stderr)
        outcome = run_job(config, dict(os.environ), frontend, checked=True)  # (by start())
        if isinstance(outcome, DryRun):
            return 0
        for line in format_failure(outcome.result):
            frontend.say(line)
        return outcome.result.exit_code
    except LauncherError as exc:
        from launcher.view.reports import format_error

        print(format_error(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
