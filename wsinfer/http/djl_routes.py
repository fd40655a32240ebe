"""DJL Serving's routes (``POST /predictions/{name}``, SageMaker's ``POST
/invocations`` and ``GET /ping``) over the HTTP door's session operations.

Each input's turn runs as every HTTP door's does (``counted.start``: an
``HttpPeer`` and its ``Handlers``), so the limits, the backpressure and the
refusals are theirs; ``djl.py`` only names and shapes what is sent. A batch is
a session per input, its lines merged by iteration: line N holds each input's
N-th delta ("" once that input's turn has ended). ``X-Wsinfer-Received: N``
with the sessions' headers resumes after line N (``counted.rejoin``, per
session). The access checks (API key, origin, host) ran before any route, in
``HttpApp``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from websockets.http11 import Request

from wsinfer.access import one_header
from wsinfer.contract import SessionMessage
from wsinfer.http import counted
from wsinfer.http.connection import HttpRequest, HttpResponse
from wsinfer.http.djl import DjlError, error_line, line, not_found, parse_djl_request
from wsinfer.http.openai import LEGACY_MODEL_NAME, SESSION_HEADER, TOKEN_HEADER, failure
from wsinfer.http.peer import HttpPeer, merged_messages

if TYPE_CHECKING:
    from wsinfer.http.host import Handler, RouteHost

CONTENT_TYPE = "application/jsonlines"


def is_djl(path: str) -> bool:
    """Whether ``HttpApp``'s route table, rather than the plain routes, serves it."""
    return path in ("/invocations", "/ping") or path.startswith("/predictions/")


class DjlRoutes:
    def __init__(self, app: RouteHost) -> None:
        self.app = app
        self.frontend = app.frontend

    def routes(self) -> list[tuple[re.Pattern[str], dict[str, Handler]]]:
        predict = counted.answering(self.app, DjlError, self._predict)
        return [
            (re.compile(r"/predictions/(?P<name>[^/]+)"), {"POST": predict}),
            (re.compile(r"/invocations"), {"POST": predict}),
            (re.compile(r"/ping"), {"GET": self.ping}),
        ]

    async def ping(self, request: HttpRequest) -> HttpResponse:
        """200 when ``/healthz`` is (Redis and an engine answer), else DJL's 503."""
        answer = await self.frontend.routes.answer(Request("/healthz", request.headers))
        if answer is not None and answer.status_code == 200:
            return HttpResponse.json(200, {"status": "Healthy"})
        why = bytes(answer.body or b"").decode().strip() if answer else ""
        return DjlError(503, why or "unhealthy", "engine_unavailable").response()

    async def _predict(self, request: HttpRequest, name: str | None = None) -> HttpResponse:
        if name is not None and name not in (self.frontend.config.model_name, LEGACY_MODEL_NAME):
            raise not_found(name)
        sessions = _listed(one_header(request.headers, SESSION_HEADER))
        tokens = _listed(one_header(request.headers, TOKEN_HEADER))
        after = counted.received(request, DjlError)
        if after is not None:
            return await self._resume(request, sessions, tokens, after)
        if len(sessions) > 1 or len(tokens) > 1:
            raise DjlError(400, "a request continues one session (a resume follows several)")
        session = sessions[0] if sessions else None
        token = tokens[0] if tokens else None
        ask = parse_djl_request(request.body, self.frontend.config.limits, session, token)
        peers: list[HttpPeer] = []
        started: list[SessionMessage] = []
        try:
            for generate in ask.generates:
                peer, accepted = await counted.start(self.app, generate)
                peers.append(peer)
                started.append(accepted)
        except BaseException:
            self._close(peers)
            await counted.forget(self.app, [] if session else started)
            raise
        turns = [(a["session"], a["token"], a["turn"]) for a in started]
        return self._stream(peers, turns)

    async def _resume(
        self, request: HttpRequest, sessions: list[str], tokens: list[str], after: int
    ) -> HttpResponse:
        """Follow each session's latest turn after its part of line ``after``. A body,
        if sent, is checked; the turns draw as they were asked to."""
        if not sessions or len(sessions) != len(tokens):
            message = f"a resume needs the {SESSION_HEADER} and {TOKEN_HEADER} headers, alike"
            raise DjlError(400, message)
        if request.body.strip():
            parse_djl_request(request.body, self.frontend.config.limits, None, None)
        peers: list[HttpPeer] = []
        turns = []
        try:
            for session, token in zip(sessions, tokens, strict=True):
                peer, turn = await counted.rejoin(self.app, session, token, after, DjlError)
                peers.append(peer)
                turns.append((session, token, turn))
        except BaseException:
            self._close(peers)
            raise
        return self._stream(peers, turns)

    def _stream(self, peers: list[HttpPeer], turns: list[tuple[str, str, int]]) -> HttpResponse:
        readers: list[asyncio.Task[None]] = []

        def close() -> None:
            for reader in readers:
                reader.cancel()
            self._close(peers)

        names = counted.session_headers(
            ", ".join(t[0] for t in turns),
            ", ".join(t[1] for t in turns),
            ", ".join(str(t[2]) for t in turns),
        )
        head = [("Content-Type", CONTENT_TYPE), ("Cache-Control", "no-store")]
        head.append(("X-Accel-Buffering", "no"))  # nginx: pass each line on at once
        return HttpResponse(200, [*head, *names], stream=_lines(peers, readers), cleanup=close)

    def _close(self, peers: list[HttpPeer]) -> None:
        for peer in peers:
            self.app.close_peer(peer)


async def _lines(peers: list[HttpPeer], readers: list[asyncio.Task[None]]) -> AsyncIterator[bytes]:
    """The inputs' deltas merged by iteration: a line once every input has its next
    delta or has ended; the end once every turn has. A failed turn ends the stream
    with DJL's error as the last line. ``readers`` gets the tasks that follow the
    peers, for the response's cleanup to cancel."""
    arrivals = merged_messages(peers, readers)
    pending: list[list[str]] = [[] for _ in peers]  # texts not on a line yet
    ended = [False] * len(peers)
    try:
        while not all(ended) or any(pending):
            if all(ended) or all(p or e for p, e in zip(pending, ended, strict=True)):
                yield line([p.pop(0) if p else "" for p in pending])
                continue
            index, messages = await arrivals.get()
            for message in messages:
                failed = failure(message)
                if failed is not None:
                    yield error_line(DjlError.from_openai(failed))
                    return
                if message["type"] == "delta":
                    pending[index].append(message["text"])
                elif message["type"] == "done":
                    ended[index] = True
    finally:
        for reader in readers:
            reader.cancel()


def _listed(value: str | None) -> list[str]:
    """A header's comma-separated list (a batch's sessions, tokens)."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else []
