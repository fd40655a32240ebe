"""wait_set and within: bounded waits that never lose a cancel (or an item)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from wsinfer.waiting import wait_set, within


async def test_it_says_whether_the_event_was_set_in_time() -> None:
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5)
    assert await wait_set(event, 0)  # already set: no wait at all


async def test_a_cancel_that_lands_as_the_event_is_set_is_never_lost() -> None:
    """The window asyncio.wait_for (3.10, 3.11) drops a cancel in: the event is set,
    its waiter has finished, and the waiting task has not run yet."""

    def start() -> tuple[Coroutine[Any, Any, None], Callable[[], None]]:
        event = asyncio.Event()

        async def follow() -> None:
            while True:  # like a response loop that waits for its next delta
                await wait_set(event, 5)
                event.clear()

        return follow(), event.set

    assert await lost_cancels(start, settle_steps=2) == 0


async def lost_cancels(
    start: Callable[[], tuple[Coroutine[Any, Any, None], Callable[[], None]]],
    settle_steps: int,
    rounds: int = 500,
) -> int:
    """How many of ``rounds`` cancels are lost that land in the step after a waiting
    loop's awaited result comes: ``start`` gives the loop and what wakes it."""
    lost = 0
    for _ in range(rounds):
        follow, wake = start()
        task = asyncio.ensure_future(follow)
        for _ in range(settle_steps):  # until the loop waits
            await asyncio.sleep(0)
        wake()
        await asyncio.sleep(0)  # the inner waiter finishes in this step
        task.cancel()
        await asyncio.sleep(0.001)
        if not task.done():
            lost += 1
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return lost


async def test_a_cancel_while_waiting_leaves_no_waiter_behind() -> None:
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_set(event, 5))
    await asyncio.sleep(0)
    before = len(asyncio.all_tasks())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert task.cancelled() and len(asyncio.all_tasks()) == before - 2


async def test_within_gives_the_result_or_a_timeout_that_cancels_the_awaitable() -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    asyncio.get_running_loop().call_later(0.01, queue.put_nowait, 7)
    assert await within(queue.get(), 5) == 7
    before = len(asyncio.all_tasks())
    with pytest.raises(TimeoutError):
        await within(queue.get(), 0.01)
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before  # the get was cancelled, not left waiting
    queue.put_nowait(8)
    assert await within(queue.get(), 0) == 8  # an item already there: no time needed


async def test_within_never_loses_a_cancel_that_lands_as_an_item_arrives() -> None:
    """The window asyncio.wait_for (3.10, 3.11) drops a cancel in, for a queue: CI
    saw a stream of n choices go on after its client hung up."""

    def start() -> tuple[Coroutine[Any, Any, None], Callable[[], None]]:
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def follow() -> None:
            while True:  # like the n-choices response loop
                await within(queue.get(), 5)

        return follow(), lambda: queue.put_nowait(1)

    assert await lost_cancels(start, settle_steps=3) == 0


async def test_within_keeps_an_item_that_comes_as_the_time_runs_out() -> None:
    kept = 0
    for _ in range(200):
        queue: asyncio.Queue[int] = asyncio.Queue()
        asyncio.get_running_loop().call_later(0.002, queue.put_nowait, 1)
        try:
            await within(queue.get(), 0.002)
            kept += 1
        except TimeoutError:
            await asyncio.sleep(0.005)
            kept += queue.qsize()  # not taken: still there for the next get
    assert kept == 200


def test_no_source_file_waits_with_asyncio_wait_for() -> None:
    root = Path(__file__).resolve().parents[2]
    users = [
        str(path.relative_to(root))
        for package in ("wsinfer", "engine", "sessions", "clients")
        for path in sorted((root / package).rglob("*.py"))
        if "asyncio.wait_for(" in path.read_text(encoding="utf-8")
    ]
    assert users == [], "use wsinfer.waiting.within: wait_for loses cancels on 3.10/3.11"
