"""The Open Inference Protocol v2 REST routes (``/v2/...``) over the HTTP door's
session operations.

Each turn runs as every HTTP door's does (``counted.start``: an ``HttpPeer``
and its ``Handlers``), so the limits, the backpressure and the refusals are
theirs; ``oip.py`` only names and shapes what is sent. A stream's events are
numbered by count (``id: N``), and ``Last-Event-ID: N`` (or
``X-Wsinfer-Received: N``) with the session headers resumes it after its N-th
event (``counted.rejoin``). The access checks (API key, origin, host) ran
before any route, in ``HttpApp``. The gRPC door (``wsinfer/grpc_door.py``) answers
with the same functions (``served_model``, ``model_metadata``, ``unhealthy``,
``responses``, ``whole``), in protobuf rather than JSON.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from websockets.datastructures import Headers
from websockets.http11 import Request

from wsinfer import __version__
from wsinfer.access import one_header
from wsinfer.http import counted
from wsinfer.http.connection import HttpRequest, HttpResponse
from wsinfer.http.oip import (
    CHAT_INPUT,
    OUTPUT,
    PROMPT_INPUTS,
    OipError,
    OipRequest,
    OipTurn,
    not_found,
    parse_infer_request,
)
from wsinfer.http.openai import (
    LEGACY_MODEL_NAME,
    SESSION_HEADER,
    SSE_KEEPALIVE,
    TOKEN_HEADER,
    failure,
    sse,
    sse_comment,
)
from wsinfer.http.peer import KEEPALIVE_S, HttpPeer

if TYPE_CHECKING:
    from wsinfer.http.host import Handler, RouteHost
    from wsinfer.services import FrontendServices

MODEL = r"/v2/models/(?P<name>[^/]+)"
# What a v2 stream is made of, whatever carries it: a delta's response (its count),
# a pause, a stretch of silence (KEEPALIVE_S), the closing response, a failure.
Kind = Literal["event", "paused", "idle", "done", "error"]


def is_oip(path: str) -> bool:
    """Whether ``HttpApp``'s route table, rather than the plain routes, serves it."""
    return path == "/v2" or path.startswith("/v2/")


