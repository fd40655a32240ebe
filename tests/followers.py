"""Followers of a turn, as the exactly-once tests run them: each reconnects on its
own after any drop and resumes from the last position it received, over a raw
WebSocket ``resume``, the SSE stream with ``Last-Event-ID``, the Python client, or
the Responses API's WebSocket mode (wsinfer's ``response.resume``).
``Follower.text`` is what it received, joined: a repeat or a gap shows in a
comparison with the turn's known text.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import WebSocketException

from wsinfer.clients import ReconnectPolicy, connect
from wsinfer.clients.errors import ConnectionLost

RECONNECT = ReconnectPolicy(max_attempts=100, max_time=120, base_delay=0.05, max_delay=0.5)


class Door(Protocol):
    """Where a follower connects: a server's port, or a ``Cutter`` in front of it."""

    @property
    def ws_url(self) -> str: ...

    @property
    def http_url(self) -> str: ...


@dataclass(frozen=True)
class Direct:
    """A server's own port, nothing in between."""

    port: int

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Follower:
    kind: str
    session: str
    token: str
    after: int
    cutter: Door
    text: str = ""
    reconnects: int = 0
    # (monotonic time, characters received so far), one per delta.
    progress: list[tuple[float, int]] = field(default_factory=list)


# --- the four kinds of follower --------------------------------------------------------


async def follow_ws(f: Follower) -> None:
    """A raw ``resume``; after a drop, another one from the last seq received."""
    last = f.after
    while True:
        try:
            async with ws_connect(f.cutter.ws_url, subprotocols=["wsinfer.v1.json"]) as ws:  # type: ignore[list-item]
                resume = {"type": "resume", "session": f.session, "token": f.token}
                await ws.send(json.dumps({**resume, "turn": 1, "after": last, "id": 1}))
                async for frame in ws:
                    msg = json.loads(frame)
                    assert msg["type"] != "error", msg
                    if msg["type"] == "delta":
                        f.text += msg["text"]  # a repeat or a gap shows in the comparison
                        f.progress.append((time.monotonic(), len(f.text)))
                        last = max(last, msg["seq"])
                    elif msg["type"] == "done":
                        return
        except (OSError, WebSocketException):
            pass
        f.reconnects += 1
        await asyncio.sleep(0.05)


async def follow_sse(f: Follower) -> None:
    """``GET /v1/sessions/{id}/stream``; after a drop, again with ``Last-Event-ID``."""
    last = f.after
    async with httpx.AsyncClient(base_url=f.cutter.http_url, timeout=30) as http:
        while True:
            headers = {"X-Wsinfer-Token": f.token, "Last-Event-ID": str(last)}
            try:
                url = f"/v1/sessions/{f.session}/stream"
                async with http.stream("GET", url, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    event_id: int | None = None
                    async for line in response.aiter_lines():
                        if line.startswith("id: "):
                            event_id = int(line[4:])
                        elif line == "data: [DONE]":
                            return
                        elif line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            assert "error" not in chunk, chunk
                            f.text += chunk["choices"][0]["delta"].get("content") or ""
                            f.progress.append((time.monotonic(), len(f.text)))
                        elif not line and event_id is not None:  # the event is complete
                            last, event_id = max(last, event_id), None
            except (httpx.TransportError, httpx.StreamError):
                pass
            f.reconnects += 1
            await asyncio.sleep(0.05)


async def follow_python(f: Follower) -> None:
    """The Python client: once it has connected, it reconnects and resumes by itself."""
    client = connect(f.cutter.ws_url, reconnect=RECONNECT)
    while True:
        try:
            await client.open()  # fails fast by design: a cut handshake is retried here
            break
        except ConnectionLost:
            f.reconnects += 1
            await asyncio.sleep(0.05)
    try:
        turn = await client.attach(f.session, f.token, turn=1, after=f.after)
        f.text = await turn.wait()
        f.reconnects += client.reconnects
    finally:
        await client.close()


# A response's last event: its status (wsinfer/http/responses.py ``outcome``).
RESPONSE_ENDS = {f"response.{s}" for s in ("completed", "incomplete", "cancelled", "failed")}


async def follow_responses_ws(f: Follower) -> None:
    """``response.resume`` on ``/v1/responses``; after a drop, again from the last
    sequence number received. Turn 1 of the session is the response
    ``resp_{session}_1_{token}``, its sequence numbers the turn's seq + 3."""
    response_id = f"resp_{f.session}_1_{f.token}"
    last = f.after + 3
    url = f.cutter.ws_url.removesuffix("/v1/ws") + "/v1/responses"
    while True:
        try:
            async with ws_connect(url) as ws:
                resume = {"type": "response.resume", "response_id": response_id}
                await ws.send(json.dumps({**resume, "starting_after": last}))
                async for frame in ws:
                    event = json.loads(frame)
                    assert event["type"] != "error", event
                    if event["type"] == "response.output_text.delta":
                        f.text += event["delta"]  # a repeat or a gap shows in the comparison
                        f.progress.append((time.monotonic(), len(f.text)))
                    if event.get("sequence_number") is not None:
                        last = max(last, event["sequence_number"])
                    if event["type"] in RESPONSE_ENDS:
                        return
        except (OSError, WebSocketException):
            pass
        f.reconnects += 1
        await asyncio.sleep(0.05)


FOLLOW = {
    "ws": follow_ws,
    "sse": follow_sse,
    "python": follow_python,
    "responses_ws": follow_responses_ws,
}
