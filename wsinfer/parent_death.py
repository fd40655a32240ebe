"""The signal the kernel sends a process when its parent dies (Linux's prctl).

Set in a child before it runs (``preexec_fn``) it survives ``exec``, so even a
``kill -9`` of ``wsinfer serve`` leaves no child behind. Elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: signal.Signals) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
