"""The HTTP routes: OpenAI chat completions, models, and the session routes.

Each route is an adapter over the same operations the WebSocket path runs:
an ``HttpPeer`` carries a ``Handlers`` (generate, resume, stop, pause, close)
and the connection protocol's exactly-once delivery by ``seq``. Paths outside
``/v1/`` (and ``/v1/ws`` without an upgrade) go to the frontend's existing
plain routes (``/healthz``, ``/metrics``, the chat page).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import h11
import structlog
from websockets.http11 import Request

from wsinfer.access import (
    CORS_METHODS,
    Denied,
    is_public,
    one_header,
    request_path,
    shorten,
)
from wsinfer.contract import (
    CLIENT_MESSAGES,
    CONTROL_ANSWERS,
    ClientMessageType,
    ServerMessageType,
    TurnStatus,
)
from wsinfer.handlers import to_protocol_error
from wsinfer.http.choices import ManyChoices
from wsinfer.http.completions import TextCompletion, parse_completion_request
from wsinfer.http.connection import HttpConnection, HttpRequest, HttpResponse
from wsinfer.http.djl_routes import DjlRoutes, is_djl
from wsinfer.http.host import Handler
from wsinfer.http.oip_routes import OipRoutes, is_oip
from wsinfer.http.openai import (
    LEGACY_MODEL_NAME,
    SESSION_HEADER,
    SSE_KEEPALIVE,
    TOKEN_HEADER,
    ChatRequest,
    Completion,
    OpenAIError,
    bad_request,
    ignored_headers,
    parse_chat_request,
    sse,
    sse_for,
    turn_error,
    turn_headers,
)
from wsinfer.http.peer import CONTROL_WAIT_S, KEEPALIVE_S, HttpPeer
from wsinfer.http.responses import loggable
from wsinfer.http.responses_routes import ResponsesRoutes
from wsinfer.http.session_history import session_messages
from wsinfer.http.tgi_routes import TgiRoutes, is_tgi
from wsinfer.messages import Resume, SessionCommand

if TYPE_CHECKING:
    from wsinfer.services import FrontendServices

log = structlog.get_logger("wsinfer.http")

# The session routes' controls: every message the contract declares a control of a turn.
_CONTROLS = "|".join(kind.value for kind, spec in CLIENT_MESSAGES.items() if spec.controls_turn)
MAX_DIGITS = 18  # a seq or turn number; longer is no integer we could have sent


class HttpApp:
    def __init__(self, frontend: FrontendServices) -> None:
        self.frontend = frontend
        self.peers: set[HttpPeer] = set()  # the frontend keeps their sessions watched
        self.connections: set[HttpConnection] = set()
        self.choices = ManyChoices(self)
        self.routes: list[tuple[re.Pattern[str], dict[str, Handler]]] = [
            (re.compile(r"/v1/chat/completions"), {"POST": self.chat_completions}),
            (re.compile(r"/v1/completions"), {"POST": self.completions}),
            *ResponsesRoutes(self).routes(),
            *TgiRoutes(self).routes(),
            *OipRoutes(self).routes(),
            *DjlRoutes(self).routes(),
            (re.compile(r"/v1/models"), {"GET": self.models}),
            (re.compile(r"/v1/models/(?P<model>[^/]+)"), {"GET": self.model}),
            (
                re.compile(r"/v1/sessions/(?P<session>\w+)"),
                {"GET": self.info, "DELETE": self.delete},
            ),
            (re.compile(r"/v1/sessions/(?P<session>\w+)/stream"), {"GET": self.stream}),
            (re.compile(r"/v1/sessions/(?P<session>\w+)/messages"), {"GET": self.messages}),
            (
                re.compile(rf"/v1/sessions/(?P<session>\w+)/(?P<action>{_CONTROLS})"),
                {"POST": self.control},
            ),
        ]

    # --- connections ------------------------------------------------------------------

    def take(
        self, transport: asyncio.Transport, raw: bytes, upgrade: Callable[[bytes], None]
    ) -> None:
        """A connection whose first request is plain HTTP: h11 serves it from here."""
        conn = HttpConnection(
            self,
            transport,
            h11.Connection(h11.SERVER),
            max_body=self.frontend.config.max_frame_bytes,
            max_outgoing=self.frontend.config.max_outgoing_bytes,
            request_rate=self.frontend.config.request_rate,
            upgrade=upgrade,
            on_close=self.connections.discard,
        )
        self.connections.add(conn)
        conn.start()
        conn.data_received(raw)

    def close(self) -> None:
        """Drop every HTTP connection: SSE clients reconnect (to any frontend) and resume."""
        for conn in list(self.connections):
            conn.transport.abort()

    def refuse(
        self, status: int, message: str, code: str, retry_after: float | None = None
    ) -> HttpResponse:
        return error_response(OpenAIError(status, message, code=code, retry_after=retry_after))

    # --- dispatch ---------------------------------------------------------------------

    async def handle(self, request: HttpRequest) -> HttpResponse:
        cors: list[tuple[str, str]] = []
        try:
            cors = self.frontend.access.cors(request.headers)
            response = await self._route(request)
        except Denied as exc:
            self.frontend.refused(exc.code, path=loggable(request.target))
            response = error_response(OpenAIError(exc.status, exc.message, code=exc.code))
        except OpenAIError as exc:
            self._log_refusal(exc, request)
            response = error_response(exc)
        except Exception as exc:  # every failure becomes an OpenAI-shaped error
            error = to_protocol_error(exc)
            cause = error.__cause__ if isinstance(error.__cause__, Exception) else exc
            self.frontend.log_failure(cause, error, loggable(request.target))
            response = error_response(OpenAIError.from_wsinfer(error))
        response.headers.extend(cors)  # a page may read errors too, not only answers
        return response

    def _log_refusal(self, exc: OpenAIError, request: HttpRequest) -> None:
        if exc.status < 500:
            self.frontend.refused(exc.code or "bad_request", path=loggable(request.target))
        else:
            self.frontend.log_limited("warning", "request failed", code=exc.code)

    async def _route(self, request: HttpRequest) -> HttpResponse:
        path = request_path(request.target)
        # The peers' own doors (TGI, Open Inference Protocol v2, DJL) live outside /v1/.
        tgi = is_tgi(request.method, path) or is_oip(path) or is_djl(path)
        if (not path.startswith("/v1/") or path == "/v1/ws") and not tgi:
            return await self._plain(request)
        access = self.frontend.access
        # A browser's preflight carries no credentials: it is answered before the key.
        access.check(request.headers, request.target, needs_key=request.method != "OPTIONS")
        if request.method == "OPTIONS":
            return HttpResponse(204, [("Allow", CORS_METHODS), *access.preflight()])
        # Only a client with the key learns which routes exist.
        for pattern, methods in self.routes:
            match = pattern.fullmatch(path)
            if match is None:
                continue
            if request.method not in methods:
                message = f"{request.method} is not allowed on {shorten(path)}"
                allow = [("Allow", ", ".join([*methods, "OPTIONS"]))]
                raise OpenAIError(405, message, code="method", headers=allow)
            return await methods[request.method](request, **match.groupdict())
        raise OpenAIError(404, f"no route {shorten(path)}", code="not_found")

    async def _plain(self, request: HttpRequest) -> HttpResponse:
        # HEAD as GET: the connection sends only the head (a monitor's health check).
        if request.method not in ("GET", "HEAD"):
            path = request_path(request.target)  # the key first: then what is not allowed
            public = is_public(path)
            self.frontend.access.check(request.headers, request.target, needs_key=not public)
            message = f"{request.method} is not allowed on {shorten(path)}"
            raise OpenAIError(405, message, code="method", headers=[("Allow", "GET, HEAD")])
        as_handshake = Request(request.target, request.headers)
        answer = await self.frontend.routes.answer(as_handshake)
        if answer is None:  # /v1/ws, authorized, but not a WebSocket handshake
            head = [("Upgrade", "websocket"), ("Content-Type", "text/plain")]
            return HttpResponse(426, head, b"upgrade required\n")
        headers = [(k, v) for k, v in answer.headers.raw_items() if k.lower() != "content-length"]
        return HttpResponse(answer.status_code, headers, bytes(answer.body or b""))

    # --- OpenAI routes ----------------------------------------------------------------

    async def models(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse.json(200, {"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest, model: str) -> HttpResponse:
        if model not in (self.frontend.config.model_name, LEGACY_MODEL_NAME):
            raise OpenAIError(404, f"The model {model!r} does not exist", code="model_not_found")
        return HttpResponse.json(200, self._model_card())

    def _model_card(self) -> dict[str, Any]:
        name = self.frontend.config.model_name
        return {"id": name, "object": "model", "created": 0, "owned_by": "wsinfer"}

    async def chat_completions(self, request: HttpRequest) -> HttpResponse:
        config = self.frontend.config
        session = one_header(request.headers, SESSION_HEADER)
        token = one_header(request.headers, TOKEN_HEADER)
        chat = parse_chat_request(request.body, config.limits, config.model_name, session, token)
        return await self._complete(chat, Completion)

    async def completions(self, request: HttpRequest) -> HttpResponse:
        """The legacy text completion: a raw-text session, otherwise as a chat completion."""
        config = self.frontend.config
        session = one_header(request.headers, SESSION_HEADER)
        token = one_header(request.headers, TOKEN_HEADER)
        text = parse_completion_request(
            request.body, config.limits, config.model_name, session, token
        )
        return await self._complete(text, TextCompletion)

    async def _complete(self, chat: ChatRequest, kind: type[Completion]) -> HttpResponse:
        if chat.n > 1:
            return await self.choices.complete(chat, kind)
        peer = self.open_peer()
        try:
            await peer.handlers.handle(chat.generate)
            accepted = peer.accepted()
            created = await self.created(accepted["session"], accepted["turn"])
        except BaseException:
            self.close_peer(peer)
            raise
        model = self.frontend.config.model_name
        completion = kind(accepted["session"], accepted["turn"], model, created)
        headers = [
            (TOKEN_HEADER, accepted["token"]),
            *turn_headers([completion]),
            *ignored_headers(chat.ignored),
        ]
        if chat.stream:
            return self._sse_response(peer, completion, headers, chat.include_usage, after=0)
        try:
            answer = await self.answer(peer, completion, chat.generate.params.logprobs)
        except OpenAIError as exc:
            return error_response(exc, headers)
        finally:
            self.close_peer(peer)
        return HttpResponse.json(200, answer, headers)

    async def answer(
        self, peer: HttpPeer, completion: Completion, asked_logprobs: bool = False
    ) -> dict[str, Any]:
        """Wait for the turn's ``done`` (through pauses: a paused turn may be resumed);
        the whole answer, or ``OpenAIError`` for a turn that failed."""
        text: list[str] = []
        logprobs: list[dict[str, Any]] | None = [] if asked_logprobs else None
        calls: list[dict[str, Any]] = []
        while True:
            for message in await peer.messages(KEEPALIVE_S):
                if message["type"] == "delta":
                    text.append(message["text"])
                    calls += message.get("tool_calls") or ()
                    if logprobs is not None:
                        logprobs += message.get("logprobs") or ()
                elif message["type"] == "done" and message["finish_reason"] == "error":
                    raise turn_error(message)
                elif message["type"] == "done":
                    return completion.whole("".join(text), message, logprobs, calls)

    def _sse_response(
        self,
        peer: HttpPeer,
        completion: Completion,
        headers: list[tuple[str, str]],
        include_usage: bool,
        after: int,
    ) -> HttpResponse:
        events = self._events(peer, completion, include_usage, after)
        return self.sse_answer(events, headers, lambda: self.close_peer(peer))

    def sse_answer(
        self,
        events: AsyncIterator[bytes],
        headers: list[tuple[str, str]],
        cleanup: Callable[[], None],
    ) -> HttpResponse:
        """An event stream; ``cleanup`` stops following its turns when it ends."""
        head = [("Content-Type", "text/event-stream; charset=utf-8"), ("Cache-Control", "no-store")]
        head.append(("X-Accel-Buffering", "no"))  # nginx: pass each event on at once
        return HttpResponse(200, [*head, *headers], stream=events, cleanup=cleanup)

    async def created(self, session: str, turn: int) -> int:
        """When the turn started, as recorded in Redis: one ``created`` for a
        completion or response however often, and wherever, it is read."""
        created = await self.frontend.store.turn_created(session, turn)
        return created or int(time.time())  # a turn started before this was recorded

    async def _events(
        self, peer: HttpPeer, completion: Completion, include_usage: bool, after: int
    ) -> AsyncIterator[bytes]:
        opening = completion.opening()
        if after == 0 and opening is not None:
            yield sse(opening, 0)
        while True:
            messages = await peer.messages(KEEPALIVE_S)
            if not messages:
                yield SSE_KEEPALIVE
            for message in messages:
                data = sse_for(completion, message, include_usage)
                if data:
                    yield data
                if message["type"] in ("done", "error"):
                    return

    # --- session routes -----------------------------------------------------------------

    async def stream(self, request: HttpRequest, session: str) -> HttpResponse:
        """Resume: the turn's deltas after ``Last-Event-ID``, then live (a paused turn goes on)."""
        token = _session_token(request)
        after = _non_negative(
            one_header(request.headers, "Last-Event-ID") or request.query.get("after"),
            "Last-Event-ID",
        )
        wanted = request.query.get("turn")
        info = await self.frontend.store.info(session, token)
        turn = _non_negative(wanted, "turn") if wanted else info.turn
        if turn < 1:
            raise bad_request("turn must be a positive integer", "turn")
        peer = self.open_peer()
        try:
            await peer.handlers.handle(Resume(None, session, token, after, turn))
        except BaseException:
            self.close_peer(peer)
            raise
        model, created = self.frontend.config.model_name, await self.created(session, turn)
        completion = _chunk_kind(request.query.get("object"))(session, turn, model, created)
        include_usage = request.query.get("include_usage", "").lower() in ("1", "true")
        headers = turn_headers([completion])
        return self._sse_response(peer, completion, headers, include_usage, after)

    async def info(self, request: HttpRequest, session: str) -> HttpResponse:
        info = await self.frontend.store.info(session, _session_token(request))
        return HttpResponse.json(200, _info_body(info.session, info.turn, info.status, info.seq))

    async def messages(self, request: HttpRequest, session: str) -> HttpResponse:
        after = _non_negative(request.query.get("after_turn"), "after_turn")
        store, token = self.frontend.store, _session_token(request)
        return HttpResponse.json(200, await session_messages(store, session, token, after))

    async def delete(self, request: HttpRequest, session: str) -> HttpResponse:
        await self.close_session(session, _session_token(request))
        return HttpResponse.json(200, {"id": session, "object": "session", "deleted": True})

    async def control(self, request: HttpRequest, session: str, action: str) -> HttpResponse:
        token = _session_token(request)
        kind = ClientMessageType(action)
        if CLIENT_MESSAGES[kind].rejoins:
            return await self._unpause(session, token, kind)
        peer = self.open_peer()
        try:
            command = SessionCommand(kind, None, session, token)
            await peer.handlers.handle(command)
            # A stop ends in done; a pause in paused, or done if the turn ended first.
            # (The replay may show an older pause of a turn resumed since: not the answer.)
            paused = ServerMessageType.PAUSED in CONTROL_ANSWERS[command.type]
            outcome = await peer.outcome(CONTROL_WAIT_S, paused=paused)
        finally:
            self.close_peer(peer)
        if outcome is None:  # the engine has not acted on it yet; it will
            return HttpResponse.json(202, {"session": session, "status": f"{action}_requested"})
        status = TurnStatus.PAUSED.value if outcome["type"] == "paused" else TurnStatus.DONE.value
        body = _info_body(session, outcome["turn"], status, outcome["seq"])
        if outcome["type"] == "done":
            body["finish_reason"] = outcome["finish_reason"]
        return HttpResponse.json(200, body)

    async def _unpause(
        self, session: str, token: str, kind: ClientMessageType = ClientMessageType.RESUME
    ) -> HttpResponse:
        """A control answered ``session`` (a resume: continue a paused turn), as
        on a WebSocket, through the plan (a turn resumed or stopped meanwhile by
        another is answered as it is), but without staying attached:
        ``GET .../stream`` attaches."""
        peer = self.open_peer()
        try:
            await peer.handlers.handle(Resume(None, session, token, type=kind))
            answer, seq = peer.rejoined()
        finally:
            self.close_peer(peer)
        return HttpResponse.json(200, _info_body(session, answer["turn"], answer["status"], seq))

    # --- peers ------------------------------------------------------------------------

    async def close_session(self, session: str, token: str) -> None:
        """The WebSocket ``close`` of ``session``, on a peer of its own."""
        peer = self.open_peer()
        try:
            await peer.handlers.handle(
                SessionCommand(ClientMessageType.CLOSE, None, session, token)
            )
        finally:
            self.close_peer(peer)

    def open_peer(self) -> HttpPeer:
        peer = HttpPeer(self.frontend)
        self.peers.add(peer)
        return peer

    def close_peer(self, peer: HttpPeer) -> None:
        peer.close()
        self.peers.discard(peer)