class OipRoutes:
    def __init__(self, app: RouteHost) -> None:
        self.app = app
        self.frontend = app.frontend

    def routes(self) -> list[tuple[re.Pattern[str], dict[str, Handler]]]:
        table: list[tuple[str, str, Handler]] = [
            (r"/v2", "GET", self.server),
            (r"/v2/health/live", "GET", self.live),
            (r"/v2/health/ready", "GET", self.ready),
            (MODEL, "GET", self.metadata),
            (MODEL + "/ready", "GET", self.model_ready),
            (MODEL + "/(?P<how>infer|generate)", "POST", self.infer),
            (MODEL + "/(?P<how>infer|generate)_stream", "POST", self.stream),
        ]
        wrap = lambda handler: counted.answering(self.app, OipError, handler)  # noqa: E731
        return [(re.compile(path), {method: wrap(h)}) for path, method, h in table]

    # --- metadata and health ----------------------------------------------------------

    async def server(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse.json(200, {"name": "wsinfer", "version": __version__, "extensions": []})

    async def live(self, request: HttpRequest) -> HttpResponse:
        """This frontend answers: it is live (whether it can serve is ``ready``)."""
        return HttpResponse.json(200, {"live": True})

    async def ready(self, request: HttpRequest) -> HttpResponse:
        why = await unhealthy(self.frontend, request.headers)
        if why:
            return OipError(503, why, "engine_unavailable").response()
        return HttpResponse.json(200, {"ready": True})

    async def metadata(self, request: HttpRequest, name: str) -> HttpResponse:
        return HttpResponse.json(200, model_metadata(self._model(name)))

    async def model_ready(self, request: HttpRequest, name: str) -> HttpResponse:
        model = self._model(name)
        why = await unhealthy(self.frontend, request.headers)
        if why:
            return OipError(503, why, "engine_unavailable").response()
        return HttpResponse.json(200, {"name": model, "ready": True})

    def _model(self, name: str) -> str:
        return served_model(self.frontend, name)

    # --- turns ------------------------------------------------------------------------

    async def infer(self, request: HttpRequest, name: str, how: str) -> HttpResponse:
        return await self._turn(request, name, stream=False)

    async def stream(self, request: HttpRequest, name: str, how: str) -> HttpResponse:
        return await self._turn(request, name, stream=True)

    def _parse(self, request: HttpRequest, session: str | None, token: str | None) -> OipRequest:
        length = one_header(request.headers, "Inference-Header-Content-Length")
        limits = self.frontend.config.limits
        return parse_infer_request(request.body, length, limits, session, token)

    async def _turn(self, request: HttpRequest, name: str, stream: bool) -> HttpResponse:
        model = self._model(name)
        session = one_header(request.headers, SESSION_HEADER)
        token = one_header(request.headers, TOKEN_HEADER)
        after = counted.received(request, OipError)
        if after is not None:
            if not stream:
                raise OipError(400, "a stream resumes on infer_stream or generate_stream only")
            return await self._resume(request, model, session, token, after)
        ask = self._parse(request, session, token)
        peer, accepted = await counted.start(self.app, ask.generate)
        turn = OipTurn(model, accepted["session"], accepted["turn"], ask.id, ask.shape, ask.flat)
        headers = counted.session_headers(accepted["session"], accepted["token"], turn.turn)
        if stream:
            return self._sse(peer, turn, headers, after=0)
        try:
            answer = await self._whole(peer, turn)
        except counted.DoorError as exc:
            return exc.response(headers)
        finally:
            self.app.close_peer(peer)
        return HttpResponse.json(200, answer, headers)

    async def _resume(
        self, request: HttpRequest, model: str, session: str | None, token: str | None, after: int
    ) -> HttpResponse:
        """Follow the session's latest turn after its ``after``-th event. A body, if
        sent, is checked and gives the responses their ``id`` and shape; the turn
        draws as it was asked to."""
        if not session or not token:
            message = f"a resume needs the {SESSION_HEADER} and {TOKEN_HEADER} headers"
            raise OipError(400, message)
        ask = self._parse(request, None, None) if request.body.strip() else None
        peer, number = await counted.rejoin(self.app, session, token, after, OipError)
        shape, flat = (ask.shape, ask.flat) if ask else ([1], False)
        turn = OipTurn(model, session, number, ask.id if ask else None, shape, flat)
        return self._sse(peer, turn, counted.session_headers(session, token, number), after)

    def _sse(
        self, peer: HttpPeer, turn: OipTurn, headers: list[tuple[str, str]], after: int
    ) -> HttpResponse:
        cleanup = lambda: self.app.close_peer(peer)  # noqa: E731
        return self.app.sse_answer(self._events(peer, turn, after), headers, cleanup)

    async def _events(self, peer: HttpPeer, turn: OipTurn, count: int) -> AsyncIterator[bytes]:
        """Each delta an event whose ``id`` is its count; the ``done`` a closing event
        (no text, no ``id``: nothing to resume after); a failure ``{"error"}``."""
        async for kind, number, body in responses(peer, turn, count):
            if kind == "event":
                yield sse(body, number)
            elif kind == "paused":
                yield sse_comment(f"paused after event {number}")
            elif kind == "idle":
                yield SSE_KEEPALIVE
            else:  # the done's response, or a failure's body: the last event
                yield sse(body)

    async def _whole(self, peer: HttpPeer, turn: OipTurn) -> dict[str, Any]:
        return await whole(peer, turn)


# --- what the REST and gRPC doors both answer with --------------------------------------


def served_model(frontend: FrontendServices, name: str) -> str:
    """The served model's name or ``wsinfer`` (the id of earlier versions), echoed
    as the request named it; another is the protocol's 404."""
    if name not in (frontend.config.model_name, LEGACY_MODEL_NAME):
        raise not_found(name)
    return name


def model_metadata(model: str) -> dict[str, Any]:
    strings = {"datatype": "BYTES", "shape": [-1], "parameters": {"content_type": "str"}}
    inputs = [{"name": n, **strings} for n in sorted({*PROMPT_INPUTS, CHAT_INPUT})]
    return {
        "name": model,
        "versions": [],
        "platform": "wsinfer",
        "inputs": inputs,
        "outputs": [{"name": OUTPUT, **strings}],
    }


async def unhealthy(frontend: FrontendServices, headers: Headers) -> str | None:
    """None when ``/healthz`` is 200 (Redis and an engine answer), else why not."""
    answer = await frontend.routes.answer(Request("/healthz", headers))
    if answer is not None and answer.status_code == 200:
        return None
    return (bytes(answer.body or b"").decode().strip() if answer else "") or "unhealthy"


async def responses(
    peer: HttpPeer, turn: OipTurn, count: int
) -> AsyncIterator[tuple[Kind, int, Any]]:
    """The turn's stream after its ``count``-th event, as (kind, count, body): each
    delta an ``event``, its response numbered by count; then the ``done``'s closing
    response (no text), or a failure's ``{"error"}`` body, last."""
    while True:
        messages = await peer.messages(KEEPALIVE_S)
        if not messages:
            yield "idle", count, None
        for message in messages:
            failed = failure(message)
            if failed is not None:
                yield "error", count, OipError.from_openai(failed).body()
                return
            if message["type"] == "delta":
                count += 1
                yield "event", count, turn.event(message)
            elif message["type"] == "paused":
                yield "paused", count, None
            elif message["type"] == "done":
                yield "done", count, turn.last("", message)
                return


async def whole(peer: HttpPeer, turn: OipTurn) -> dict[str, Any]:
    """Wait for the turn's ``done`` (through pauses: a paused turn may be resumed)."""
    text: list[str] = []
    while True:
        for message in await peer.messages(KEEPALIVE_S):
            failed = failure(message)
            if failed is not None:
                raise OipError.from_openai(failed)
            if message["type"] == "delta":
                text.append(message["text"])
            elif message["type"] == "done":
                return turn.last("".join(text), message)
