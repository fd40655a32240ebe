"""The ``wsinfer`` command's entry point: a Ctrl-C is caught from its first line.

Importing the command (argparse, asyncio and the rest) takes a tenth of a
second or more, on a slow machine several, before ``cli.main`` can catch
anything, and a Ctrl-C in that window printed Python's traceback. Nothing has
started yet then, so it only says so and exits; Python's own handler is put
back before the command runs, which catches signals as it needs to.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType


def main() -> int:
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.default_int_handler:  # not where the parent ignores it
        signal.signal(signal.SIGINT, _interrupted_while_importing)
    # serve starts its engines with SIGINT blocked (supervisor._prepare_engine): one
    # sent before now comes here, to the handler.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from wsinfer.cli import main as run

    signal.signal(signal.SIGINT, previous)
    return run()


def _interrupted_while_importing(_signum: int, _frame: FrameType | None) -> None:
    os.write(2, b"wsinfer: interrupted\n")
    os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
