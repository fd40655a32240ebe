"""Followers of a turn, as the exactly-once tests run them: each reconnects on its
own after any drop and resumes from the last position it received, over a raw
WebSocket ``resume``, the SSE stream with ``Last-Event-ID``, the Python client,
the Responses API's WebSocket mode (wsinfer's ``response.resume``), TGI's
``/generate_stream`` (the session headers and ``Last-Event-ID``: a token index),
the v2 ``generate_stream`` (by event count), its gRPC ``ModelStreamInfer`` (the
same count, with ``tritonclient.grpc.aio``) or DJL's JSON lines (by line count).
``Follower.text`` is what it received, joined: a repeat or a gap shows in a
comparison with the turn's known text.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import httpx
import tritonclient.grpc.aio as triton_aio
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
    # Events (v2) or lines (DJL) of the turn at ``after``: where the doors that
    # count resume (the test reads it off the token log, as it reads the truth).
    received: int = 0
    model: str = "wsinfer"  # the served model's name, in the v2 and DJL paths
    text: str = ""
    reconnects: int = 0
    # (monotonic time, characters received so far), one per delta.
    progress: list[tuple[float, int]] = field(default_factory=list)


# --- the kinds of follower -------------------------------------------------------------


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


def resumed(f: Follower, **headers: str) -> dict[str, str]:
    """The session headers every HTTP door's resume takes, and ``headers``."""
    return {"X-Wsinfer-Session": f.session, "X-Wsinfer-Token": f.token, **headers}


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[int | None, Any]]:
    """Each complete SSE event's ``id`` and JSON data (comments skipped): an event
    cut before its blank line is not one, so its position is not taken."""
    event_id: int | None = None
    data: str | None = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            data = line[6:]
        elif not line and data is not None:
            yield event_id, json.loads(data)
            event_id = data = None


async def follow_tgi(f: Follower) -> None:
    """TGI's ``POST /generate_stream`` resumed by the session headers and
    ``Last-Event-ID``: the last token event's ``index`` (its ``seq``). The closing
    event is the one with ``generated_text``."""
    last = f.after
    async with httpx.AsyncClient(base_url=f.cutter.http_url, timeout=30) as http:
        while True:
            headers = resumed(f, **{"Last-Event-ID": str(last)})
            try:
                async with http.stream("POST", "/generate_stream", headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for event_id, event in sse_events(response):
                        assert "error" not in event, event
                        if event["generated_text"] is not None:
                            return
                        f.text += event["token"]["text"]  # a repeat or a gap shows
                        f.progress.append((time.monotonic(), len(f.text)))
                        assert event_id == event["index"], event  # the id resumed after
                        last = max(last, event["index"])
            except (httpx.TransportError, httpx.StreamError):
                pass
            f.reconnects += 1
            await asyncio.sleep(0.05)


async def follow_v2(f: Follower) -> None:
    """The v2 ``POST /v2/models/{name}/generate_stream`` resumed by count: the
    session headers and ``Last-Event-ID: N``, N the events received (each event's
    ``id``). The closing event has no ``id`` and names the ``finish_reason``."""
    count = f.received
    url = f"/v2/models/{f.model}/generate_stream"
    async with httpx.AsyncClient(base_url=f.cutter.http_url, timeout=30) as http:
        while True:
            headers = resumed(f, **{"Last-Event-ID": str(count)})
            try:
                async with http.stream("POST", url, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for event_id, event in sse_events(response):
                        assert "error" not in event, event
                        if "finish_reason" in event["parameters"]:
                            return
                        assert event_id == count + 1, (event_id, count)  # numbered on
                        f.text += event["outputs"][0]["data"][0]
                        f.progress.append((time.monotonic(), len(f.text)))
                        count = event_id
            except (httpx.TransportError, httpx.StreamError):
                pass
            f.reconnects += 1
            await asyncio.sleep(0.05)


async def follow_djl(f: Follower) -> None:
    """DJL's ``POST /predictions/{name}`` resumed by line count: the session
    headers and ``X-Wsinfer-Received: N``, N the lines received. The stream's end
    is the turn's: a body cut short is a transport error."""
    count = f.received
    async with httpx.AsyncClient(base_url=f.cutter.http_url, timeout=30) as http:
        while True:
            headers = resumed(f, **{"X-Wsinfer-Received": str(count)})
            try:
                url = f"/predictions/{f.model}"
                async with http.stream("POST", url, headers=headers) as response:
                    assert response.status_code == 200, await response.aread()
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        chunk = json.loads(line)  # only whole lines: a cut one raises
                        assert "output_tokens" in chunk, chunk
                        f.text += chunk["output_tokens"][0]
                        f.progress.append((time.monotonic(), len(f.text)))
                        count += 1
                return
            except (httpx.TransportError, httpx.StreamError):
                pass
            f.reconnects += 1
            await asyncio.sleep(0.05)


async def follow_grpc(f: Follower) -> None:
    """``ModelStreamInfer`` (``tritonclient.grpc.aio``'s ``stream_infer``) resumed by
    count: one request whose parameters name the session and the events received,
    sent again on a new channel after a drop (a cut channel's own reconnect backs
    off for seconds). ``f.cutter`` leads to the frontends' gRPC ports."""
    count = f.received
    target = f.cutter.http_url.removeprefix("http://")
    while True:
        client = triton_aio.InferenceServerClient(url=target)

        async def requests(received: int) -> AsyncIterator[dict[str, Any]]:
            resume = {"wsinfer_session": f.session, "wsinfer_token": f.token}
            parameters = {**resume, "wsinfer_received": received}
            yield {"model_name": f.model, "inputs": [], "parameters": parameters}

        try:
            async for result, error in client.stream_infer(requests(count)):
                assert error is None, error
                names = result.get_response().parameters
                if names["triton_final_response"].bool_param:
                    return
                assert names["wsinfer_received"].int64_param == count + 1, (names, count)
                f.text += "".join(t.decode() for t in result.as_numpy("text_output").flat)
                f.progress.append((time.monotonic(), len(f.text)))
                count += 1
        except grpc.aio.AioRpcError:
            pass
        finally:
            await client.close()
        f.reconnects += 1
        await asyncio.sleep(0.05)


FOLLOW = {
    "ws": follow_ws,
    "sse": follow_sse,
    "python": follow_python,
    "responses_ws": follow_responses_ws,
    "tgi": follow_tgi,
    "v2": follow_v2,
    "djl": follow_djl,
    "grpc": follow_grpc,
}
# The followers that resume by how many events or lines they had (``received``).
COUNTED = frozenset({"v2", "djl", "grpc"})
