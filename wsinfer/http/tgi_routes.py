"""TGI's native routes (``/generate``, ``/generate_stream``, ``POST /``, ``/info``,
``/health``) over the HTTP door's session operations.

Each turn runs as an OpenAI completion's does: an ``HttpPeer`` (the connection
protocol's exactly-once delivery by ``seq``) and ``Handlers`` (admission, the
queue, every Redis operation), so the limits, the backpressure and the refusals
are theirs; ``tgi.py`` only names and shapes what is sent. The access checks
(API key, origin, host) ran before any route, in ``HttpApp``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from websockets.http11 import Request

from wsinfer import __version__
from wsinfer.access import Denied, one_header
from wsinfer.handlers import to_protocol_error
from wsinfer.http.connection import HttpRequest, HttpResponse
from wsinfer.http.openai import (
    SESSION_HEADER,
    SSE_KEEPALIVE,
    TOKEN_HEADER,
    TURN_HEADER,
    OpenAIError,
)
from wsinfer.http.peer import KEEPALIVE_S, HttpPeer
from wsinfer.http.responses import loggable
from wsinfer.http.tgi import TgiError, TgiRequest, TgiTurn, parse_tgi_request, turn_failure
from wsinfer.messages import Resume
from wsinfer.sessions.schema import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_STRINGS,
    DeltaEvent,
    GenerationParams,
)

if TYPE_CHECKING:
    from wsinfer.http.host import Handler, RouteHost

# Paths outside /v1/ that are TGI's; ``/`` is TGI's only for POST (GET is the chat page).
TGI_PATHS = frozenset({"/generate", "/generate_stream", "/info", "/health"})
MAX_DIGITS = 18  # a seq; longer is no integer we could have sent


def is_tgi(method: str, path: str) -> bool:
    """Whether ``HttpApp``'s route table, rather than the plain routes, serves it."""
    return method == "POST" if path == "/" else path in TGI_PATHS


