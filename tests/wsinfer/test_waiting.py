"""wait_set: a bounded wait on an event that never loses a cancel."""

from __future__ import annotations

import asyncio

from wsinfer.waiting import wait_set


async def test_it_says_whether_the_event_was_set_in_time() -> None:
    event = asyncio.Event()
    assert not await wait_set(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_set(event, 5)
    assert await wait_set(event, 0)  # already set: no wait at all


async def test_a_cancel_that_lands_as_the_event_is_set_is_never_lost() -> None:
    """The window asyncio.wait_for (3.10, 3.11) drops a cancel in: the event is set,
    its waiter has finished, and the waiting task has not run yet."""
    lost = 0
    for _ in range(500):
        event = asyncio.Event()

        async def follow(event: asyncio.Event) -> None:
            while True:  # like a response loop that waits for its next delta
                await wait_set(event, 5)
                event.clear()

        task = asyncio.ensure_future(follow(event))
        for _ in range(2):
            await asyncio.sleep(0)
        event.set()
        await asyncio.sleep(0)  # the inner waiter finishes in this step
        task.cancel()
        await asyncio.sleep(0.001)
        if not task.done():
            lost += 1
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert lost == 0


async def test_a_cancel_while_waiting_leaves_no_waiter_behind() -> None:
    event = asyncio.Event()
    task = asyncio.ensure_future(wait_set(event, 5))
    await asyncio.sleep(0)
    before = len(asyncio.all_tasks())
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert task.cancelled() and len(asyncio.all_tasks()) == before - 2
