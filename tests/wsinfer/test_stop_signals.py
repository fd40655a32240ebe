"""A stop signal reaches serve's event loop wherever it lands: before the loop
exists, while it starts, or while it waits in select."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

from wsinfer.stop_signals import StopSignals


@pytest.fixture
def signals() -> Iterator[StopSignals]:
    caught = StopSignals()
    yield caught
    caught.restore()


def test_a_signal_before_the_loop_is_not_lost(signals: StopSignals) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # runs the handler before kill returns

    async def main() -> bool:
        return signals.event().is_set()

    assert asyncio.run(main()) is True
    assert signals.received == signal.SIGINT


def send_later(sig: signal.Signals) -> None:
    time.sleep(0.05)
    os.kill(os.getpid(), sig)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_wakes_the_waiting_loop(signals: StopSignals, sig: signal.Signals) -> None:
    async def main() -> None:
        stop = signals.event()
        # From another thread: the main thread is blocked in select when it comes.
        sender = asyncio.get_running_loop().run_in_executor(None, send_later, sig)
        await asyncio.wait_for(stop.wait(), timeout=5)
        await sender

    asyncio.run(main())


def test_restore_puts_the_previous_handlers_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    StopSignals().restore()
    assert signal.getsignal(signal.SIGINT) is before
