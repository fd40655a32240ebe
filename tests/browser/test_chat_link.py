"""The "continue elsewhere" link's limits, against the stand-in: a conversation
too long for a link carries its latest messages and says so on both sides, a
link too long for a QR code says so, and a damaged link is refused in words."""

from __future__ import annotations

import random
import string
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn

from .helpers import ask

MAX_LINK_CHARS = 64 * 1024  # store.js


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.002, default_tokens=3, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


def noise(n: int, seed: int) -> str:
    """Text that deflate cannot shrink much."""
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))


async def test_a_long_conversation_carries_its_latest_messages(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    desk = await make_page(1280, 800)  # one device; the phone is another context
    await desk.goto(f"http://127.0.0.1:{port}/?max_new_tokens=3")
    await ask(desk, "first")
    await desk.wait_for_selector("li.msg.assistant[data-finish]")
    # 40 earlier messages of 4,000 characters: about 120 KB once deflated.
    old = [noise(4000, i) for i in range(40)]
    await desk.evaluate(
        """old => { const c = window.wsinferChat.conversation;
        const role = (i) => (i % 2 ? "assistant" : "user");
        c.messages.unshift(...old.map((content, i) => ({ role: role(i), content })));
        window.wsinferChat.store.save(c, window.wsinferChat.client.session); }""",
        old,
    )
    await desk.click("#share")
    await desk.wait_for_function("() => document.getElementById('share-link').value")
    link = await desk.input_value("#share-link")
    assert len(link) <= MAX_LINK_CHARS
    note = await desk.text_content("#share-note") or ""
    assert "too long for a link" in note and "too long for a QR code" in note
    assert await desk.locator("#share-qr svg").count() == 0

    phone = await make_page(390, 844)
    await phone.goto(link)
    await phone.wait_for_selector("li.msg.assistant")
    first = phone.locator("li.msg.user.remote >> nth=0")
    assert "earlier messages stayed on the other device" in (await first.text_content() or "")
    shown = await phone.locator("li.msg .content").evaluate_all("els => els.map((e) => e.source)")
    assert shown[-2] == "first" and shown[1:-2] == old[-len(shown) + 3 :]
    assert await phone.evaluate("window.wsinferChat.client.session") == await desk.evaluate(
        "window.wsinferChat.client.session"
    )


async def test_a_damaged_link_is_refused_in_words(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    page = await make_page(390, 844)
    await page.goto(f"http://127.0.0.1:{port}/#follow=not-a-link")
    await page.wait_for_selector("#error:not([hidden])")
    assert "cut or damaged" in (await page.text_content("#error") or "")
    assert "follow=" not in page.url
    assert await page.locator("li.msg").count() == 0
    # Before any message there is no session to follow: the dialog says so.
    await page.click("#share")
    assert "Send a message first" in (await page.text_content("#share-note") or "")
    assert await page.is_hidden("#share-body")
