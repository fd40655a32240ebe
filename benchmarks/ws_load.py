"""Concurrent WebSocket turns against a wsinfer frontend: the client side of bench_serve.

Imported by ``bench_serve.py``, and run as a worker process by it when there are
many streams, so that the client (one Python event loop decoding every delta's
JSON) is never what limits the numbers:

    python benchmarks/ws_load.py PORT STREAMS PARAMS_JSON MESSAGES_JSON

A worker opens its connections, prints ``ready``, waits for a line on stdin, runs
one turn on every connection at once, and prints its streams as one JSON line.
Times are ``time.monotonic()``: one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

TIMEOUT_S = 600.0  # one message; a GPU engine capturing graphs can take a while


@dataclass
class Stream:
    """One turn as its client saw it."""

    sent: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per delta
    tokens: int = 0  # the last seq seen (the done message's, for a finished turn)
    end: float = 0.0
    error: str = ""  # why the turn failed; empty when it finished

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    def gaps(self, after: float = float("-inf")) -> list[float]:
        """Time between consecutive deltas, for deltas arriving after ``after``."""
        pairs = zip(self.arrivals, self.arrivals[1:], strict=False)
        return [b - a for a, b in pairs if b > after]

    def max_gap_within(self, start: float, stop: float) -> float:
        """The longest silence that overlaps ``[start, stop]``."""
        pairs = zip(self.arrivals, self.arrivals[1:], strict=False)
        return max((b - a for a, b in pairs if b >= start and a <= stop), default=0.0)


async def open_sockets(port: int, n: int) -> list[ClientConnection]:
    url = f"ws://127.0.0.1:{port}/v1/ws"
    subprotocols: Any = ["wsinfer.v1.json"]
    return list(await asyncio.gather(*(connect(url, subprotocols=subprotocols) for _ in range(n))))


async def turn(ws: ClientConnection, request: dict[str, Any], stream: Stream) -> Stream:
    """Send one ``generate`` and record every delta until ``done``. A refused or failed
    turn (an ``error``, ``done`` with an error, a timeout, a closed connection) is
    recorded in ``stream.error``, not raised: a benchmark reports its failures."""
    stream.sent = time.monotonic()
    try:
        await ws.send(json.dumps({"type": "generate", **request}))
        while not await receive(ws, stream):
            pass
    except (asyncio.TimeoutError, ConnectionClosed) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    stream.end = time.monotonic()
    return stream


async def receive(ws: ClientConnection, stream: Stream) -> bool:
    """One message into ``stream``; True once the turn is over."""
    message = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    kind = message["type"]
    if kind == "delta":
        stream.arrivals.append(time.monotonic())
        stream.tokens = int(message["seq"])
    elif kind == "done":
        stream.tokens = int(message["seq"])
        if message["finish_reason"] == "error":
            stream.error = json.dumps(message.get("error"))
    elif kind == "error":
        stream.error = f"{message.get('code')}: {message.get('message')}"
    return kind in ("done", "error")


async def run_turns(
    port: int,
    n: int,
    request: dict[str, Any],
    go: Callable[[], Awaitable[None]] | None = None,
) -> list[Stream]:
    """``n`` connections, then (after ``go``) one turn on each at once."""
    sockets = await open_sockets(port, n)
    try:
        if go is not None:
            await go()
        return list(await asyncio.gather(*(turn(ws, request, Stream()) for ws in sockets)))
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets))


async def worker(port: int, n: int, request: dict[str, Any]) -> None:
    async def go() -> None:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)

    streams = await run_turns(port, n, request, go)
    print(json.dumps([dataclasses.asdict(s) for s in streams]), flush=True)


if __name__ == "__main__":
    port_arg, n_arg, params_arg, messages_arg = sys.argv[1:5]
    body = {"params": json.loads(params_arg), "messages": json.loads(messages_arg)}
    asyncio.run(worker(int(port_arg), int(n_arg), body))
