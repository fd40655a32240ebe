"""The I/O half of a request: executes the protocol's commands against Redis.

``protocol.py`` decides what a request does; this module only runs the
commands its ``Plan`` yields (store calls, fan-in subscriptions) and hands back
their results as events. The store's own exceptions and Redis outages become
protocol errors here, in ``to_protocol_error``, and nowhere else.

Both doors use it: a WebSocket ``Connection`` (server.py) and an HTTP
request's ``HttpPeer`` (http/peer.py) each provide a ``Peer``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from wsinfer.commands import (
    Admit,
    Admitted,
    CloseSession,
    Command,
    Control,
    Controlled,
    Event,
    Lookup,
    ReadTurn,
    Refused,
    StartTurn,
    Subscribe,
    TurnFound,
    TurnRead,
    TurnStarted,
    Unsubscribe,
)
from wsinfer.contract import TurnStatus
from wsinfer.errors import (
    BadRequest,
    Conflict,
    InternalError,
    NotFound,
    StoreUnavailable,
    WsinferError,
)
from wsinfer.fanin import FanIn
from wsinfer.limits import CapacityGate
from wsinfer.messages import ClientMessage, Generate, Resume
from wsinfer.metrics import Metrics
from wsinfer.protocol import NO_SUCH_SESSION, ConnectionProtocol, Plan
from wsinfer.sessions import keys
from wsinfer.sessions.connect import is_outage
from wsinfer.sessions.schema import DeltaEvent, ParamsError
from wsinfer.sessions.states import IllegalTransition
from wsinfer.sessions.store import ModeMismatch, SessionNotFound, SessionStore, Started, TurnInput


class Services(Protocol):
    """What a request needs of its frontend: the store, admission, fan-in, metrics."""

    store: SessionStore
    capacity: CapacityGate
    fanin: FanIn
    metrics: Metrics


class Peer(Protocol):
    """A client connection, whatever its transport."""

    protocol: ConnectionProtocol
    id: str
    log: Any
    congested: bool  # its client is not reading: new subscriptions start paused

    @property
    def frontend(self) -> Services: ...

    def started_turn(self, session: str, turn: int) -> None: ...

    def on_events(self, session: str, turn: int) -> Any: ...

    def flush(self) -> None:
        """Send (or wake the sender of) what its protocol has queued."""


def to_protocol_error(exc: BaseException) -> WsinferError:
    """Map any exception raised while serving a request to a protocol error."""
    if isinstance(exc, WsinferError):
        return exc
    if isinstance(exc, SessionNotFound):
        return NotFound(NO_SUCH_SESSION)
    if isinstance(exc, IllegalTransition):
        return Conflict(str(exc))
    if isinstance(exc, (ModeMismatch, ParamsError)):
        return BadRequest(str(exc))
    if is_outage(exc):
        return StoreUnavailable("the session store is unreachable; try again", retry_after=1.0)
    return InternalError("internal error")


class Handlers:
    def __init__(self, conn: Peer) -> None:
        self.conn = conn
        self.frontend = conn.frontend
        self.store = conn.frontend.store

    async def handle(self, message: ClientMessage) -> None:
        """Carry out one request; raises the ``WsinferError`` it was refused with
        (its ``__cause__`` is the original exception, for the logs)."""
        if isinstance(message, Resume):
            self.frontend.metrics.resumes.inc()
        await self.run(self.conn.protocol.plan(message))

    async def run(self, plan: Plan) -> None:
        command = plan.start()
        while command is not None:
            try:
                event = await self.execute(command)
            except Exception as exc:  # the plan may clean up, then re-raises
                error = to_protocol_error(exc)
                if error is not exc:
                    error.__cause__ = exc
                command = plan.throw(error)
            else:
                command = plan.send(event)

    async def execute(self, command: Command) -> Event | None:
        if isinstance(command, Subscribe):
            self._subscribe(command)
            return None
        if isinstance(command, Unsubscribe):
            self.frontend.fanin.unsubscribe((self.conn.id, command.session))
            return None
        if isinstance(command, Admit):
            return Admitted(await self.frontend.capacity.admit())
        if isinstance(command, StartTurn):
            return await self._start(command)
        if isinstance(command, Lookup):
            info = await self.store.info(command.session, command.token)
            return TurnFound(info.turn, TurnStatus(info.status), info.seq)
        if isinstance(command, Control):
            return await self._control(command)
        return await self._execute_reads(command)

    async def _execute_reads(self, command: Command) -> Event | None:
        if isinstance(command, ReadTurn):
            # Watched and read at once: a resume waits for one round trip, not two.
            touched, (events, last_id) = await asyncio.gather(
                self.store.touch({command.session: command.turn}),
                self.store.read_turn(command.session, command.turn),
            )
            if touched.gone:
                return TurnRead([], "0-0", found=False)
            replayed = sum(isinstance(e, DeltaEvent) and e.seq > command.after for e in events)
            self.frontend.metrics.replayed.inc(replayed)
            return TurnRead(events, last_id)
        if isinstance(command, CloseSession):
            await self.store.close(command.session, command.token)
            return None
        raise TypeError(f"unknown command {command!r}")

    async def _start(self, command: StartTurn) -> TurnStarted | Refused:
        try:
            started = await self._start_turn(command.request, command.alive)
        except IllegalTransition as exc:
            return Refused(exc.current)
        if not started.repeat:
            self.frontend.metrics.turns.inc()
            self.conn.log.info("turn accepted", session=started.session, turn=started.turn)
            self.conn.started_turn(started.session, started.turn)
        status = TurnStatus(started.status)
        return TurnStarted(started.session, started.token, started.turn, status, started.repeat)

    async def _start_turn(self, msg: Generate, alive: frozenset[str]) -> Started:
        turn_input = TurnInput(
            mode="chat" if msg.messages is not None else "text",
            messages=msg.messages,
            prompt=msg.prompt,
            params=msg.params,
        )
        key = msg.idempotency_key
        if msg.session is None or msg.token is None:
            if key is not None:
                return await self.store.create_once(turn_input, key)
            session, token = await self.store.create(turn_input)
            return Started(session, token, 1, TurnStatus.QUEUED.value)
        if key is not None:
            return await self.store.add_turn_once(msg.session, msg.token, turn_input, key, alive)
        turn = await self.store.add_turn(msg.session, msg.token, turn_input, alive)
        return Started(msg.session, msg.token, turn, TurnStatus.QUEUED.value)

    async def _control(self, command: Control) -> Controlled | Refused:
        try:
            result = await self.store.control(
                command.session, command.token, command.turn, command.action
            )
        except IllegalTransition as exc:
            return Refused(exc.current)
        return Controlled(result.status, result.seq)

    def _subscribe(self, command: Subscribe) -> None:
        owner = (self.conn.id, command.session)
        fanin = self.frontend.fanin
        key = keys.turn_stream(command.session, command.turn)
        deliver = self.conn.on_events(command.session, command.turn)
        fanin.subscribe(key, owner, command.position, deliver)
        if self.conn.congested:  # its client is not reading: wait in Redis
            fanin.hold(owner)
