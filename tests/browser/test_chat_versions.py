"""The chat page keeps what happened, against the stand-in (whose every answer
is cut at max_new_tokens, so every answer here is a cut one): Continue on a cut
answer, versions from Regenerate and branches from Edit (switchable, kept over
a reload), and refusals and failures kept with their words and colour."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn, word_text

from .helpers import LAST_ANSWER, answer_text, ask, screenshot, wait_done, wait_seq


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.005, default_tokens=5, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


def generates(server: StandIn) -> list[dict[str, Any]]:
    return [m for m in server.received if m["type"] == "generate"]


def words(n: int) -> str:
    return "".join(word_text(i) for i in range(1, n + 1))


async def shown(page: Any) -> list[str]:
    return list(
        await page.locator("li.msg .content").evaluate_all("els => els.map((e) => e.source)")
    )


async def label(page: Any, message: str) -> str:
    return str(await page.text_content(f"{message} .version-label"))


async def wait_messages(page: Any, n: int) -> None:
    await page.wait_for_function(
        "n => document.querySelectorAll('li.msg').length === n"
        " && document.querySelector('li.msg:last-child').dataset.finish",
        arg=n,
    )


async def test_a_cut_answer_is_marked_and_continues(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=5")
    await ask(page, "one")
    assert await wait_done(page) == "length"
    assert "Cut off" in (await page.text_content(f"{LAST_ANSWER} .note") or "")
    assert await page.locator(".continue:visible").count() == 1
    session = await page.evaluate("window.wsinferChat.client.session")
    turn = await page.evaluate("window.wsinferChat.turn.turn")
    await page.click(f"{LAST_ANSWER} .continue")
    await wait_messages(page, 4)
    # The stand-in, like a server older than the `continue` message, refuses it:
    # a new turn of the same session asks for the rest, and the page says why.
    [tried] = [m for m in server.received if m["type"] == "continue"]
    assert tried["session"] == session and tried["turn"] == turn
    asked = generates(server)[-1]
    assert asked["session"] == session
    assert asked["messages"] == [{"role": "user", "content": "Continue"}]
    notice = await page.text_content("#error") or ""
    assert "could not extend this answer in place" in notice and "new message" in notice
    # Information, not a failure: in the page's own colours, read out politely.
    look = await page.eval_on_selector(
        "#error", "e => [getComputedStyle(e).color, e.getAttribute('role'), e.dataset.kind]"
    )
    body = await page.evaluate("getComputedStyle(document.body).color")
    assert look == [body, "status", "notice"] and body != "rgb(179, 38, 30)"
    await screenshot(page, "continue-refused")
    assert await page.locator(".continue:visible").count() == 1  # the last answer's only
    await page.reload()
    await wait_messages(page, 4)
    assert await page.get_attribute("li.msg.assistant >> nth=0", "data-finish") == "length"
    assert "Cut off" in (await page.text_content("li.msg.assistant >> nth=0 >> .note") or "")

    # An earlier version of the answer is no turn the server can extend: no
    # `continue` is tried, the rest is asked for in a new message at once.
    await page.click(f"{LAST_ANSWER} .regenerate")  # a new session, the old answer kept
    await wait_messages(page, 4)
    await page.click(f"{LAST_ANSWER} .prev-version")
    await page.click(f"{LAST_ANSWER} .continue")
    await wait_messages(page, 6)
    assert sum(1 for m in server.received if m["type"] == "continue") == 1
    assert generates(server)[-1]["messages"][-1] == {"role": "user", "content": "Continue"}
    assert "no longer the latest" in (await page.text_content("#error") or "")


async def test_a_continue_whose_answer_was_lost_goes_on_once(
    make_page: Any, standin: tuple[StandIn, int], proxy_to: Any
) -> None:
    server, port = standin
    server.continues = True  # as wsinfer serve does
    proxy = await proxy_to(port)
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{proxy.port}/?max_new_tokens=5")
    await ask(page, "one")
    assert await wait_done(page) == "length"
    server.echo_ids = False  # its answer to the continue never reaches the request
    await page.click(f"{LAST_ANSWER} .continue")
    await page.wait_for_selector(f"{LAST_ANSWER}.streaming")
    while not any(m["type"] == "continue" for m in server.received):
        await asyncio.sleep(0.01)
    server.echo_ids = True
    proxy.cut()  # the client re-joins the turn: the server had the continue
    await page.wait_for_function(
        f"() => document.querySelector('{LAST_ANSWER}:not(.streaming)')"
        f" && document.querySelector('{LAST_ANSWER}').dataset.finish === 'length'"
    )
    assert await answer_text(page) == words(10)  # extended once, nothing repeated
    assert sum(1 for m in server.received if m["type"] == "continue") == 1
    assert await page.locator("li.msg").count() == 2
    assert await page.locator(".continue:visible").count() == 1
    assert (await page.text_content("#error") or "").strip() == ""


async def test_regenerate_keeps_versions_and_edit_branches(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=5")
    server.pieces = ["first"]
    await ask(page, "q")
    await wait_messages(page, 2)
    assert await page.locator(".versions").count() == 0
    server.pieces = ["second"]
    await page.click(f"{LAST_ANSWER} .regenerate")
    await wait_messages(page, 2)
    assert await shown(page) == ["q", "second"]
    assert await label(page, LAST_ANSWER) == "2/2"
    await page.click(f"{LAST_ANSWER} .prev-version")
    assert await shown(page) == ["q", "first"]
    assert await label(page, LAST_ANSWER) == "1/2"
    await page.reload()  # the versions are kept in the page's storage
    await wait_messages(page, 2)
    assert await shown(page) == ["q", "first"] and await label(page, LAST_ANSWER) == "1/2"
    await page.click(f"{LAST_ANSWER} .next-version")
    assert await shown(page) == ["q", "second"]

    # Editing the question branches: the old question, with its answers, stays.
    server.pieces = ["third"]
    await page.click("li.msg.user .edit")
    await page.fill("li.msg.user .edit-box", "q2")
    await page.press("li.msg.user .edit-box", "Enter")
    await wait_messages(page, 2)
    assert await shown(page) == ["q2", "third"]
    assert await label(page, "li.msg.user") == "2/2"
    assert await page.locator(f"{LAST_ANSWER} .versions").count() == 0
    await screenshot(page, "versions-edited")
    await page.click("li.msg.user .prev-version")
    assert await shown(page) == ["q", "second"]
    assert await label(page, "li.msg.user") == "1/2" and await label(page, LAST_ANSWER) == "2/2"

    # A question on the old branch: a new session with that branch's history.
    closes = sum(1 for m in server.received if m["type"] == "close")
    server.pieces = ["fourth"]
    await ask(page, "more")
    await wait_messages(page, 4)
    asked = generates(server)[-1]
    assert "session" not in asked
    assert asked["messages"] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "more"},
    ]
    assert sum(1 for m in server.received if m["type"] == "close") == closes + 1
    await page.reload()
    await wait_messages(page, 4)
    assert await shown(page) == ["q", "second", "more", "fourth"]
    await page.click("li.msg.user >> nth=0 >> .next-version")
    assert await shown(page) == ["q2", "third"]


async def test_refusals_and_failures_keep_every_message_in_words(
    make_page: Any, standin: tuple[StandIn, int], proxy_to: Any
) -> None:
    server, port = standin
    proxy = await proxy_to(port)
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{proxy.port}/?max_new_tokens=5")
    await ask(page, "hello")
    await wait_messages(page, 2)
    server.refuse_generate = {"code": "too_large", "message": "prompt too long"}
    await ask(page, "a long question")
    await wait_messages(page, 4)
    assert (await shown(page))[:3] == ["hello", words(5), "a long question"]
    failed = "li.msg.assistant.failed:last-child"
    note = await page.text_content(f"{failed} .note") or ""
    assert "longer than the model can read" in note and "too_large" not in note
    # A failure mid-answer keeps what was written.
    await page.click(f"{failed} .regenerate")  # Retry: in place of the refusal
    await wait_messages(page, 4)
    await ask(page, "FAIL")
    await wait_messages(page, 6)
    assert await answer_text(page) == words(5)
    assert "no model was running" in (await page.text_content(f"{failed} .note") or "")

    # The server lost the session while an answer was coming: said so, in words.
    server.delay = 0.3
    await ask(page, "and then?")
    await wait_seq(page, 1)
    assert await page.get_attribute(LAST_ANSWER, "data-finish") is None
    server.sessions.clear()
    proxy.cut()
    await wait_messages(page, 8)
    assert await page.get_attribute(LAST_ANSWER, "data-error") == "not_found"
    note = await page.text_content(f"{failed} .note") or ""
    assert "The server no longer has this conversation" in note and "lost" in note
    await screenshot(page, "failures-kept")

    # After a reload: every message, each failure still red and in words.
    bad = await page.evaluate("getComputedStyle(document.querySelector('.msg.failed .note')).color")
    await page.reload()
    await wait_messages(page, 8)
    assert len(await shown(page)) == 8
    errors = await page.locator("li.msg.failed").evaluate_all(
        "els => els.map((e) => e.dataset.error)"
    )
    assert errors == ["engine_unavailable", "not_found"]
    colours = await page.locator("li.msg.failed .note").evaluate_all(
        "els => els.map((e) => getComputedStyle(e).color)"
    )
    assert colours == [bad, bad] and bad == "rgb(179, 38, 30)"
