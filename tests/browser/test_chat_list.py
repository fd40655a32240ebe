"""The conversation list and the page's small helps, against the stand-in:
rename, search (titles and messages), delete with undo (the server's session
ends only once the undo is over), and the scroll-to-the-end button."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn

from .helpers import ask, screenshot, settled

TITLES = "#conversations li .open span"


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.002, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


async def chat(page: Any, server: StandIn, question: str, answer: str) -> str:
    await page.click("#new-chat")
    server.pieces = [answer]
    await ask(page, question)
    await settled(page, 2)
    return str(await page.evaluate("window.wsinferChat.client.session"))


def closes(server: StandIn) -> list[str]:
    return [m["session"] for m in server.received if m["type"] == "close"]


async def test_rename_and_search(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/")
    await chat(page, server, "apples", "red or green")
    await chat(page, server, "pears", "a banana is longer")
    await page.click("#conversations li:nth-child(1) .rename")
    await page.fill("#conversations .rename-box", "Fruit, mostly pears")
    await page.press("#conversations .rename-box", "Enter")
    assert await page.locator(TITLES).all_text_contents() == ["Fruit, mostly pears", "apples"]
    assert await page.text_content("#title") == "Fruit, mostly pears"
    # Esc keeps the title as it was.
    await page.click("#conversations li:nth-child(2) .rename")
    await page.fill("#conversations .rename-box", "never")
    await page.press("#conversations .rename-box", "Escape")
    assert await page.locator(TITLES).all_text_contents() == ["Fruit, mostly pears", "apples"]

    assert await page.is_hidden("#no-conversations") and await page.is_hidden("#no-match")
    await page.fill("#search", "APPLE")
    assert await page.locator(TITLES).all_text_contents() == ["apples"]
    await screenshot(page, "list-search-1000-light")
    await page.fill("#search", "banana")  # in an answer, not a title
    assert await page.locator(TITLES).all_text_contents() == ["Fruit, mostly pears"]
    await page.fill("#search", "kiwi")
    assert await page.locator(TITLES).count() == 0 and await page.is_visible("#no-match")
    assert await page.is_hidden("#no-conversations")
    await page.fill("#search", "")
    await page.reload()
    await page.wait_for_selector("#conversations li")
    assert await page.locator(TITLES).all_text_contents() == ["Fruit, mostly pears", "apples"]


async def test_delete_waits_for_undo(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/")
    first = await chat(page, server, "apples", "red")
    second = await chat(page, server, "pears", "green")
    await page.click("#conversations li:nth-child(1) .delete")  # the open one
    assert await page.locator(TITLES).all_text_contents() == ["apples"]
    assert await page.locator("li.msg").count() == 0
    assert await page.text_content("#toast-text") == "Deleted “pears”."
    await screenshot(page, "list-undo-1000-light")
    await page.click("#undo")
    await settled(page, 2)
    assert await page.locator(TITLES).all_text_contents() == ["pears", "apples"]
    assert await page.text_content("li.msg.user .content") == "pears"
    assert await page.is_hidden("#toast") and closes(server) == []
    # The undone conversation goes on in its own session.
    server.pieces = ["still green"]
    await ask(page, "and now?")
    await settled(page, 4)
    asked = [m for m in server.received if m["type"] == "generate"][-1]
    assert asked["session"] == second

    await page.click("#conversations li:nth-child(2) .delete")  # apples, not open
    assert await page.locator(TITLES).all_text_contents() == ["pears"]
    await page.click("#conversations li:nth-child(1) .delete")  # the next one ends the first
    await page.wait_for_function("() => !document.querySelector('#conversations li')")
    for _ in range(100):
        if closes(server):
            break
        await page.wait_for_timeout(20)
    assert closes(server) == [first]
    await page.click("#undo")
    await settled(page, 4)
    assert await page.locator(TITLES).all_text_contents() == ["pears"]
    await page.reload()
    await settled(page, 4)
    assert await page.locator(TITLES).all_text_contents() == ["pears"]
    assert closes(server) == [first]


async def test_scroll_to_the_end_button(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    page = await make_page(390, 700)
    await page.goto(f"http://127.0.0.1:{port}/")
    server.pieces = [f"line {i}\n\n" for i in range(60)]
    await ask(page, "a long one")
    await settled(page, 2)
    assert await page.is_hidden("#to-bottom")
    await page.eval_on_selector("#main", "m => { m.scrollTop = 0; }")
    await page.wait_for_selector("#to-bottom:visible")
    await screenshot(page, "to-bottom-390-light")
    await page.click("#to-bottom")
    await page.wait_for_selector("#to-bottom", state="hidden")
    at_end = await page.eval_on_selector(
        "#main", "m => m.scrollHeight - m.scrollTop - m.clientHeight < 2"
    )
    assert at_end