def error_response(exc: OpenAIError, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
    extra = [*exc.headers(), *(headers or [])]
    if exc.status == 401:
        extra.append(("WWW-Authenticate", "Bearer"))
    return HttpResponse.json(exc.status, exc.body(), extra)


def _info_body(session: str, turn: int, status: str, seq: int) -> dict[str, Any]:
    return {"session": session, "turn": turn, "status": status, "seq": seq}


def _session_token(request: HttpRequest) -> str:
    """The session's resume token: a header, or a query parameter for ``EventSource``."""
    token = one_header(request.headers, TOKEN_HEADER) or request.query.get("session_token")
    if not token:
        raise bad_request(f"the {TOKEN_HEADER} header (or ?session_token=) is required")
    return token


# The chunks a session's stream can speak: chat chunks unless a text completion's
# client asks for its own (any session's turns read either way).
_CHUNK_KINDS: dict[str, type[Completion]] = {
    "chat.completion.chunk": Completion,
    "text_completion": TextCompletion,
}


def _chunk_kind(wanted: str | None) -> type[Completion]:
    if not wanted:
        return Completion
    kind = _CHUNK_KINDS.get(wanted)
    if kind is None:
        choices = " or ".join(_CHUNK_KINDS)
        raise bad_request(f"object must be {choices}, not {shorten(wanted)!r}", "object")
    return kind


def _non_negative(value: str | None, name: str) -> int:
    if value is None or value == "":
        return 0
    # ASCII digits only ("²".isdigit() is true), short enough to be a seq.
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS):
        raise bad_request(f"{name} must be a non-negative integer", name)
    return int(value)
