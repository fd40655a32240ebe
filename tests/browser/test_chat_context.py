"""A conversation that outgrows the model's context, in headless Chromium against a
real ``wsinfer serve`` whose context is 256 tokens (the tiny model): the engine
ends the turn with a ``done`` whose error is ``too_large``; the page says so,
leaves the oldest exchange out of the prompt (kept in the conversation, marked)
and asks again in a new session, which answers. At 390 and 1280 px."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.stack import start_serve, stop_serve

from .conftest import RunningServer
from .helpers import LAST_ANSWER, ask, screenshot, settled

CONTEXT = 256
# About 120 tokens: one question fits the context, two with an answer do not.
QUESTION = "The quick brown fox jumps over the lazy dog. " * 12


@pytest.fixture(scope="module")
def small_context_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: str
) -> Iterator[RunningServer]:
    state = tmp_path_factory.mktemp("small-context-serve")
    process, port = start_serve(state, "--model", tiny_model, "--max-model-len", str(CONTEXT))
    yield RunningServer(port, process)
    assert stop_serve(process) == 0


async def answered(page: Any, n: int) -> None:
    """``settled``, with room for this module's own server to answer on a busy machine."""
    await settled(page, n, timeout_ms=300_000)


async def marks(page: Any) -> list[bool]:
    """Per message shown: whether it is marked as left out of the prompt."""
    return list(
        await page.locator("li.msg").evaluate_all(
            "els => els.map((e) => e.classList.contains('left-out'))"
        )
    )


@pytest.mark.parametrize("width,height", [(390, 844), (1280, 800)])
async def test_the_oldest_turns_are_left_out_when_the_context_is_full(
    make_page: Any, small_context_server: RunningServer, width: int, height: int
) -> None:
    page = await make_page(width, height)
    await page.goto(f"{small_context_server.http_url}/?max_new_tokens=8&temperature=0")
    await ask(page, "First: " + QUESTION)
    await answered(page, 2)
    first_session = await page.evaluate("window.wsinferChat.client.session")

    await ask(page, "Second: " + QUESTION)
    await answered(page, 4)
    # Answered, not failed: the second question was asked again without the first exchange.
    assert await page.get_attribute(LAST_ANSWER, "data-error") is None
    assert await page.get_attribute(LAST_ANSWER, "data-finish") in ("length", "stop")
    assert await marks(page) == [True, True, False, False]
    notice = await page.text_content("#error") or ""
    assert "outgrew the model's context" in notice and "oldest 2 messages" in notice
    mark = page.locator("li.left-out-mark")
    assert await mark.count() == 1
    assert "no longer reads the messages above" in (await mark.text_content() or "")
    # The mark sits between the exchange left out and the one the model reads.
    after = await mark.evaluate("e => e.nextElementSibling.querySelector('.content').source")
    assert after.startswith("Second:")
    assert await page.evaluate("window.wsinferChat.client.session") != first_session
    overflow = await page.evaluate("() => document.scrollingElement.scrollWidth - innerWidth")
    assert overflow <= 1
    await mark.evaluate("e => e.scrollIntoView({block: 'center'})")
    await screenshot(page, f"context-left-out-{width}")

    # Kept over a reload: every message, the marks, and the new session goes on.
    await page.reload()
    await answered(page, 4)
    assert await marks(page) == [True, True, False, False]
    assert await page.locator("li.left-out-mark").count() == 1

    # The "continue elsewhere" link carries the marks to the other device.
    await page.click("#share")
    await page.wait_for_function("() => document.getElementById('share-link').value")
    link = await page.input_value("#share-link")
    other = await make_page(width, height, "dark")  # a browser context of its own
    await other.goto(link)
    await other.wait_for_selector("li.left-out-mark")
    assert await marks(other) == [True, True, False, False]
