"""OpenAI's Responses API WebSocket mode: ``/v1/responses`` upgraded, one JSON event a frame.

What the official SDK's ``client.responses.connect()`` speaks: the client sends
``response.create`` (the fields of ``POST /v1/responses``, checked by the same
code), the server sends that response's stream events, the very objects and
``sequence_number``\\ s of its SSE stream (``ResponseEvents``, the one builder),
then the next response's. Beyond OpenAI, a response of a socket that dropped
is followed again from any number (``response.resume``), on a new socket or
over HTTP, and ``response.cancel`` and ``response.pause`` act on one.

Two parts, as the WebSocket door has them: ``parse_client_event`` and the
``*_frame`` builders are sans I/O; ``ResponsesSocket`` only moves frames, and
runs each request through ``ResponsesRoutes``, as the HTTP routes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from wsinfer.access import Denied, shorten
from wsinfer.contract import ClientMessageType, TurnStatus
from wsinfer.handlers import to_protocol_error
from wsinfer.http.openai import STATUS_BY_CODE, OpenAIError, bad_request, json_object
from wsinfer.http.peer import HttpPeer
from wsinfer.http.responses import (
    ResponseEvents,
    ResponseId,
    ResponseRequest,
    response_request,
)
from wsinfer.http.responses_routes import ResponsesRoutes
from wsinfer.limits import TokenBucket
from wsinfer.messages import Limits, Resume, SessionCommand

if TYPE_CHECKING:
    from wsinfer.http.host import RouteHost

log = structlog.get_logger("wsinfer.responses_ws")

PATH = "/v1/responses"
CREATE = "response.create"
RESUME = "response.resume"  # ours: follow a response again, from a sequence number
CANCEL = "response.cancel"  # ours: stop a response
PAUSE = "response.pause"  # ours: pause a response (a resume goes on with it)
PAUSED = "response.paused"  # ours, server to client: a response halted by a pause
# Requests waiting for the one before them to end, per socket; more is refused.
MAX_QUEUED = 16
MAX_STREAM_ID = 128
# The fields of OpenAI's ``response.create`` that are the socket's, not the response's.
_ENVELOPE = ("type", "stream_id")


# --- sans I/O: client events in, frames out ----------------------------------------------


@dataclass(frozen=True)
class Create:
    ask: ResponseRequest
    lane: str | None  # OpenAI's ``stream_id``: echoed in every event of the response


@dataclass(frozen=True)
class Follow:
    rid: ResponseId
    after: int  # the last sequence number the client has (-1: none)
    lane: str | None


@dataclass(frozen=True)
class Control:
    kind: ClientMessageType  # STOP (``response.cancel``) or PAUSE
    rid: ResponseId


ClientEvent = Create | Follow | Control


def parse_client_event(frame: str | bytes, limits: Limits, model: str) -> ClientEvent:
    """A client event, checked; ``OpenAIError`` (sent back as an ``error`` event) if not."""
    data, lane = decode_frame(frame)
    return client_event(data, lane, limits, model)


def decode_frame(frame: str | bytes) -> tuple[dict[str, Any], str | None]:
    """A frame's JSON object (read as a request body is) and its ``stream_id``, which
    every answer to it echoes, refusals included."""
    data = json_object(frame.encode() if isinstance(frame, str) else frame)
    return data, _lane(data.get("stream_id"))


def client_event(data: dict[str, Any], lane: str | None, limits: Limits, model: str) -> ClientEvent:
    kind = data.get("type")
    if kind == CREATE:
        return Create(_create(data, limits, model), lane)
    if kind == RESUME:
        _only(data, {"response_id", "starting_after"})
        return Follow(_response_id(data), _starting_after(data.get("starting_after")), lane)
    if kind in (CANCEL, PAUSE):
        _only(data, {"response_id"})
        control = ClientMessageType.STOP if kind == CANCEL else ClientMessageType.PAUSE
        return Control(control, _response_id(data))
    if kind == "response.steer":
        raise bad_request("response.steer is not supported here", "type", "unsupported")
    expected = f"{CREATE}, {RESUME}, {CANCEL} or {PAUSE}"
    raise bad_request(f"type must be {expected}, not {shorten(repr(kind), 64)}", "type")


def _create(data: dict[str, Any], limits: Limits, model: str) -> ResponseRequest:
    """The create's own fields, as ``POST /v1/responses`` checks them. Over a socket a
    response is always streamed (``stream`` is ignored) and, as OpenAI's WebSocket
    mode has it, never ``background``; ``generate: false`` (a warm-up) is not kept."""
    fields = {k: v for k, v in data.items() if k not in _ENVELOPE and k != "stream"}
    if fields.get("background") not in (None, False):
        message = "background is not supported in WebSocket mode"
        raise bad_request(message, "background", "unsupported")
    if fields.pop("generate", None) not in (None, True):
        raise bad_request("generate=false is not supported", "generate", "unsupported")
    return response_request(fields, limits, model)


def _only(data: dict[str, Any], own: set[str]) -> None:
    unknown = sorted(str(k) for k in data if k not in {*_ENVELOPE, *own})
    if unknown:
        quoted = shorten(", ".join(unknown), 64)
        raise bad_request(f"Unrecognized event field supplied: {quoted}", unknown[0][:64])


def _lane(raw: Any) -> str | None:
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= MAX_STREAM_ID:
        message = f"stream_id must be a string of 1 to {MAX_STREAM_ID} characters"
        raise bad_request(message, "stream_id")
    return raw


def _response_id(data: dict[str, Any]) -> ResponseId:
    raw = data.get("response_id")
    if not isinstance(raw, str):
        raise bad_request("response_id must be a string", "response_id")
    return ResponseId.parse(raw)  # 404 for an id we could not have issued


def _starting_after(raw: Any) -> int:
    if raw is None:
        return -1
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw < 10**18:
        raise bad_request("starting_after must be a non-negative integer", "starting_after")
    return raw


def event_frame(event: dict[str, Any], lane: str | None) -> str:
    """A Responses stream event as its frame (with its request's ``stream_id``).

    A stream's ``error`` (a follow refused midway) is the SSE one in the
    WebSocket shape, where the details sit in ``error``, under its number."""
    if event["type"] == "error":
        code = event["code"]
        exc = OpenAIError(STATUS_BY_CODE.get(code, 500), event["message"], code=code)
        event = {**json.loads(error_frame(exc)), "sequence_number": event["sequence_number"]}
    return json.dumps(event if lane is None else {**event, "stream_id": lane}, ensure_ascii=False)


def error_frame(exc: OpenAIError, lane: str | None = None) -> str:
    """A refused client event, as OpenAI's WebSocket mode sends it: ``status`` the
    HTTP status the same request would have had; ``headers`` its Retry-After."""
    out: dict[str, Any] = {"type": "error", "status": exc.status, "error": exc.body()["error"]}
    headers = {name.lower(): value for name, value in exc.headers()}
    if headers:
        out["error"]["headers"] = headers
    if lane is not None:
        out["stream_id"] = lane
    return json.dumps(out, ensure_ascii=False)


def paused_frame(rid: ResponseId, seq: int, lane: str | None) -> str:
    """Ours (no OpenAI event says it, and it takes no sequence number): the response
    is halted at its output token ``seq`` until a ``response.resume``."""
    out: dict[str, Any] = {"type": PAUSED, "response_id": str(rid), "seq": seq}
    return json.dumps(out if lane is None else {**out, "stream_id": lane})


def handshake_refusal(denied: Denied) -> Response:
    """The upgrade refused (key, host, origin) in OpenAI's error shape."""
    exc = OpenAIError(denied.status, denied.message, code=denied.code)
    body = json.dumps(exc.body()).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    if denied.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    status = HTTPStatus(denied.status)
    return Response(status.value, status.phrase, headers, body)


def handshake(app: RouteHost, request: Request) -> Response | None:
    """``None`` (accept) for a client the HTTP door would serve ``POST /v1/responses``."""
    try:
        app.frontend.access.check(request.headers, request.path, needs_key=True)
    except Denied as exc:
        app.frontend.refused(exc.code, path=PATH)
        return handshake_refusal(exc)
    return None


# --- the socket ---------------------------------------------------------------------------


class ResponsesSocket:
    """One WebSocket in Responses mode: a reader, and a worker that runs the socket's
    creates and follows one after the other (each starts once the one before has
    sent its last event: OpenAI's one response at a time). Cancel and pause act at
    once, on whichever response they name."""

    def __init__(self, app: RouteHost, ws: ServerConnection) -> None:
        self.app = app
        self.ws = ws
        self.routes = ResponsesRoutes(app)
        self.config = app.frontend.config
        self.id = f"rws-{uuid.uuid4().hex[:12]}"
        self.log = log.bind(conn=self.id)
        self.bucket = TokenBucket(self.config.request_rate, max(1.0, 2 * self.config.request_rate))
        self.queue: asyncio.Queue[Create | Follow] = asyncio.Queue()
        self.streaming: ResponseId | None = None  # the response the worker streams now

    async def run(self) -> None:
        worker = asyncio.create_task(self._work())
        try:
            async for frame in self.ws:
                await self._on_frame(frame)
        except ConnectionClosed:
            pass
        finally:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)

    async def _on_frame(self, frame: str | bytes) -> None:
        lane = None
        try:
            wait = self.bucket.take()
            if wait > 0:
                raise OpenAIError(429, "too many requests on this socket", code="overloaded",
                                  retry_after=wait)  # fmt: skip
            data, lane = decode_frame(frame)
            event = client_event(data, lane, self.config.limits, self.config.model_name)
            if isinstance(event, Control):
                await self._control(event)
            elif isinstance(event, Follow) and event.rid == self.streaming:
                await self._unpause(event.rid)  # its stream here goes on: nothing twice
            elif self.queue.qsize() >= MAX_QUEUED:
                message = f"at most {MAX_QUEUED} requests may wait on one socket"
                raise OpenAIError(429, message, code="overloaded", retry_after=1.0)
            else:
                self.queue.put_nowait(event)
        except Exception as exc:
            await self._refuse(exc, lane, "client event")

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self._run(job)
            except ConnectionClosed:
                return
            except Exception as exc:
                await self._refuse(exc, job.lane, type(job).__name__)

    async def _run(self, job: Create | Follow) -> None:
        if isinstance(job, Create):
            peer, view, status = await self.routes.start(job.ask)
            events = ResponseEvents(view, -1)
        else:
            peer, events, status = await self.routes.follow(job.rid, job.after)
        self.streaming = events.view.rid
        try:
            await self._stream(peer, events, status, job.lane)
        finally:
            self.streaming = None
            self.app.close_peer(peer)

    async def _stream(
        self, peer: HttpPeer, events: ResponseEvents, status: str, lane: str | None
    ) -> None:
        async for out in self.routes.stream(peer, events, status):
            if isinstance(out, list):
                for event in out:
                    await self.ws.send(event_frame(event, lane))
            elif out is not None:  # a pause: the stream waits here for a resume
                await self.ws.send(paused_frame(events.view.rid, out["seq"], lane))

    async def _control(self, control: Control) -> None:
        """Stop or pause the response; its streams (here or anywhere) show the outcome."""
        rid = control.rid
        info = await self.routes.info(rid)  # 404 for a wrong id
        if rid.turn == info.turn and info.status != TurnStatus.DONE.value:  # else: as it is
            await self._command(SessionCommand(control.kind, None, rid.session, rid.token))

    async def _unpause(self, rid: ResponseId) -> None:
        """Continue a paused response that this socket streams (a no-op otherwise)."""
        await self._command(Resume(None, rid.session, rid.token))

    async def _command(self, command: SessionCommand | Resume) -> None:
        """One command on a peer of its own, which follows nothing after it."""
        peer = self.app.open_peer()
        try:
            await peer.handlers.handle(command)
        finally:
            self.app.close_peer(peer)

    async def _refuse(self, exc: Exception, lane: str | None, what: str) -> None:
        """Every failure of a client event becomes OpenAI's ``error`` event."""
        if not isinstance(exc, OpenAIError):
            error = to_protocol_error(exc)
            cause = error.__cause__ if isinstance(error.__cause__, Exception) else exc
            self.app.frontend.log_failure(cause, error, f"{PATH} {what}")
            exc = OpenAIError.from_wsinfer(error)
        elif exc.status < 500:
            self.app.frontend.refused(exc.code or "bad_request", path=PATH)
        with contextlib.suppress(ConnectionClosed):
            await self.ws.send(error_frame(exc, lane))
