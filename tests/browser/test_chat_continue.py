"""Continue on an answer cut by the token limit, in headless Chromium against a
real ``wsinfer serve`` (the tiny model): the page sends the protocol's
``continue``, so the same answer grows in place, in the same turn of the same
session, before and after a reload; at 390 and 1280 px. (The fallback for a
server that refuses it is in test_chat_versions.py, against the stand-in.)"""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import RunningServer
from .helpers import LAST_ANSWER, answer_text, ask, screenshot

N = 8  # tokens per answer, and per Continue: short enough that the answer is cut


async def ended(page: Any, n: int) -> str:
    """Until ``n`` messages are shown, none streaming, and no turn runs: the last finish."""
    await page.wait_for_function(
        "n => document.querySelectorAll('li.msg').length === n"
        " && !document.querySelector('li.msg.streaming')"
        " && document.querySelector('li.msg:last-child').dataset.finish"
        " && document.body.dataset.turn === 'idle'",
        arg=n,
        timeout=300_000,
    )
    return str(await page.get_attribute(LAST_ANSWER, "data-finish"))


async def server_turn(page: Any) -> int:
    """The session's latest turn, as GET /v1/sessions/{id} reports it."""
    return int(
        await page.evaluate(
            """async () => { const c = window.wsinferChat.client;
            const headers = {"X-Wsinfer-Token": c.sessionToken};
            const r = await fetch(`/v1/sessions/${c.session}`, {headers});
            return (await r.json()).turn; }"""
        )
    )


async def continue_once(page: Any) -> str:
    """Click Continue on the cut answer; its text once it has ended again."""
    await page.evaluate(
        """sel => { const li = document.querySelector(sel);
        window.__answer = li;
        window.__marks = [];
        const mark = () => window.__marks.push({
            streaming: li.classList.contains("streaming"), finish: li.dataset.finish ?? null,
            offered: li.querySelectorAll(".continue:not([hidden])").length});
        new MutationObserver(mark).observe(li, {attributes: true, subtree: true}); }""",
        LAST_ANSWER,
    )
    await page.click(f"{LAST_ANSWER} .continue")
    assert await ended(page, 2) == "length"
    # The same element grew; while it went on it kept its cut mark and offered no second Continue.
    assert await page.evaluate(f"window.__answer === document.querySelector('{LAST_ANSWER}')")
    going = [m for m in await page.evaluate("window.__marks") if m["streaming"]]
    assert going and all(m["finish"] == "length" and m["offered"] == 0 for m in going), going
    return await answer_text(page)


@pytest.mark.parametrize("width,height", [(390, 844), (1280, 800)])
async def test_continue_extends_the_cut_answer_in_place(
    make_page: Any, wsinfer_server: RunningServer, width: int, height: int
) -> None:
    page = await make_page(width, height)
    await page.goto(f"{wsinfer_server.http_url}/?max_new_tokens={N}&temperature=0")
    await ask(page, "Tell me about WebSockets")
    assert await ended(page, 2) == "length"
    assert "Cut off" in (await page.text_content(f"{LAST_ANSWER} .note") or "")
    first = await answer_text(page)
    session = await page.evaluate("window.wsinferChat.client.session")
    turn = await server_turn(page)

    second = await continue_once(page)
    assert second.startswith(first) and len(second) > len(first)
    assert await server_turn(page) == turn
    conv = await page.evaluate("window.wsinferChat.conversation")
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["turn"] == turn and conv["messages"][1]["session"] == session
    assert await page.is_hidden("#error")  # no fallback notice: the server took it
    # The readout is the Continue's: its time to the first new token, its speed.
    assert (await page.text_content("#ttft") or "").endswith(" ms")
    assert float(await page.text_content("#tps") or "nan") > 0
    await screenshot(page, f"continued-{width}")

    # After a reload the page no longer holds the turn: Continue still extends it.
    await page.reload()
    assert await ended(page, 2) == "length"
    assert await answer_text(page) == second
    third = await continue_once(page)
    assert third.startswith(second) and len(third) > len(second)
    assert await server_turn(page) == turn
    assert await page.evaluate("window.wsinferChat.client.session") == session
    await page.reload()
    assert await ended(page, 2) == "length"
    assert await answer_text(page) == third
