"""The scripted stand-in for the wsinfer frontend, for every client test.

One server for the Python client tests and the browser tests: a real
websockets server on 127.0.0.1 speaking protocol v1 (both subprotocols, ids,
sessions that outlive connections, resume with ``after`` answered by
``session``, attach on stop/pause, the ``status`` of ``session`` answers, and
a repeated
``generate`` with the same ``idempotency_key`` answering the turn it already
started). Its model "generates" ``w1 w2 ...`` (or ``pieces``) on a timer, so
any gap or repeat in a client's text shows at once. With ``serve_files`` it
also serves the chat page like the real frontend (``GET /``, ``/static/F``).

Knobs make it misbehave on purpose, as the real server cannot on demand: cut
connections after N deltas (``cut_plan``), take a generate and cut before
answering it (``drop_answers``), refuse handshakes, refuse the next generate
with an error, replay deltas the client already has, send each delta twice.
The prompt ``FAIL`` makes a turn end with an engine error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import mimetypes
import secrets
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import msgpack
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

JSON = "wsinfer.v1.json"
MSGPACK = "wsinfer.v1.msgpack"
BROWSER_DIR = Path(__file__).resolve().parents[2] / "clients" / "browser"
KNOWN_PARAMS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
    "stop",
}
GENERATE_FIELDS = {
    "type",
    "id",
    "messages",
    "prompt",
    "session",
    "token",
    "params",
    "idempotency_key",
}


def word_text(seq: int) -> str:
    """The stand-in model's output for token number ``seq`` (1-based)."""
    return f"w{seq} "


