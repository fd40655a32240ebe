"""A browser's own ``EventSource`` on a session's stream, its connection cut
again and again (issue 18): Chromium reconnects by itself with
``Last-Event-ID`` = the last ``id:`` it saw, and the text it gathers must be
exactly the turn's text, nothing lost, nothing repeated.

The page is served through a ``Cutter`` (same origin, so no CORS), which
aborts the stream's connection each time some events have arrived since the
browser reconnected; half of the cuts leave the server's side open a while,
so the old request still follows the turn when the new one arrives.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.cutter import Cutter
from tests.stack import Client, joined, start_serve, stop_serve
from wsinfer.engine.fake import WORDS

# 200 tokens/s for 4,000 tokens: 20 s of stream, room for several cuts at
# Chromium's 3 s reconnection delay (the server sends no ``retry:``), and a
# new entry every 5 ms, so a reconnect lands while the old request's reads are
# in flight. Four sources at once (Chromium allows six connections a host).
RATE, TOKENS, SOURCES = 200, 4000, 4
MIN_CUTS = 4

pytestmark = pytest.mark.timeout(180)

WATCH = """([session, token, n]) => {
  window.got = [];
  const url = `/v1/sessions/${session}/stream?session_token=${token}`;
  for (let i = 0; i < n; i++) {
    const g = { text: "", opens: 0, errors: 0, events: 0, done: false, ids: [] };
    got.push(g);
    const source = new EventSource(url);
    source.onopen = () => { g.opens += 1; g.events = 0; };
    source.onerror = () => { g.errors += 1; };
    source.onmessage = (ev) => {
      if (ev.data === "[DONE]") { g.done = true; source.close(); return; }
      const chunk = JSON.parse(ev.data);
      g.events += 1;
      g.ids.push(ev.lastEventId);
      g.text += (chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content) || "";
    };
  }
}"""
ALL_DONE = "got.every((g) => g.done)"


@pytest.fixture
async def fake_serve(tmp_path: Path) -> AsyncIterator[int]:
    process, port = start_serve(tmp_path, "--model", f"fake:{RATE}")
    yield port
    assert await asyncio.to_thread(stop_serve, process) == 0


async def start_turn(port: int) -> tuple[str, str]:
    client = await Client.open(port)
    await client.send(type="generate", prompt="p", params={"max_new_tokens": TOKENS}, id=1)
    answer = await client.recv()
    await client.close()
    assert answer["type"] == "session", answer
    return answer["session"], answer["token"]


async def replay(port: int, session: str, token: str) -> str:
    client = await Client.open(port)
    await client.send(type="resume", session=session, token=token, after=0, id=1)
    text, _ = joined(await client.until("done"))
    await client.close()
    return text


async def test_event_source_cut_repeatedly_ends_with_the_exact_text(
    page: Any, fake_serve: int
) -> None:
    rng = random.Random(18)
    cutter = await Cutter([fake_serve]).start()
    try:
        await page.goto(f"{cutter.http_url}/healthz")
        session, token = await start_turn(fake_serve)
        await page.evaluate(WATCH, [session, token, SOURCES])
        cuts = 0
        while not await page.evaluate(ALL_DONE):
            # Some events on every connection first, so each cut lands mid-stream.
            every = "got.every((g) => g.done || g.events >= 5)"
            await page.wait_for_function(every, polling=50, timeout=60_000)
            if await page.evaluate(ALL_DONE):
                break
            cuts += cutter.cut(linger=rng.choice([0.0, rng.uniform(3.5, 6.0)])) > 0
            back = f"got.every((g) => g.done || g.opens > {cuts})"
            await page.wait_for_function(back, polling=50, timeout=60_000)
        got = await page.evaluate("got")
    finally:
        await cutter.stop()

    truth = await replay(fake_serve, session, token)
    opens = [g["opens"] for g in got]
    print(f"\nEventSource x{SOURCES}: {cuts} cuts, opens {opens}, {len(truth)} characters each")
    assert truth == "".join(WORDS[i % len(WORDS)] for i in range(TOKENS))
    for g in got:
        assert g["text"] == truth, f"{len(g['text'])} characters, not {len(truth)}"
        ids = [int(i) for i in g["ids"] if i]  # the last chunk repeats the last delta's id
        assert ids == sorted(ids), "event ids went back"
    assert cuts >= MIN_CUTS, f"the turn ended after {cuts} cuts: cut sooner"
