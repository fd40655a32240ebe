"""What the doors that number their events by count share: the Open Inference
Protocol's v2 stream (``oip_routes.py``) and DJL Serving's JSON lines (``djl_routes.py``).

Their formats have no room for a token index, so a reader resumes by how many
events (or lines) it has received. That count is a position in the session's
log only if an event is always one of its text-bearing deltas: the peers these
doors open never merge two deltas (``ConnectionProtocol.coalesce``), live or on
a replay, and ``position_after`` maps a count back to the ``seq`` a ``resume`` takes.

Each turn is started and followed as the other HTTP doors do it (an
``HttpPeer``'s ``Handlers``): the limits, admission, backpressure and refusals
are theirs. Only the error bodies differ, by door (``DoorError.body``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from wsinfer.access import Denied, one_header
from wsinfer.contract import SessionMessage
from wsinfer.handlers import to_protocol_error
from wsinfer.http.connection import HttpRequest, HttpResponse
from wsinfer.http.openai import SESSION_HEADER, TOKEN_HEADER, TURN_HEADER, OpenAIError
from wsinfer.http.peer import HttpPeer
from wsinfer.http.responses import loggable
from wsinfer.messages import Generate, Resume
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, TurnEvent

if TYPE_CHECKING:
    from wsinfer.http.host import Handler, RouteHost
    from wsinfer.services import FrontendServices

# How many events (SSE) or lines (JSON lines) a reader already has, to resume after.
RECEIVED_HEADER = "X-Wsinfer-Received"
MAX_DIGITS = 18  # a count; longer is no integer we could have sent


class DoorError(Exception):
    """A refused request or a failed turn; each door says how it is written."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str = "bad_request",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code  # the protocol's error code, for the logs
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_openai(cls, exc: OpenAIError) -> DoorError:
        """The OpenAI door's refusal (the one set of checks) with its status kept."""
        return cls(exc.status, exc.message, exc.code or "unknown", exc.headers())

    def response(self, headers: list[tuple[str, str]] | None = None) -> HttpResponse:
        return HttpResponse.json(self.status, self.body(), [*self.headers, *(headers or [])])


async def answered(
    app: RouteHost,
    request: HttpRequest,
    run: Callable[[], Awaitable[HttpResponse]],
    error: type[DoorError],
) -> HttpResponse:
    """``run``'s answer, or its refusal in ``error``'s shape, logged as ``HttpApp`` logs."""
    try:
        return await run()
    except Exception as exc:
        return refusal(app.frontend, loggable(request.target), exc, error).response()


def refusal(
    frontend: FrontendServices, path: str, exc: Exception, error: type[DoorError]
) -> DoorError:
    """What a door's request that raised ``exc`` is refused with, in ``error``'s
    shape, logged as ``HttpApp`` logs; ``path`` names the request in the log."""
    if isinstance(exc, DoorError):
        refused = exc
    elif isinstance(exc, OpenAIError):
        refused = error.from_openai(exc)
    elif isinstance(exc, Denied):  # a repeated single header
        refused = error(400, exc.message)
    else:
        protocol_error = to_protocol_error(exc)
        cause = protocol_error.__cause__
        frontend.log_failure(cause if isinstance(cause, Exception) else exc, protocol_error, path)
        return error.from_openai(OpenAIError.from_wsinfer(protocol_error))
    if refused.status < 500:
        frontend.refused(refused.code, path=path)
    else:
        frontend.log_limited("warning", "request failed", code=refused.code)
    return refused


def answering(app: RouteHost, error: type[DoorError], handler: Handler) -> Handler:
    """``handler`` with its refusals in ``error``'s shape (``answered``)."""

    async def route(request: HttpRequest, **groups: str) -> HttpResponse:
        return await answered(app, request, lambda: handler(request, **groups), error)

    return route


def session_headers(session: str, token: str, turn: int | str) -> list[tuple[str, str]]:
    """The session(s), resume token(s) and turn(s), as the other doors name them."""
    return [(SESSION_HEADER, session), (TOKEN_HEADER, token), (TURN_HEADER, str(turn))]


def received(request: HttpRequest, error: type[DoorError]) -> int | None:
    """The count a resume asks to continue after: ``X-Wsinfer-Received``, or an SSE
    reader's ``Last-Event-ID`` (the same count: each event's ``id``)."""
    value = one_header(request.headers, RECEIVED_HEADER)
    if value is None:
        value = one_header(request.headers, "Last-Event-ID")
    if value is None:
        return None
    # ASCII digits only ("²".isdigit() is true), short enough to be a count.
    if not (value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS):
        raise error(400, f"{RECEIVED_HEADER} (or Last-Event-ID) must be a non-negative integer")
    return int(value)


def position_after(events: list[TurnEvent], count: int, error: type[DoorError]) -> int:
    """The ``seq`` after which a reader of ``count`` events resumes: that of the
    turn's ``count``-th text-bearing delta. A count past a finished turn's deltas
    is its end (a batch's line goes on after one of its turns is done); past a
    running turn's, it was never sent."""
    seqs = [e.seq for e in _texts(events)]
    if count <= len(seqs):
        return seqs[count - 1] if count else 0
    if any(isinstance(e, DoneEvent) for e in events):
        return max(e.seq for e in events)
    raise error(400, f"{count} received, but the turn has sent {len(seqs)} so far")


def unmerged_peer(app: RouteHost) -> HttpPeer:
    peer = app.open_peer()
    peer.protocol.coalesce = False
    return peer


async def start(app: RouteHost, generate: Generate) -> tuple[HttpPeer, SessionMessage]:
    """A turn started on a peer of its own, and the ``session`` that answered it."""
    peer = unmerged_peer(app)
    try:
        await peer.handlers.handle(generate)
        return peer, peer.accepted()
    except BaseException:
        app.close_peer(peer)
        raise


async def rejoin(
    app: RouteHost, session: str, token: str, count: int, error: type[DoorError]
) -> tuple[HttpPeer, int]:
    """Follow the session's latest turn after its ``count``-th event (a paused turn
    goes on); the peer and the turn."""
    store = app.frontend.store
    info = await store.info(session, token)
    events, _ = await store.read_turn(session, info.turn)
    after = position_after(events, count, error)
    peer = unmerged_peer(app)
    try:
        await peer.handlers.handle(Resume(None, session, token, after, info.turn))
    except BaseException:
        app.close_peer(peer)
        raise
    return peer, info.turn


def _texts(events: list[TurnEvent]) -> list[DeltaEvent]:
    """The deltas that reach a reader as messages (``DeltaEvent.reaches_readers``)."""
    return [e for e in events if isinstance(e, DeltaEvent) and e.reaches_readers]


async def forget(app: RouteHost, started: list[SessionMessage]) -> None:
    """Close the sessions of a request refused after some of them started."""
    for accepted in started:
        with contextlib.suppress(Exception):  # the request's own refusal goes on
            await app.close_session(accepted["session"], accepted["token"])
