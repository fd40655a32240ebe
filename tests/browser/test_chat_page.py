"""The chat page in headless Chromium against a real ``wsinfer serve``.

Greedy decoding (temperature 0) makes the server's answer a function of the
conversation, so "no gap, no repeat" is checked the strong way: the text the
page shows after stops, drops and reloads must equal (or, for a stop, be a
prefix of) an uninterrupted run of the same conversation over a plain
WebSocket.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .conftest import RunningServer
from .helpers import (
    answer_text,
    ask,
    controls,
    record_events,
    reference_run,
    screenshot,
    seq_of,
    wait_done,
    wait_seq,
    watch_turn,
)

# Tokens per answer: long enough (about 3 s on the tiny model, unloaded) that the turn
# is still running after a reconnect backoff, so every cut lands mid-answer.
N = 1000
PARAMS = {"max_new_tokens": N, "temperature": 0.0}
PAGE_QUERY = f"/?max_new_tokens={N}&temperature=0"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def reference(server: RunningServer, *turns: str) -> list[str]:
    return await reference_run(server.ws_url, [user(t) for t in turns], PARAMS)


async def test_streamed_answer_and_second_turn(page: Any, wsinfer_server: RunningServer) -> None:
    """The answer streams in delta by delta, equals the server's greedy run, and a
    second question continues the same session with its history."""
    expected = await reference(wsinfer_server, "What is a WebSocket?", "And HTTP?")
    await page.goto(wsinfer_server.http_url + PAGE_QUERY)
    await page.wait_for_selector("#conn[data-state=open]")
    await ask(page, "What is a WebSocket?")
    await watch_turn(page)
    await wait_seq(page, 20)
    assert await controls(page) == {"send": False, "stop": True, "pause": True, "resume": False}
    assert await page.get_attribute("li.msg.assistant", "aria-busy") == "true"
    await screenshot(page, "real-streaming")
    assert await wait_done(page) in ("length", "stop")
    assert await answer_text(page) == expected[0]
    deltas = await page.evaluate("window.__deltas")
    assert len(deltas) > 5 and deltas == sorted(deltas), "the answer arrived in pieces, in order"
    assert await controls(page) == {"send": True, "stop": False, "pause": False, "resume": False}
    assert "ms" in (await page.text_content("#ttft") or "")
    assert float(await page.text_content("#tps") or "nan") > 0
    session = await page.evaluate("window.wsinferChat.client.session")

    await ask(page, "And HTTP?")
    assert await wait_done(page) in ("length", "stop")
    assert await answer_text(page) == expected[1]
    assert await page.evaluate("window.wsinferChat.client.session") == session
    assert await page.locator("li.msg").count() == 4
    await screenshot(page, "real-two-turns")


async def test_stop_mid_answer(page: Any, wsinfer_server: RunningServer) -> None:
    [expected] = await reference(wsinfer_server, "Count to a thousand")
    await page.goto(wsinfer_server.http_url + PAGE_QUERY)
    await ask(page, "Count to a thousand")
    await wait_seq(page, 10)
    await page.click("#stop")
    assert await wait_done(page) == "cancelled"
    text = await answer_text(page)
    assert 0 < len(text) < len(expected) and expected.startswith(text)
    assert await seq_of(page) < N
    assert await page.text_content("li.msg.assistant .note") == "Stopped"
    assert await controls(page) == {"send": True, "stop": False, "pause": False, "resume": False}
    await screenshot(page, "real-stopped")


async def test_pause_then_resume(page: Any, wsinfer_server: RunningServer) -> None:
    [expected] = await reference(wsinfer_server, "Pause me")
    await page.goto(wsinfer_server.http_url + PAGE_QUERY)
    await ask(page, "Pause me")
    await wait_seq(page, 10)
    await page.click("#pause")
    await page.wait_for_selector("body[data-turn=paused]")
    assert await controls(page) == {"send": False, "stop": True, "pause": False, "resume": True}
    held = await seq_of(page)
    await asyncio.sleep(1.0)
    assert await seq_of(page) == held < N, "a paused turn generates nothing"
    assert await page.text_content("li.msg.assistant .note") == "Paused"
    await screenshot(page, "real-paused")
    await page.click("#resume")
    assert await wait_done(page) in ("length", "stop")
    assert await answer_text(page) == expected


async def test_connection_cut_mid_answer(
    page: Any, wsinfer_server: RunningServer, proxy_to: Any
) -> None:
    """The server side drops every connection twice; the page reconnects, resumes
    after its last seq, and the text has no gap and no repeat."""
    [expected] = await reference(wsinfer_server, "Keep talking")
    proxy = await proxy_to(wsinfer_server.port)
    await page.goto(f"http://127.0.0.1:{proxy.port}{PAGE_QUERY}")
    await record_events(page)
    await ask(page, "Keep talking")
    cuts = []
    for at in (10, 40):
        cuts.append(await wait_seq(page, at))
        proxy.cut()
        await page.wait_for_function(
            "n => window.__ev.filter((e) => e.type === 'resumed').length >= n", arg=len(cuts)
        )
    await screenshot(page, "real-resumed")
    assert await wait_done(page) in ("length", "stop")
    final_seq = await seq_of(page)
    assert all(c < final_seq for c in cuts), (cuts, final_seq)
    assert await answer_text(page) == expected
    assert proxy.websocket_connections >= 3
    kinds = [e["type"] for e in await page.evaluate("window.__ev")]
    assert kinds.count("reconnecting") >= 2 and kinds.count("resumed") >= 2, kinds


async def test_reload_mid_answer(page: Any, wsinfer_server: RunningServer) -> None:
    """A reload keeps the conversation and continues the in-flight answer."""
    [expected] = await reference(wsinfer_server, "Survive a reload")
    await page.goto(wsinfer_server.http_url + PAGE_QUERY)
    await ask(page, "Survive a reload")
    at = await wait_seq(page, 15)
    await page.reload()
    # The restored view starts from the saved text, not from nothing.
    await page.wait_for_selector("li.msg.assistant")
    assert await page.text_content("li.msg.user .content") == "Survive a reload"
    assert await seq_of(page) >= at
    await page.wait_for_selector("#conn[data-state=resumed]")
    assert "restored" in (await page.text_content("#conn") or "")
    await screenshot(page, "real-reloaded-mid-answer")
    assert await wait_done(page) in ("length", "stop")
    assert at < await seq_of(page)
    assert await answer_text(page) == expected
    await screenshot(page, "real-after-reload")
    # And the finished conversation survives a further reload.
    await page.reload()
    await page.wait_for_selector("li.msg.assistant")
    assert await answer_text(page) == expected
    assert await page.locator("li.msg").count() == 2
