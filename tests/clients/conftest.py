"""A small protocol-faithful stand-in for the wsinfer server, for client unit tests.

It is a real websockets server on 127.0.0.1 that speaks protocol v1 (both
subprotocols, ids, sessions outliving connections, resume with ``after``) and
"generates" ``w1 w2 ...`` on a timer. Knobs let a test misbehave on purpose:
cut connections after N deltas, refuse handshakes, replay deltas the client
already has, or send each delta twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgpack
import pytest
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

JSON = "wsinfer.v1.json"
MSGPACK = "wsinfer.v1.msgpack"
KNOWN_PARAMS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "stop",
}


@dataclass
class FakeTurn:
    number: int
    max_tokens: int
    fail: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    finished: bool = False
    paused: bool = False
    want_pause: bool = False
    want_stop: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class FakeSession:
    sid: str
    token: str
    turns: list[FakeTurn] = field(default_factory=list)


class FakeServer:
    def __init__(self, *, api_key: str | None = None, delay: float = 0.005) -> None:
        self.api_key = api_key
        self.delay = delay
        self.subprotocols = [MSGPACK, JSON]
        self.sessions: dict[str, FakeSession] = {}
        self.received: list[dict[str, Any]] = []
        self.subprotocols_seen: list[str | None] = []
        self.cut_plan: list[int] = []  # each new connection: cut after this many deltas
        self.refuse_next = 0  # answer the next N handshakes with HTTP 503
        self.replay_overlap = 0  # on resume, resend this many deltas the client has
        self.duplicate_deltas = False
        self.echo_ids = True
        self.connections = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count(1)
        self._server: Server | None = None
        self.url = ""

    async def start(self) -> FakeServer:
        self._server = await serve(
            self._handle,
            "127.0.0.1",
            0,
            process_request=self._process_request,
            select_subprotocol=self._select,
        )
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}/v1/ws"
        return self

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- handshake -------------------------------------------------------------

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        if self.refuse_next > 0:
            self.refuse_next -= 1
            return conn.respond(HTTPStatus.SERVICE_UNAVAILABLE, "busy\n")
        if self.api_key is not None:
            ok = request.headers.get("Authorization") == f"Bearer {self.api_key}"
            if not ok:
                return conn.respond(HTTPStatus.UNAUTHORIZED, "bad key\n")
        return None

    def _select(self, conn: ServerConnection, offered: Any) -> Subprotocol | None:
        for name in offered:
            if name in self.subprotocols:
                return Subprotocol(name)
        return None

    # --- connection ------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.subprotocols_seen.append(ws.subprotocol)
        conn = FakeConn(self, ws, self.cut_plan.pop(0) if self.cut_plan else None)
        try:
            async for frame in ws:
                msg = json.loads(frame) if isinstance(frame, str) else msgpack.unpackb(frame)
                self.received.append(msg)
                await conn.handle(msg)
        except ConnectionClosed:
            pass
        finally:
            for task in conn.feeds.values():
                task.cancel()

    # --- generation -------------------------------------------------------------

    async def generate(self, turn: FakeTurn) -> None:
        while turn.seq < turn.max_tokens and not turn.want_stop:
            if turn.want_pause:
                turn.paused, turn.want_pause = True, False
                turn.unpaused = asyncio.Event()
                turn.push({"type": "paused", "seq": turn.seq})
                await turn.unpaused.wait()
                turn.paused = False
                continue
            await asyncio.sleep(self.delay)
            turn.seq += 1
            turn.push({"type": "delta", "seq": turn.seq, "text": f"w{turn.seq} "})
        turn.finished = True
        turn.push(self._done(turn))

    def _done(self, turn: FakeTurn) -> dict[str, Any]:
        usage = {"prompt_tokens": 3, "completion_tokens": turn.seq, "cached_tokens": 0}
        done: dict[str, Any] = {"type": "done", "seq": turn.seq, "usage": usage}
        if turn.want_stop:
            done["finish_reason"] = "cancelled"
        elif turn.fail:
            done["finish_reason"] = "error"
            done["error"] = {"code": "engine_unavailable", "message": "engine died"}
        else:
            done["finish_reason"] = "length"
        return done


class FakeConn:
    """One client connection: answers requests and runs one feed per followed session."""

    def __init__(self, server: FakeServer, ws: ServerConnection, cut_after: int | None) -> None:
        self.server = server
        self.ws = ws
        self.cut_after = cut_after
        self.sent_deltas = 0
        self.feeds: dict[str, asyncio.Task[Any]] = {}

    async def send(self, msg: dict[str, Any]) -> None:
        if self.ws.subprotocol == MSGPACK:
            await self.ws.send(msgpack.packb(msg))
        else:
            await self.ws.send(json.dumps(msg))

    async def error(self, msg: dict[str, Any], code: str, text: str, **extra: Any) -> None:
        out = {"type": "error", "code": code, "message": text, **extra}
        if "id" in msg and self.server.echo_ids:
            out["id"] = msg["id"]
        await self.send(out)

    async def handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            await self.on_generate(msg)
        elif kind in ("stop", "pause", "resume", "close"):
            session = self.server.sessions.get(msg.get("session", ""))
            if session is None or session.token != msg.get("token"):
                await self.error(msg, "not_found", "no such session")
                return
            await getattr(self, f"on_{kind}")(msg, session)
        else:
            await self.error(msg, "bad_request", f"unknown type {kind!r}")

    async def on_generate(self, msg: dict[str, Any]) -> None:
        params = msg.get("params") or {}
        if set(params) - KNOWN_PARAMS:
            await self.error(msg, "bad_request", "unknown params")
            return
        prompt = msg.get("prompt") or msg.get("messages", [{}])[-1].get("content", "")
        if prompt == "BUSY":
            await self.error(msg, "overloaded", "queue full", retry_after=1.5)
            return
        session = await self._session_for(msg)
        if session is None:
            return
        turn = FakeTurn(len(session.turns) + 1, int(params.get("max_new_tokens", 8)))
        turn.fail = prompt == "FAIL"
        session.turns.append(turn)
        answer: dict[str, Any] = {"type": "session", "session": session.sid}
        answer.update(token=session.token, turn=turn.number)
        if self.server.echo_ids and "id" in msg:
            answer["id"] = msg["id"]
        await self.send(answer)
        self.server.spawn(self.server.generate(turn))
        self.follow(session, turn, 0)

    async def _session_for(self, msg: dict[str, Any]) -> FakeSession | None:
        if "session" not in msg:
            sid = f"s{next(self.server._ids)}"
            created = FakeSession(sid, secrets.token_hex(8))
            self.server.sessions[sid] = created
            return created
        session = self.server.sessions.get(msg["session"])
        if session is None or session.token != msg.get("token"):
            await self.error(msg, "not_found", "no such session")
            return None
        if session.turns and not session.turns[-1].finished:
            await self.error(msg, "conflict", "a turn is running", session=session.sid)
            return None
        return session

    async def on_stop(self, msg: dict[str, Any], session: FakeSession) -> None:
        turn = session.turns[-1]
        turn.want_stop = True
        turn.unpaused.set()

    async def on_pause(self, msg: dict[str, Any], session: FakeSession) -> None:
        session.turns[-1].want_pause = True

    async def on_resume(self, msg: dict[str, Any], session: FakeSession) -> None:
        number = msg.get("turn", len(session.turns))
        if not 1 <= number <= len(session.turns):
            await self.error(msg, "not_found", "no such turn")
            return
        turn = session.turns[number - 1]
        turn.paused = False
        turn.unpaused.set()
        after = max(0, int(msg.get("after", 0)) - self.server.replay_overlap)
        self.follow(session, turn, after)

    async def on_close(self, msg: dict[str, Any], session: FakeSession) -> None:
        for turn in session.turns:
            turn.want_stop = True
            turn.unpaused.set()
        del self.server.sessions[session.sid]

    # --- feeds ---------------------------------------------------------------------

    def follow(self, session: FakeSession, turn: FakeTurn, after: int) -> None:
        old = self.feeds.pop(session.sid, None)
        if old is not None:
            old.cancel()
        self.feeds[session.sid] = self.server.spawn(self.feed(session, turn, after))

    async def feed(self, session: FakeSession, turn: FakeTurn, after: int) -> None:
        index = 0
        with contextlib.suppress(ConnectionClosed):
            while True:
                while index < len(turn.events):
                    event = turn.events[index]
                    index += 1
                    stale = index < len(turn.events) or not turn.paused
                    replayed_pause = event["type"] == "paused" and stale
                    if event["seq"] <= after and event["type"] == "delta" or replayed_pause:
                        continue
                    await self.emit(session, turn, event)
                    if event["type"] == "done":
                        return
                await turn.changed.wait()

    async def emit(self, session: FakeSession, turn: FakeTurn, event: dict[str, Any]) -> None:
        msg = {**event, "session": session.sid, "turn": turn.number}
        copies = 2 if self.server.duplicate_deltas and event["type"] == "delta" else 1
        for _ in range(copies):
            await self.send(msg)
        if event["type"] != "delta":
            return
        self.sent_deltas += 1
        if self.cut_after is not None and self.sent_deltas >= self.cut_after:
            # A network cut, not a close handshake: the client sees an error.
            assert self.ws.transport is not None
            self.ws.transport.abort()
            raise ConnectionClosed(None, None)


@pytest.fixture
async def fake_server() -> AsyncIterator[FakeServer]:
    server = await FakeServer().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def keyed_server() -> AsyncIterator[FakeServer]:
    server = await FakeServer(api_key="sekret").start()
    try:
        yield server
    finally:
        await server.stop()


class ThreadedServer:
    """A FakeServer on its own loop in a thread, for blocking (sync) clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: FakeServer = self.call(FakeServer().start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def threaded_server() -> Iterator[FakeServer]:
    threaded = ThreadedServer()
    try:
        yield threaded.server
    finally:
        threaded.close()