class TgiRoutes:
    def __init__(self, app: RouteHost) -> None:
        self.app = app
        self.frontend = app.frontend

    def routes(self) -> list[tuple[re.Pattern[str], dict[str, Handler]]]:
        return [
            (re.compile(r"/generate"), {"POST": self.generate}),
            (re.compile(r"/generate_stream"), {"POST": self.generate_stream}),
            (re.compile(r"/"), {"POST": self.compat}),
            (re.compile(r"/info"), {"GET": self.info}),
            (re.compile(r"/health"), {"GET": self.health}),
        ]

    # --- routes -----------------------------------------------------------------------

    async def generate(self, request: HttpRequest) -> HttpResponse:
        return await self._tgi(request, lambda: self._turn(request, stream=False))

    async def generate_stream(self, request: HttpRequest) -> HttpResponse:
        return await self._tgi(request, lambda: self._turn(request, stream=True))

    async def compat(self, request: HttpRequest) -> HttpResponse:
        """TGI's ``POST /``: a stream with ``"stream": true``, else as ``/generate``."""
        return await self._tgi(request, lambda: self._turn(request, stream=None))

    async def info(self, request: HttpRequest) -> HttpResponse:
        """TGI's ``Info``, as far as a frontend knows it: the model's context length
        is the engine's, which the frontend is not told (null)."""
        body = {
            "model_id": self.frontend.config.model_name,
            "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_best_of": 1,
            "max_stop_sequences": MAX_STOP_STRINGS,
            "max_input_tokens": None,
            "max_total_tokens": None,
            "max_new_tokens": MAX_NEW_TOKENS_LIMIT,
            "max_client_batch_size": 1,
            "router": "wsinfer",
            "version": __version__,
            "sha": None,
            "docker_label": None,
        }
        return HttpResponse.json(200, body)

    async def health(self, request: HttpRequest) -> HttpResponse:
        """200 when ``/healthz`` is (Redis and an engine answer), else TGI's 503."""
        answer = await self.frontend.routes.answer(Request("/healthz", request.headers))
        if answer is not None and answer.status_code == 200:
            return HttpResponse(200)
        why = bytes(answer.body or b"").decode().strip() if answer else "unhealthy"
        return _error_response(TgiError(503, why or "unhealthy", "healthcheck"))

    # --- turns ------------------------------------------------------------------------

    async def _tgi(
        self, request: HttpRequest, run: Callable[[], Awaitable[HttpResponse]]
    ) -> HttpResponse:
        """``run``'s answer, or its refusal in TGI's shape, logged as ``HttpApp`` logs."""
        try:
            return await run()
        except TgiError as exc:
            return self._refused(exc, request)
        except OpenAIError as exc:
            return self._refused(TgiError.from_openai(exc), request)
        except Denied as exc:  # a repeated single header
            return self._refused(TgiError(422, exc.message, "validation"), request)
        except Exception as exc:
            error = to_protocol_error(exc)
            cause = error.__cause__ if isinstance(error.__cause__, Exception) else exc
            self.frontend.log_failure(cause, error, loggable(request.target))
            return _error_response(TgiError.from_openai(OpenAIError.from_wsinfer(error)))

    def _refused(self, exc: TgiError, request: HttpRequest) -> HttpResponse:
        if exc.status < 500:
            self.frontend.refused(exc.error_type, path=loggable(request.target))
        else:
            self.frontend.log_limited("warning", "request failed", code=exc.error_type)
        return _error_response(exc)

    async def _turn(self, request: HttpRequest, stream: bool | None) -> HttpResponse:
        session = one_header(request.headers, SESSION_HEADER)
        token = one_header(request.headers, TOKEN_HEADER)
        after = one_header(request.headers, "Last-Event-ID") or request.query.get("after")
        if after is not None:
            if stream is not True:
                raise TgiError(422, "a stream resumes on /generate_stream only", "validation")
            return await self._resume(request, session, token, _seq(after))
        config = self.frontend.config
        ask = parse_tgi_request(request.body, config.limits, session, token, stream)
        peer = self.app.open_peer()
        try:
            await peer.handlers.handle(ask.generate)
            accepted = peer.accepted()
        except BaseException:
            self.app.close_peer(peer)
            raise
        headers = _headers(accepted["session"], accepted["token"], accepted["turn"])
        turn = TgiTurn(ask.details, ask.inputs if ask.full_text else "", ask.generate.params)
        if ask.stream:
            return self._sse(peer, turn, headers)
        try:
            answer = await self._whole(peer, turn)
        except TgiError as exc:
            return _error_response(exc, headers)
        finally:
            self.app.close_peer(peer)
        return HttpResponse.json(200, answer, headers)

    async def _resume(
        self, request: HttpRequest, session: str | None, token: str | None, after: int
    ) -> HttpResponse:
        """Follow the session's latest turn from after ``after`` (a paused turn goes
        on). A body, if sent, is checked and says how to answer (``details``,
        ``return_full_text``); the turn draws as it was asked to."""
        if not session or not token:
            message = f"a resume needs the {SESSION_HEADER} and {TOKEN_HEADER} headers"
            raise TgiError(422, message, "validation")
        ask = None
        if request.body.strip():
            ask = parse_tgi_request(request.body, self.frontend.config.limits, None, None, True)
        store = self.frontend.store
        info = await store.info(session, token)
        _, turn_input = await store.turn_record(session, info.turn)
        params = turn_input.params if turn_input else GenerationParams()
        prompt = (turn_input.prompt if turn_input else None) or ""
        events, _ = await store.read_turn(session, info.turn)
        before = "".join(e.text for e in events if isinstance(e, DeltaEvent) and e.seq <= after)
        turn = _resumed(ask, prompt, params, before)
        peer = self.app.open_peer()
        try:
            await peer.handlers.handle(Resume(None, session, token, after, info.turn))
        except BaseException:
            self.app.close_peer(peer)
            raise
        return self._sse(peer, turn, _headers(session, token, info.turn))

    def _sse(self, peer: HttpPeer, turn: TgiTurn, headers: list[tuple[str, str]]) -> HttpResponse:
        cleanup = lambda: self.app.close_peer(peer)  # noqa: E731
        return self.app.sse_answer(self._events(peer, turn), headers, cleanup)

    async def _events(self, peer: HttpPeer, turn: TgiTurn) -> AsyncIterator[bytes]:
        while True:
            messages = await peer.messages(KEEPALIVE_S)
            if not messages:
                yield SSE_KEEPALIVE
            for message in messages:
                data = turn.sse_for(message)
                if data:
                    yield data
                if message["type"] in ("done", "error"):
                    return

    async def _whole(self, peer: HttpPeer, turn: TgiTurn) -> dict[str, Any]:
        """Wait for the turn's ``done`` (through pauses: a paused turn may be resumed)."""
        text: list[str] = []
        entries: list[dict[str, Any]] = []
        while True:
            for message in await peer.messages(KEEPALIVE_S):
                failed = turn_failure(message)
                if failed is not None:
                    raise failed
                if message["type"] == "delta":
                    text.append(message["text"])
                    entries += message.get("logprobs") or ()
                elif message["type"] == "done":
                    return turn.whole("".join(text), message, entries)


def _resumed(ask: TgiRequest | None, prompt: str, params: GenerationParams, before: str) -> TgiTurn:
    details = ask.details if ask else False
    full_text = ask.full_text if ask else False
    return TgiTurn(details, prompt if full_text else "", params, before)


def _headers(session: str, token: str, turn: int) -> list[tuple[str, str]]:
    """The session, its resume token and the turn, as the OpenAI door names them."""
    return [(SESSION_HEADER, session), (TOKEN_HEADER, token), (TURN_HEADER, str(turn))]


def _error_response(exc: TgiError, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    return HttpResponse.json(exc.status, exc.body(), [*exc.headers, *(headers or [])])


def _seq(value: str) -> int:
    # ASCII digits only ("²".isdigit() is true), short enough to be a seq.
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS):
        message = "Last-Event-ID (or ?after=) must be a non-negative integer"
        raise TgiError(422, message, "validation")
    return int(value)