@dataclass
class StandInTurn:
    number: int
    limit: int
    budget: int = 0  # tokens a ``continue`` adds
    fail: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    finished: bool = False
    paused: bool = False
    want_stop: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    unpaused: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> str:
        return "done" if self.finished else "paused" if self.paused else "running"

    def push(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self.changed.set()
        self.changed = asyncio.Event()


@dataclass
class StandInSession:
    sid: str
    token: str
    turns: list[StandInTurn] = field(default_factory=list)


class StandIn:
    """The server; ``await StandIn().start()``, then ``.url`` (and ``.port``)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        delay: float = 0.005,
        default_tokens: int = 8,
        serve_files: bool = False,
    ) -> None:
        self.api_key = api_key
        self.delay = delay
        self.default_tokens = default_tokens
        self.serve_files = serve_files
        self.subprotocols = [MSGPACK, JSON]
        self.sessions: dict[str, StandInSession] = {}
        self.keys: dict[str, tuple[StandInSession, StandInTurn]] = {}  # idempotency keys
        self.received: list[dict[str, Any]] = []
        self.subprotocols_seen: list[str | None] = []
        self.cut_plan: list[int] = []  # each new connection: cut after this many deltas
        self.drop_answers = 0  # take the next N generates, then cut instead of answering
        self.refuse_handshakes = 0  # answer the next N handshakes with HTTP 503
        self.refuse_generate: dict[str, Any] | None = None  # the next generate's error
        self.replay_overlap = 0  # on resume, resend this many deltas the client has
        self.duplicate_deltas = False
        # Whether it takes ``continue``; else it refuses it as a server older than
        # that message does (an unknown type).
        self.continues = False
        self.echo_ids = True
        self.pieces: list[str] | None = None  # every turn's deltas, instead of "w1 w2 ..."
        self.connections = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count(1)
        self._server: Server | None = None
        self.url = ""
        self.port = 0

    async def start(self) -> StandIn:
        self._server = await serve(
            self._handle,
            "127.0.0.1",
            0,
            process_request=self._process_request,
            select_subprotocol=self._select,
        )
        self.port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{self.port}/v1/ws"
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

    def generates(self) -> list[dict[str, Any]]:
        return [m for m in self.received if m.get("type") == "generate"]

    # --- handshake and files ------------------------------------------------------

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        if path != "/v1/ws":
            return self._file(conn, path)
        if self.refuse_handshakes > 0:
            self.refuse_handshakes -= 1
            return conn.respond(HTTPStatus.SERVICE_UNAVAILABLE, "busy\n")
        if self.api_key is not None:
            bearer = request.headers.get("Authorization") == f"Bearer {self.api_key}"
            if not bearer and f"token={self.api_key}" not in query.split("&"):
                return conn.respond(HTTPStatus.UNAUTHORIZED, "bad key\n")
        return None

    def _file(self, conn: ServerConnection, path: str) -> Response:
        name = "index.html" if path == "/" else path.removeprefix("/static/")
        target = (BROWSER_DIR / name).resolve()
        found = name != path and BROWSER_DIR in target.parents and target.is_file()
        if not (self.serve_files and found):
            return conn.respond(HTTPStatus.NOT_FOUND, "not found\n")
        ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if name.endswith((".js", ".mjs")):
            ctype = "text/javascript"
        body = target.read_bytes()
        headers = Headers(
            [
                ("Content-Type", f"{ctype}; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ]
        )
        return Response(200, "OK", headers, body)

    def _select(self, conn: ServerConnection, offered: Any) -> Subprotocol | None:
        for name in offered:
            if name in self.subprotocols:
                return Subprotocol(name)
        return None

    # --- connection ------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        self.subprotocols_seen.append(ws.subprotocol)
        conn = StandInConn(self, ws, self.cut_plan.pop(0) if self.cut_plan else None)
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

    def new_turn(self, session: StandInSession, msg: dict[str, Any]) -> StandInTurn:
        params = msg.get("params") or {}
        limit = int(params.get("max_new_tokens", self.default_tokens))
        length = len(self.pieces) if self.pieces else limit
        turn = StandInTurn(len(session.turns) + 1, length, budget=limit)
        turn.fail = (msg.get("prompt") or _last_content(msg)) == "FAIL"
        turn.unpaused.set()
        session.turns.append(turn)
        if "idempotency_key" in msg:
            self.keys[msg["idempotency_key"]] = (session, turn)
        self.spawn(self._generate(turn))
        return turn

    async def _generate(self, turn: StandInTurn) -> None:
        while turn.seq < turn.limit and not turn.want_stop:
            await turn.unpaused.wait()
            await asyncio.sleep(self.delay)
            if turn.paused or turn.want_stop:
                continue
            turn.seq += 1
            pieces = self.pieces or []
            text = pieces[turn.seq - 1] if turn.seq <= len(pieces) else word_text(turn.seq)
            turn.push({"type": "delta", "seq": turn.seq, "text": text})
        turn.finished = True
        turn.paused = False
        turn.push(self._done(turn))

    def _done(self, turn: StandInTurn) -> dict[str, Any]:
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


def _last_content(msg: dict[str, Any]) -> str:
    messages = msg.get("messages") or [{}]
    return str(messages[-1].get("content", ""))


class StandInConn:
    """One client connection: answers requests and runs one feed per followed session."""

    def __init__(self, server: StandIn, ws: ServerConnection, cut_after: int | None) -> None:
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

    def cut(self) -> None:
        """A network cut, not a close handshake: the client sees an error."""
        assert self.ws.transport is not None
        self.ws.transport.abort()
        raise ConnectionClosed(None, None)

    async def error(self, msg: dict[str, Any], code: str, text: str, **extra: Any) -> None:
        out = {"type": "error", "code": code, "message": text, **extra}
        if "id" in msg and self.server.echo_ids:
            out["id"] = msg["id"]
        await self.send(out)

    async def handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            await self.on_generate(msg)
        elif kind in ("stop", "pause", "resume", "close") or (
            kind == "continue" and self.server.continues
        ):
            session = self.server.sessions.get(msg.get("session", ""))
            if session is None or session.token != msg.get("token"):
                await self.error(msg, "not_found", "no such session", session=msg.get("session"))
                return
            await getattr(self, f"on_{kind}")(msg, session)  # (on_continue)
        else:
            await self.error(msg, "bad_request", f"unknown type {kind!r}")

    async def on_generate(self, msg: dict[str, Any]) -> None:
        refusal = self._refusal(msg)
        if refusal is not None:
            code, text, extra = refusal
            await self.error(msg, code, text, **extra)
            return
        repeat = self.server.keys.get(msg.get("idempotency_key", ""))
        if repeat is not None:  # the turn this very request started: attach to it
            await self.answer(msg, *repeat)
            return
        session = await self._session_for(msg)
        if session is None:
            return
        turn = self.server.new_turn(session, msg)
        if self.server.drop_answers > 0:
            self.server.drop_answers -= 1
            self.cut()
        await self.answer(msg, session, turn)

    def _refusal(self, msg: dict[str, Any]) -> tuple[str, str, dict[str, Any]] | None:
        """(code, message, extra fields) of the error this generate gets, if any."""
        if set(msg) - GENERATE_FIELDS:
            return "bad_request", f"unknown fields {set(msg) - GENERATE_FIELDS}", {}
        if set(msg.get("params") or {}) - KNOWN_PARAMS:
            return "bad_request", "unknown params", {}
        key = msg.get("idempotency_key", "x" * 16)
        if not isinstance(key, str) or not 16 <= len(key) <= 128:
            return "bad_request", "bad idempotency_key", {}
        refusal, self.server.refuse_generate = self.server.refuse_generate, None
        if refusal is None:
            return None
        extra = dict(refusal)
        code = extra.pop("code")
        return code, extra.pop("message", code), extra

    async def answer(
        self,
        msg: dict[str, Any],
        session: StandInSession,
        turn: StandInTurn,
        *,
        after: int = 0,
        status: str | None = None,
    ) -> None:
        """The ``session`` answer to a generate or resume; then follow the turn."""
        answer: dict[str, Any] = {"type": "session", "session": session.sid}
        answer.update(token=session.token, turn=turn.number, status=status or turn.status)
        if self.server.echo_ids and "id" in msg:
            answer["id"] = msg["id"]
        await self.send(answer)
        self.follow(session, turn, after)

    async def _session_for(self, msg: dict[str, Any]) -> StandInSession | None:
        if "session" not in msg:
            sid = f"s{next(self.server._ids)}"
            created = StandInSession(sid, secrets.token_hex(8))
            self.server.sessions[sid] = created
            return created
        session = self.server.sessions.get(msg["session"])
        if session is None or session.token != msg.get("token"):
            await self.error(msg, "not_found", "no such session", session=msg.get("session"))
            return None
        if session.turns and not session.turns[-1].finished:
            await self.error(msg, "conflict", "a turn is running", session=session.sid)
            return None
        return session

    async def on_stop(self, msg: dict[str, Any], session: StandInSession) -> None:
        turn = session.turns[-1]
        if not turn.finished:
            turn.want_stop = True
            turn.unpaused.set()
        self._attach(session, turn)

    async def on_pause(self, msg: dict[str, Any], session: StandInSession) -> None:
        turn = session.turns[-1]
        if not turn.finished and not turn.paused:
            turn.paused = True
            turn.unpaused.clear()
            turn.push({"type": "paused", "seq": turn.seq})
        self._attach(session, turn)

    async def on_resume(self, msg: dict[str, Any], session: StandInSession) -> None:
        number = msg.get("turn", len(session.turns))
        if not 1 <= number <= len(session.turns):
            await self.error(msg, "not_found", "no such turn", session=session.sid)
            return
        turn = session.turns[number - 1]
        status = turn.status
        if turn.paused and number == len(session.turns):
            turn.paused = False
            turn.unpaused.set()
            status = "queued"  # as the server says of a resumed paused turn
        after = max(0, int(msg.get("after", 0)) - self.server.replay_overlap)
        await self.answer(msg, session, turn, after=after, status=status)

    async def on_continue(self, msg: dict[str, Any], session: StandInSession) -> None:
        """Extend the latest turn, ended by length, by its budget again; answered
        as a resume. Its replay leaves out the ``done`` it went on past."""
        turn = session.turns[-1]
        ended = turn.events[-1] if turn.finished and turn.events else {}
        if ended.get("finish_reason") != "length" or msg.get("turn", turn.number) != turn.number:
            await self.error(msg, "conflict", "not a turn ended by length", session=session.sid)
            return
        turn.events.pop()
        turn.finished, turn.limit = False, turn.seq + turn.budget
        self.server.spawn(self.server._generate(turn))
        await self.answer(msg, session, turn, after=int(msg.get("after", 0)), status="queued")

    async def on_close(self, msg: dict[str, Any], session: StandInSession) -> None:
        for turn in session.turns:
            turn.want_stop = True
            turn.unpaused.set()
        del self.server.sessions[session.sid]

    # --- feeds ---------------------------------------------------------------------

    def _attach(self, session: StandInSession, turn: StandInTurn) -> None:
        """A stop or pause from a connection that does not follow attaches it, replaying nothing."""
        if session.sid not in self.feeds:
            self.follow(session, turn, turn.seq)

    def follow(self, session: StandInSession, turn: StandInTurn, after: int) -> None:
        old = self.feeds.pop(session.sid, None)
        if old is not None:
            old.cancel()
        self.feeds[session.sid] = self.server.spawn(self.feed(session, turn, after))

    async def feed(self, session: StandInSession, turn: StandInTurn, after: int) -> None:
        index = 0
        with contextlib.suppress(ConnectionClosed):
            while True:
                while index < len(turn.events):
                    event = turn.events[index]
                    index += 1
                    # A replay shows a pause only if the turn is paused now.
                    stale = index < len(turn.events) or not turn.paused
                    replayed_pause = event["type"] == "paused" and stale
                    if event["seq"] <= after and event["type"] == "delta" or replayed_pause:
                        continue
                    await self.emit(session, turn, event)
                    if event["type"] == "done":
                        return
                await turn.changed.wait()

    async def emit(self, session: StandInSession, turn: StandInTurn, event: dict[str, Any]) -> None:
        msg = {**event, "session": session.sid, "turn": turn.number}
        copies = 2 if self.server.duplicate_deltas and event["type"] == "delta" else 1
        for _ in range(copies):
            await self.send(msg)
        if event["type"] != "delta":
            return
        self.sent_deltas += 1
        if self.cut_after is not None and self.sent_deltas >= self.cut_after:
            self.cut()
