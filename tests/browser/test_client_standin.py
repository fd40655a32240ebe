"""The page's client logic in a real browser against the protocol stand-in.

The stand-in makes refusals and misbehaviour that the real server will not
produce on demand: a refused generate (overloaded, with retry_after), a resume
that replays deltas the client already applied, and a server that stays
unreachable for a while. Its text is ``"w1 w2 ... wN "``, so any gap or repeat
shows at once.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn, word_text

from .helpers import (
    answer_text,
    ask,
    controls,
    record_events,
    screenshot,
    wait_done,
    wait_seq,
)


def expected(n: int) -> str:
    return "".join(word_text(i) for i in range(1, n + 1))


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.02, default_tokens=50, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


async def test_refusal_is_readable_and_question_kept(
    page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=20")
    # Shift+Enter is a new line, not a send.
    await page.type("#input", "one")
    await page.keyboard.press("Shift+Enter")
    await page.keyboard.type("two")
    assert await page.input_value("#input") == "one\ntwo"
    assert await page.locator("li.msg").count() == 0 and not server.received
    server.refuse_generate = {"code": "overloaded", "message": "queue full", "retry_after": 2.5}
    await ask(page, "hello?")
    await page.wait_for_selector("#error:not([hidden])")
    error = await page.text_content("#error")
    assert error is not None and "busy" in error and "3 s" in error and "overloaded" in error
    assert await page.get_attribute("#error", "role") == "alert"
    # The refused question stays, with an answer that says in words what happened.
    assert await page.locator("li.msg").count() == 2
    assert await page.text_content("li.msg.user .content") == "hello?"
    failed = "li.msg.assistant.failed:last-child"
    assert "the server was busy" in (await page.text_content(f"{failed} .note") or "")
    assert await page.get_attribute(failed, "data-error") == "overloaded"
    assert await controls(page) == {"send": True, "stop": False, "pause": False, "resume": False}
    await screenshot(page, "standin-overloaded")
    # Retry asks again in its place (a refusal is not kept as a version), and clears the error.
    await page.click(f"{failed} .regenerate")
    assert await wait_done(page) == "length"
    assert await answer_text(page) == expected(20)
    assert await page.locator("li.msg").count() == 2
    assert await page.locator(".versions").count() == 0
    assert await page.is_hidden("#error")


async def test_replayed_deltas_are_dropped_after_a_drop(
    page: Any, standin: tuple[StandIn, int], proxy_to: Any
) -> None:
    """The server replays already-applied deltas on resume; the text has no repeat."""
    server, port = standin
    server.replay_overlap = 5
    proxy = await proxy_to(port)
    await page.goto(f"http://127.0.0.1:{proxy.port}/?max_new_tokens=150")
    await record_events(page)
    await ask(page, "count")
    await wait_seq(page, 20)
    proxy.refuse = True  # stay down long enough to see the backoff
    proxy.cut()
    await page.wait_for_function(
        "() => window.__ev.filter((e) => e.type === 'reconnecting').length >= 3"
    )
    await page.wait_for_selector("#conn[data-state=reconnecting]")
    await screenshot(page, "standin-reconnecting")
    proxy.refuse = False
    assert await wait_done(page) == "length"
    assert await answer_text(page) == expected(150)
    resumes = [m for m in server.received if m["type"] == "resume"]
    assert resumes and all(m["after"] >= 20 and m["turn"] == 1 for m in resumes)
    events = await page.evaluate("window.__ev")
    delays = [
        e["detail"]["delay"]
        for e in events
        if e["type"] == "reconnecting" and e["detail"].get("delay")
    ]
    assert delays, events
    assert max(delays) <= 10_000
    assert any(e["type"] == "resumed" for e in events)


async def test_stop_before_session_answer_is_deferred(
    page: Any, standin: tuple[StandIn, int]
) -> None:
    """Stop pressed before the server named the session still stops the turn."""
    server, port = standin
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=500")
    await page.evaluate(
        """() => { const c = window.wsinferChat.client;
        const t = c.generate({prompt: "x", params: {max_new_tokens: 500}}); t.stop();
        window.__t = t; }"""
    )
    result = await page.evaluate("window.__t.finished.then((d) => d.finishReason)")
    assert result == "cancelled"
    assert [m["type"] for m in server.received][:2] == ["generate", "stop"]


async def test_async_iterator_and_error_class(page: Any, standin: tuple[StandIn, int]) -> None:
    """The module API: `for await` over a turn, WsinferError with code and retry_after."""
    server, port = standin
    await page.goto(f"http://127.0.0.1:{port}/")
    out = await page.evaluate(
        """async () => {
        const { WsinferClient, WsinferError } = await import("/static/wsinfer.js");
        const client = new WsinferClient({ storageKey: "api-test" });
        let text = "";
        const first = client.generate({ prompt: "a", params: { max_new_tokens: 7 } });
        for await (const d of first) text += d;
        const second = client.generate({ messages: [{ role: "user", content: "b" }],
                                         params: { max_new_tokens: 3 } });
        const done = await second.finished;
        return { text, second: done.text, session: client.session, reason: done.finishReason,
                 isError: new WsinferError("x") instanceof Error };
        }"""
    )
    assert out["text"] == expected(7)
    assert out["second"] == expected(3) and out["reason"] == "length"
    assert out["isError"]
    gens = [m for m in server.received if m["type"] == "generate"]
    assert "session" not in gens[0] and gens[1]["session"] == out["session"]
    server.refuse_generate = {"code": "overloaded", "message": "busy", "retry_after": 4}
    err = await page.evaluate(
        """async () => {
        const { WsinferClient, WsinferError } = await import("/static/wsinfer.js");
        const client = new WsinferClient({ storageKey: "api-test-2" });
        try { for await (const _ of client.generate({ prompt: "a" })) {} }
        catch (e) { return { cls: e instanceof WsinferError, code: e.code, ra: e.retry_after,
                             ra2: e.retryAfter, name: e.name }; }
        return null; }"""
    )
    assert err == {"cls": True, "code": "overloaded", "ra": 4, "ra2": 4, "name": "WsinferError"}
    await asyncio.sleep(0)


async def test_a_generate_whose_answer_was_lost_is_resent_with_its_key(
    page: Any, standin: tuple[StandIn, int]
) -> None:
    """Issue 9, bug 2: the server took the generate and the connection dropped
    before its answer. The page used to re-send it without a key, and a second
    session started while the first generated unwatched; now the resend
    carries the same key and the server answers the turn it already started."""
    server, port = standin
    server.drop_answers = 1
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=30")
    await ask(page, "count")
    assert await wait_done(page) == "length"
    assert await answer_text(page) == expected(30)
    assert len(server.sessions) == 1
    first, again = server.generates()
    assert first == again and re.fullmatch(r"[0-9a-f]{32}", first["idempotency_key"])


async def test_client_local_codes_are_the_contracts(
    page: Any, standin: tuple[StandIn, int]
) -> None:
    """Issue 9, bug 5: closing mid-turn fails it with `client_closed`, as in Python."""
    server, port = standin
    await page.goto(f"http://127.0.0.1:{port}/")
    out = await page.evaluate(
        """async () => {
        const { WsinferClient, ClientErrorCode } = await import("/static/wsinfer.js");
        const client = new WsinferClient({ storageKey: "codes-test" });
        const turn = client.generate({ prompt: "a", params: { max_new_tokens: 500 } });
        await new Promise((ok) => turn.addEventListener("delta", ok, { once: true }));
        client.close();
        try { await turn.finished; } catch (e) { return { code: e.code, status: turn.status,
                                                          table: ClientErrorCode.CLIENT_CLOSED }; }
        return null; }"""
    )
    assert out == {"code": "client_closed", "status": "error", "table": "client_closed"}
