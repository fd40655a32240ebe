"""A small stand-in for the wsinfer frontend, speaking protocol v1 (JSON).

It serves the chat page like the real frontend (``GET /``, ``GET /static/F``)
and generates a deterministic text, ``"w1 w2 w3 ..."``, one word per token at a
fixed pace, so the page's client logic (dedup by seq, resume after a drop,
error display) can be tested where the real model's timing or refusals are
hard to provoke. Generation runs independently of connections, as the
protocol requires; a connection only follows a session.
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

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.typing import Subprotocol

BROWSER_DIR = Path(__file__).resolve().parents[2] / "clients" / "browser"


def word_text(seq: int) -> str:
    """The stand-in model's output for token number ``seq`` (1-based)."""
    return f"w{seq} "


@dataclass
class Turn:
    number: int
    limit: int
    deltas: list[tuple[int, str]] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    paused: bool = False
    task: asyncio.Task[None] | None = None


@dataclass
class Session:
    sid: str
    token: str
    turns: list[Turn] = field(default_factory=list)
    followers: set[ServerConnection] = field(default_factory=set)


class StandIn:
    """The server state; ``refuse_next`` makes the next generate fail with an error."""

    def __init__(self, token_interval: float = 0.02) -> None:
        self.token_interval = token_interval
        self.sessions: dict[str, Session] = {}
        self.refuse_next: dict[str, Any] | None = None
        # Replay this many already-applied deltas on resume, as a lagging
        # frontend may: the client must drop them by seq.
        self.replay_overlap = 0
        # When set, every turn's deltas are these pieces (a Markdown answer cut
        # anywhere) instead of "w1 w2 ...".
        self.pieces: list[str] | None = None
        self.received: list[dict[str, Any]] = []
        self.server: Server | None = None
        self._ids = itertools.count(1)

    async def start(self, host: str = "127.0.0.1") -> int:
        self.server = await serve(
            self._handle,
            host,
            0,
            process_request=self._http,
            subprotocols=[Subprotocol("wsinfer.v1.json")],
        )
        return self.server.sockets[0].getsockname()[1]  # type: ignore[index, no-any-return]

    async def stop(self) -> None:
        for s in self.sessions.values():
            for t in s.turns:
                if t.task:
                    t.task.cancel()
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    # -- HTTP ------------------------------------------------------------------

    def _http(self, conn: ServerConnection, request: Request) -> Response | None:
        path_only = request.path.split("?", 1)[0]
        if path_only == "/v1/ws":
            return None
        if path_only == "/":
            name = "index.html"
        elif path_only.startswith("/static/"):
            name = path_only[len("/static/") :]
        else:
            name = ""
        path = (BROWSER_DIR / name).resolve()
        if not name or BROWSER_DIR not in path.parents or not path.is_file():
            return conn.respond(HTTPStatus.NOT_FOUND, "not found\n")
        ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if name.endswith((".js", ".mjs")):
            ctype = "text/javascript"
        body = path.read_bytes()
        headers = Headers(
            [
                ("Content-Type", f"{ctype}; charset=utf-8"),
                ("Content-Length", str(len(body))),
                ("Cache-Control", "no-store"),
            ]
        )
        return Response(200, "OK", headers, body)

    # -- WebSocket ---------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        try:
            async for raw in ws:
                msg = json.loads(raw)
                self.received.append(msg)
                await self._dispatch(ws, msg)
        finally:
            for s in self.sessions.values():
                s.followers.discard(ws)

    async def _send(self, ws: ServerConnection, msg: dict[str, Any]) -> None:
        # A dead follower is dropped when its handler ends.
        with contextlib.suppress(Exception):
            await ws.send(json.dumps(msg))

    async def _error(
        self, ws: ServerConnection, msg: dict[str, Any], code: str, **extra: Any
    ) -> None:
        err = {"type": "error", "code": code, "message": extra.pop("message", code), **extra}
        if "id" in msg:
            err["id"] = msg["id"]
        await self._send(ws, err)

    async def _dispatch(self, ws: ServerConnection, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            return await self._generate(ws, msg)
        session = self.sessions.get(msg.get("session", ""))
        if session is None or session.token != msg.get("token"):
            return await self._error(ws, msg, "not_found", session=msg.get("session"))
        turn = session.turns[-1]
        if kind == "stop":
            if turn.finish is None:
                await self._end(session, turn, "cancelled")
        elif kind == "pause":
            if turn.finish is None and not turn.paused:
                turn.paused = True
                await self._broadcast(session, self._paused(session, turn))
        elif kind == "resume":
            await self._resume(ws, session, msg)
        elif kind == "close":
            self.sessions.pop(session.sid, None)
        else:
            await self._error(ws, msg, "bad_request", message=f"unknown type {kind!r}")
        return None

    async def _generate(self, ws: ServerConnection, msg: dict[str, Any]) -> None:
        if self.refuse_next is not None:
            refusal, self.refuse_next = self.refuse_next, None
            return await self._error(ws, msg, **refusal)
        if "session" in msg:
            session = self.sessions.get(msg["session"])
            if session is None or session.token != msg.get("token"):
                return await self._error(ws, msg, "not_found", session=msg.get("session"))
            if session.turns[-1].finish is None:
                return await self._error(ws, msg, "conflict", session=session.sid)
        else:
            session = Session(sid=f"s{next(self._ids)}", token=secrets.token_hex(8))
            self.sessions[session.sid] = session
        limit = int((msg.get("params") or {}).get("max_new_tokens", 50))
        if self.pieces is not None:
            limit = len(self.pieces)
        turn = Turn(number=len(session.turns) + 1, limit=limit)
        session.turns.append(turn)
        session.followers.add(ws)
        reply = {
            "type": "session",
            "session": session.sid,
            "token": session.token,
            "turn": turn.number,
        }
        if "id" in msg:
            reply["id"] = msg["id"]
        await self._send(ws, reply)
        turn.task = asyncio.create_task(self._run(session, turn))
        return None

    async def _resume(self, ws: ServerConnection, session: Session, msg: dict[str, Any]) -> None:
        number = msg.get("turn", len(session.turns))
        if not 1 <= number <= len(session.turns):
            return await self._error(ws, msg, "not_found", session=session.sid)
        turn = session.turns[number - 1]
        session.followers.add(ws)
        after = max(0, int(msg.get("after", 0)) - self.replay_overlap)
        for seq, text in list(turn.deltas):
            if seq > after:
                await self._send(ws, self._delta(session, turn, seq, text))
        if turn.finish is not None:
            await self._send(ws, turn.finish)
        turn.paused = False
        return None

    async def _run(self, session: Session, turn: Turn) -> None:
        seq = 0
        while seq < turn.limit and turn.finish is None:
            await asyncio.sleep(self.token_interval)
            if turn.paused:
                continue
            seq += 1
            text = self.pieces[seq - 1] if self.pieces is not None else word_text(seq)
            turn.deltas.append((seq, text))
            await self._broadcast(session, self._delta(session, turn, seq, text))
        if turn.finish is None:
            await self._end(session, turn, "length")

    async def _end(self, session: Session, turn: Turn, reason: str) -> None:
        seq = turn.deltas[-1][0] if turn.deltas else 0
        turn.finish = {
            "type": "done",
            "session": session.sid,
            "turn": turn.number,
            "seq": seq,
            "finish_reason": reason,
            "usage": {"prompt_tokens": 3, "completion_tokens": seq, "cached_tokens": 0},
        }
        await self._broadcast(session, turn.finish)

    async def _broadcast(self, session: Session, msg: dict[str, Any]) -> None:
        for ws in list(session.followers):
            await self._send(ws, msg)

    @staticmethod
    def _delta(session: Session, turn: Turn, seq: int, text: str) -> dict[str, Any]:
        return {
            "type": "delta",
            "session": session.sid,
            "turn": turn.number,
            "seq": seq,
            "text": text,
        }

    def _paused(self, session: Session, turn: Turn) -> dict[str, Any]:
        seq = turn.deltas[-1][0] if turn.deltas else 0
        return {"type": "paused", "session": session.sid, "turn": turn.number, "seq": seq}
