"""One HTTP request's view of a session: the WebSocket connection's parts, minus the socket.

An ``HttpPeer`` owns a ``ConnectionProtocol`` (every decision of a request, the
exactly-once bookkeeping by ``seq``, replay, coalescing of a lagging reader)
and a ``Handlers`` (every Redis operation), exactly as a WebSocket connection
does; the HTTP routes read the protocol's outgoing messages instead of sending
them as frames.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from wsinfer.contract import DoneMessage, PausedMessage, ServerMessage, SessionMessage
from wsinfer.errors import BadRequest
from wsinfer.handlers import Handlers
from wsinfer.http.openai import mark_closed
from wsinfer.protocol import ConnectionProtocol
from wsinfer.sessions.connect import OUTAGE_ERRORS
from wsinfer.sessions.schema import TurnEvent
from wsinfer.waiting import wait_set

if TYPE_CHECKING:
    from wsinfer.services import FrontendServices

log = structlog.get_logger("wsinfer.http")

# An SSE comment this often: proxies keep the stream open, a vanished client is noticed.
KEEPALIVE_S = 15.0
# How long a route that stops or pauses a turn waits to report the outcome.
CONTROL_WAIT_S = 10.0


@dataclass(frozen=True)
class _NoFrames:
    """HTTP takes the protocol's messages as maps: encoding frames would be wasted work."""

    subprotocol: str = field(default="http")

    def encode(self, message: ServerMessage) -> str:
        return ""

    def decode(self, frame: str | bytes) -> Any:
        raise BadRequest("an HTTP peer receives no frames")


class HttpPeer:
    def __init__(self, frontend: FrontendServices) -> None:
        self.frontend = frontend
        self.id = f"http-{uuid.uuid4().hex[:12]}"
        self.protocol = ConnectionProtocol(_NoFrames(), frontend.config.limits)
        self.log = log.bind(conn=self.id)
        self.handlers = Handlers(self)
        self._wakeup = asyncio.Event()
        self._held: list[ServerMessage] = []
        # Never: a slow SSE reader holds one coalescing outbox (one turn, bounded by
        # its length) and the HTTP writer waits on the transport's own flow control.
        self.congested = False

    def started_turn(self, session: str, turn: int) -> None:
        """Nothing to time here: time to first byte is the HTTP client's to measure."""

    def on_events(self, session: str, turn: int) -> Callable[[list[TurnEvent]], None]:
        def deliver(events: list[TurnEvent]) -> None:
            self.protocol.deliver(session, turn, events)
            self._wakeup.set()

        return deliver

    def flush(self) -> None:
        self._wakeup.set()

    async def messages(self, timeout: float) -> list[ServerMessage]:
        """What the protocol has to send now, waiting up to ``timeout`` ([] if nothing).
        A cancelled ``done`` of a session that no longer exists is marked closed."""
        while True:
            out = [*self._held, *(o.message for o in self.protocol.data_to_send())]
            self._held = []
            if out:
                for message in out:
                    if message["type"] == "done" and message["finish_reason"] == "cancelled":
                        await self._mark_if_closed(message)
                return out
            if not await wait_set(self._wakeup, timeout):
                return []
            self._wakeup.clear()

    async def _mark_if_closed(self, done: DoneMessage) -> None:
        """A close (``DELETE``) and a stop append the same cancelled ``done``; a close
        deletes the session's meta hash in the same script, so a turn with no start
        time recorded any more ended with its session."""
        try:
            created = await self.frontend.store.turn_created(done["session"], done["turn"])
        except OUTAGE_ERRORS:  # Redis away: read it as a stop, as before
            self.log.warning("could not tell a close from a stop: Redis is unavailable")
            return
        if not created:
            mark_closed(done)

    async def outcome(
        self, timeout: float, *, paused: bool = False
    ) -> DoneMessage | PausedMessage | None:
        """The turn's ``done`` (a stop's outcome), or with ``paused`` its ``paused``
        too (a pause's), if it comes in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for message in await self.messages(left):
                if message["type"] == "done" or (paused and message["type"] == "paused"):
                    return message
        return None

    def accepted(self) -> SessionMessage:
        """The ``session`` answer to the generate just handled (the rest is kept for later)."""
        out = [*self._held, *(o.message for o in self.protocol.data_to_send())]
        for first in out:
            if first["type"] == "session":
                self._held = [m for m in out if m is not first]
                return first
        raise LookupError("the generate was not answered")

    def rejoined(self) -> tuple[SessionMessage, int]:
        """The ``session`` answer to the resume just handled, and the last seq of its
        replay (0 for a turn that has sent nothing yet)."""
        first, seq = self.accepted(), 0
        for message in self._held:
            if message["type"] in ("delta", "paused", "done"):
                seq = max(seq, message["seq"])
        return first, seq

    def close(self) -> None:
        """Stop following: generation goes on unwatched, as after a WebSocket disconnect."""
        self.frontend.fanin.unsubscribe_all(lambda owner: owner[0] == self.id)  # type: ignore[index]
        self.protocol.feeds.clear()


def merged_messages(
    peers: list[HttpPeer], readers: list[asyncio.Task[None]]
) -> asyncio.Queue[tuple[int, list[ServerMessage]]]:
    """One queue of ``(index, messages)`` that each of ``peers`` delivers, as it does
    (a response that merges several turns: ``n`` choices, a batch of prompts);
    ``readers`` gets the tasks that follow them, for the response's cleanup to cancel."""
    arrivals: asyncio.Queue[tuple[int, list[ServerMessage]]] = asyncio.Queue()

    async def follow(index: int) -> None:
        while True:
            messages = await peers[index].messages(KEEPALIVE_S)
            if messages:
                await arrivals.put((index, messages))

    readers += [asyncio.create_task(follow(i)) for i in range(len(peers))]
    return arrivals
