"""Asyncio client for the wsinfer WebSocket protocol (v1).

One ``Client`` owns one WebSocket at a time and a supervisor task that reads
it. Server messages are routed by ``id`` (answers to our requests) and by
``session`` (turn streams), so many turns of different sessions can share the
connection. When the connection drops while a turn is live, the supervisor
reconnects with backoff and sends ``resume`` with ``after`` = the last seq
applied; ``TurnState`` drops replayed deltas, so callers never notice.

Usage::

    async with wsinfer.connect("ws://127.0.0.1:8000/v1/ws") as client:
        async for text in client.generate(prompt="Once upon a time"):
            print(text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncIterator, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
from websockets.typing import Subprotocol

from wsinfer.clients.codec import (
    SUBPROTOCOLS,
    Codec,
    CodecName,
    DecodeError,
    codec_for_subprotocol,
    offered_subprotocols,
)
from wsinfer.clients.errors import (
    ClientClosed,
    ConnectionLost,
    Unauthorized,
    WsinferError,
    error_from_wire,
)
from wsinfer.clients.protocol import (
    ChatMessage,
    Message,
    TurnState,
    control_request,
    generate_request,
)
from wsinfer.clients.turn import Conversation, Turn, new_ack

__all__ = ["Client", "ReconnectPolicy", "connect"]

log = logging.getLogger("wsinfer.clients")

_TURN_EVENTS = frozenset({"delta", "paused", "done"})


@dataclass(frozen=True)
class ReconnectPolicy:
    """How hard to try to get a dropped connection back before failing live turns."""

    max_attempts: int = 10
    max_time: float = 60.0
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        # Equal jitter: at least half of the exponential step, so retries really
        # back off, and random in the other half so that many clients cut by
        # the same frontend restart do not come back in lockstep.
        step = min(self.max_delay, self.base_delay * 2**attempt)
        return step / 2 + random.uniform(0, step / 2)


@dataclass
class _Pending:
    """A request we sent with an ``id``, waiting for a ``session`` or ``error``."""

    kind: str
    future: asyncio.Future[Any] | None = None
    turn: Turn | None = None


class Client:
    """A connection to a wsinfer server; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        codec: CodecName = "msgpack",
        reconnect: bool | ReconnectPolicy = True,
        open_timeout: float = 10.0,
        ws_options: Mapping[str, Any] | None = None,
    ) -> None:
        if codec not in SUBPROTOCOLS:
            raise ValueError(f"codec must be one of {sorted(SUBPROTOCOLS)}")
        self.url = url
        self._api_key = api_key
        self._preferred: CodecName = codec
        self._codec = Codec(codec)
        self._policy = ReconnectPolicy() if reconnect is True else (reconnect or None)
        self._open_timeout = open_timeout
        self._ws_options = dict(ws_options or {})
        self._ws: ClientConnection | None = None  # set only once attached
        self._supervisor: asyncio.Task[WsinferError | None] | None = None
        self._changed: asyncio.Future[None] | None = None
        self._pending: dict[Any, _Pending] = {}
        self._turns: dict[str, Turn] = {}  # session -> its latest turn still running
        self._tokens: dict[str, str] = {}  # session -> token, for sessions seen here
        self._ids = itertools.count(1)
        self._closed = False
        self._failure: WsinferError | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.reconnects = 0

    # --- lifecycle ---------------------------------------------------------------

    async def open(self) -> Client:
        """Connect now (no retries: a wrong URL or key should fail fast)."""
        if self._ws is not None:
            return self
        ws = await self._dial()
        self._supervisor = asyncio.create_task(self._supervise(ws), name="wsinfer-client")
        await self._connection()
        return self

    def __await__(self) -> Generator[Any, None, Client]:
        return self.open().__await__()

    async def __aenter__(self) -> Client:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; turns still running here fail with ``ClientClosed``."""
        if self._closed:
            return
        self._closed = True
        if self._ws is not None:
            await self._ws.close()
        for task in [self._supervisor, *self._background]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._fail_all(ClientClosed("the client was closed"), everything=True)

    @property
    def codec(self) -> CodecName:
        """The encoding in use (what the server picked)."""
        return self._codec.name

    @property
    def connected(self) -> bool:
        return self._ws is not None

    # --- public API ----------------------------------------------------------------

    async def start(
        self,
        *,
        messages: Sequence[ChatMessage] | None = None,
        prompt: str | None = None,
        params: Mapping[str, Any] | None = None,
        session: str | None = None,
        token: str | None = None,
    ) -> Turn:
        """Start a turn (a new session, or the next turn of ``session``) and return it."""
        if session is not None and token is None:
            token = self._tokens.get(session)
            if token is None:
                raise ValueError(f"no token known for session {session!r}; pass token=")
        msg = generate_request(
            messages=messages, prompt=prompt, params=params, session=session, token=token
        )
        answer = _new_future()
        ws = await self._connection()
        try:
            await self._send_on(ws, msg, _Pending("generate", answer))
        except ConnectionClosed as exc:
            # Not retried: the server may have taken it, and a second generate
            # would start a second turn.
            raise ConnectionLost("connection dropped while sending generate") from exc
        turn: Turn = await answer
        return turn

    async def generate(
        self,
        *,
        messages: Sequence[ChatMessage] | None = None,
        prompt: str | None = None,
        params: Mapping[str, Any] | None = None,
        session: str | None = None,
        token: str | None = None,
    ) -> AsyncIterator[str]:
        """Start a turn and yield its text deltas; leaving the loop early stops it."""
        turn = await self.start(
            messages=messages, prompt=prompt, params=params, session=session, token=token
        )
        # Leaving the loop early stops the turn: no engine time for unread text.
        try:
            async for text in turn:
                yield text
        finally:
            turn.stop_soon()

    def conversation(
        self,
        *,
        session: str | None = None,
        token: str | None = None,
        system: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Conversation:
        """A multi-turn chat; pass ``session``/``token`` to continue an existing one."""
        if session is not None and token is None:
            token = self._tokens.get(session)
        return Conversation(self, session=session, token=token, system=system, params=params)

    async def attach(
        self, session: str, token: str, *, turn: int | None = None, after: int = 0
    ) -> Turn:
        """Follow a turn started elsewhere (another process, a lost client)."""
        state = TurnState(session, token, -1 if turn is None else turn, seq=after)
        attached = Turn(self, state)
        self._register(attached)
        await self.send_resume(attached, None)
        return attached

    async def close_session(self, session: str, token: str | None = None) -> None:
        """End a session on the server (``close``).

        The protocol does not acknowledge ``close``; a refusal is only logged.
        A turn of that session still running here ends with ``ClientClosed``.
        """
        token = token or self._tokens.get(session)
        if token is None:
            raise ValueError(f"no token known for session {session!r}; pass token=")
        turn = self._turns.get(session)
        if turn is not None:
            turn.fail(ClientClosed(f"session {session} was closed", session=session))
            self._forget(turn)
        self._tokens.pop(session, None)
        await self._send_retrying(control_request("close", session, token))

    # --- used by Turn ----------------------------------------------------------------

    async def send_stop(self, turn: Turn) -> None:
        ws = await self._connection()
        stop = control_request("stop", turn.session, turn.token)
        sent = await self._try_send(ws, stop, _Pending("stop", turn.stop_ack, turn))
        if sent and turn.following is not ws:
            # Only a connection that follows the session sees its `done`.
            # Joining after the stop means the join cannot un-pause it.
            await self._follow(ws, turn, None)

    async def send_pause(self, turn: Turn) -> None:
        ws = await self._connection()
        if turn.following is not ws and not await self._follow(ws, turn, None):
            return
        pause = control_request("pause", turn.session, turn.token)
        await self._try_send(ws, pause, _Pending("pause", turn.pause_ack, turn))

    async def send_resume(self, turn: Turn, ack: asyncio.Future[None] | None) -> None:
        ws = await self._connection()
        await self._follow(ws, turn, ack)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a fire-and-forget coroutine, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background request failed: %s", task.exception())

    # --- sending ---------------------------------------------------------------------

    async def _send_on(self, ws: ClientConnection, msg: Message, pending: _Pending | None) -> None:
        msg["id"] = msg_id = next(self._ids)
        if pending is not None:
            self._pending[msg_id] = pending
        await ws.send(self._codec.encode(msg))

    async def _try_send(self, ws: ClientConnection, msg: Message, pending: _Pending | None) -> bool:
        """Send; False if the connection is gone (the reconnect repeats live turns' requests)."""
        try:
            await self._send_on(ws, msg, pending)
        except ConnectionClosed:
            return False
        return True

    async def _send_retrying(self, msg: Message) -> None:
        """Send a request no reconnect would repeat, retrying on the next connection."""
        while True:
            ws = await self._connection()
            if await self._try_send(ws, dict(msg), None):
                return
            self._drop_connection(ws)

    async def _follow(
        self, ws: ClientConnection, turn: Turn, ack: asyncio.Future[None] | None
    ) -> bool:
        """``resume`` the turn from the last seq applied here, on ``ws``."""
        if not await self._try_send(ws, _resume_request(turn), _Pending("resume", ack, turn)):
            return False
        turn.following = ws
        return True

    # --- connection ------------------------------------------------------------------

    async def _connection(self) -> ClientConnection:
        """The attached connection, reconnecting first if it dropped while idle."""
        while True:
            if self._closed:
                raise ClientClosed("the client is closed")
            if self._ws is not None:
                return self._ws
            supervisor = self._supervisor
            if supervisor is None or supervisor.done():
                if self._policy is None and self._failure is not None:
                    raise self._failure
                supervisor = self._supervisor = asyncio.create_task(self._supervise(None))
            changed = self._changed_future()
            await asyncio.wait([supervisor, changed], return_when=asyncio.FIRST_COMPLETED)
            if self._ws is None and supervisor.done():
                failure = supervisor.result()
                if failure is not None:
                    raise failure

    def _changed_future(self) -> asyncio.Future[None]:
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _signal(self) -> None:
        """Wake everybody waiting in ``_connection`` to look again."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def _drop_connection(self, ws: ClientConnection) -> None:
        # A failed send proves the connection is dead even if the reader has
        # not noticed yet; stop handing it out.
        if self._ws is ws:
            self._ws = None

    async def _dial(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        offered = [Subprotocol(p) for p in offered_subprotocols(self._preferred)]
        try:
            return await ws_connect(
                self.url,
                subprotocols=offered,
                additional_headers=headers,
                open_timeout=self._open_timeout,
                **self._ws_options,
            )
        except InvalidStatus as exc:
            if exc.response.status_code == 401:
                raise Unauthorized("the server refused the API key") from exc
            raise ConnectionLost(f"handshake with {self.url} failed: {exc}") from exc
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect to {self.url}: {exc}") from exc

    async def _redial(self) -> ClientConnection:
        """Reconnect with backoff; Unauthorized is not retried (a bad key stays bad)."""
        policy = self._policy or ReconnectPolicy(max_attempts=1, base_delay=0.0)
        deadline = time.monotonic() + policy.max_time
        last: WsinferError | None = None
        for attempt in range(policy.max_attempts):
            await asyncio.sleep(max(0.0, min(policy.delay(attempt), deadline - time.monotonic())))
            try:
                ws = await self._dial()
            except ConnectionLost as exc:
                last = exc
                log.info("reconnect attempt %d to %s failed: %s", attempt + 1, self.url, exc)
            else:
                self.reconnects += 1
                return ws
            if time.monotonic() >= deadline:
                break
        raise ConnectionLost(f"gave up reconnecting to {self.url}: {last}")

    async def _supervise(self, ws: ClientConnection | None) -> WsinferError | None:
        """Own the connection: read it, and get it back while turns need it."""
        try:
            while True:
                if ws is None:
                    ws = await self._redial()
                await self._serve(ws)
                ws = None
                self._on_disconnect()
                if self._closed:
                    return None
                if self._policy is None:
                    raise ConnectionLost("the connection dropped and reconnect is off")
                if not any(turn.live for turn in self._turns.values()):
                    return None  # idle: the next request reconnects
        except WsinferError as exc:
            return self._give_up(exc)
        except Exception as exc:  # a bug here must fail turns loudly, never hang them
            log.exception("wsinfer client supervisor crashed")
            return self._give_up(ConnectionLost(f"client supervisor crashed: {exc!r}"))
        finally:
            self._signal()

    def _give_up(self, exc: WsinferError) -> WsinferError:
        self._ws = None
        self._failure = exc
        self._fail_all(exc, everything=False)
        return exc

    async def _serve(self, ws: ClientConnection) -> None:
        try:
            await self._attach(ws)
            async for frame in ws:
                self._receive(frame)
        except (ConnectionClosed, OSError):
            pass

    async def _attach(self, ws: ClientConnection) -> None:
        """Adopt a fresh connection: re-join live turns before anyone else sends."""
        self._codec = codec_for_subprotocol(ws.subprotocol)
        for turn in [t for t in self._turns.values() if t.live]:
            await self._rejoin(ws, turn)
        self._ws = ws
        self._failure = None
        self._signal()

    async def _rejoin(self, ws: ClientConnection, turn: Turn) -> None:
        """Repeat what the caller asked of the turn that the old connection may have lost."""
        if turn.stop_requested:
            stop = control_request("stop", turn.session, turn.token)
            await self._send_on(ws, stop, _Pending("stop", turn.stop_ack, turn))
        await self._send_on(ws, _resume_request(turn), _Pending("resume", None, turn))
        turn.following = ws
        if turn.pause_requested and not turn.stop_requested:
            pause = control_request("pause", turn.session, turn.token)
            await self._send_on(ws, pause, _Pending("pause", turn.pause_ack, turn))

    def _on_disconnect(self) -> None:
        self._ws = None
        lost = ConnectionLost("the connection dropped before the server answered")
        for pending in self._pending.values():
            # A generate may or may not have been taken: only its caller can
            # decide whether to try again. Control requests of live turns are
            # repeated by `_rejoin`.
            if pending.kind == "generate" and pending.future and not pending.future.done():
                pending.future.set_exception(lost)
        self._pending.clear()
        self._signal()

    def _fail_all(self, exc: WsinferError, *, everything: bool) -> None:
        for turn in list(self._turns.values()):
            if everything or turn.live:
                turn.fail(exc)
                self._forget(turn)
        for pending in self._pending.values():
            if pending.future is not None and not pending.future.done():
                pending.future.set_exception(exc)
        self._pending.clear()

    # --- receiving -------------------------------------------------------------------

    def _receive(self, frame: str | bytes) -> None:
        try:
            msg = self._codec.decode(frame)
            self._dispatch(msg)
        except (DecodeError, KeyError, TypeError, ValueError) as exc:
            # One malformed message must not take down the reader and with it
            # every turn on this connection.
            log.warning("ignoring malformed server message: %r", exc)

    def _dispatch(self, msg: Message) -> None:
        kind = msg.get("type")
        if kind in _TURN_EVENTS:
            self._on_turn_event(msg)
        elif kind == "session":
            self._on_session(msg)
        elif kind == "error":
            self._on_error(msg)
        else:
            log.debug("ignoring server message of type %r", kind)

    def _on_turn_event(self, msg: Message) -> None:
        turn = self._turns.get(str(msg.get("session")))
        if turn is None:
            return
        turn.apply(msg)
        if turn.finished:
            self._forget(turn)

    def _on_session(self, msg: Message) -> None:
        pending = self._pending.pop(msg.get("id"), None)
        if pending is None or pending.kind != "generate" or pending.future is None:
            log.warning("session answer for no pending generate: %r", msg.get("id"))
            return
        state = TurnState(str(msg["session"]), str(msg["token"]), int(msg["turn"]))
        turn = Turn(self, state)
        turn.following = self._ws
        self._register(turn)
        if pending.future.done():
            turn.stop_soon()  # its caller gave up waiting: do not leave it generating
        else:
            pending.future.set_result(turn)

    def _on_error(self, msg: Message) -> None:
        exc = error_from_wire(msg)
        if "id" in msg:
            pending = self._pending.pop(msg["id"], None)
            if pending is None:
                log.warning("error for no pending request: %s", exc)
            else:
                self._settle(pending, exc)
            return
        # Without an id it can only concern a session's running turn.
        turn = self._turns.get(str(msg.get("session")))
        if turn is None:
            log.warning("server error: %s", exc)
            return
        turn.fail(exc)
        self._forget(turn)

    def _settle(self, pending: _Pending, exc: WsinferError) -> None:
        # A refused resume leaves the turn unreachable: fail it. A refused
        # stop or pause is the caller's problem only.
        if pending.kind == "resume" and pending.turn is not None:
            pending.turn.fail(exc)
            self._forget(pending.turn)
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(exc)

    def _register(self, turn: Turn) -> None:
        self._turns[turn.session] = turn
        self._tokens[turn.session] = turn.token

    def _forget(self, turn: Turn) -> None:
        session = turn.session
        if self._turns.get(session) is turn:
            del self._turns[session]
        for msg_id in [i for i, p in self._pending.items() if p.turn is turn]:
            del self._pending[msg_id]


def _new_future() -> asyncio.Future[Any]:
    return new_ack()


def _resume_request(turn: Turn) -> Message:
    """``resume`` from the last seq applied here: the server replays only what we lack."""
    extra: dict[str, Any] = {"after": turn.seq}
    if turn.turn >= 0:  # unknown for a turn joined with attach(turn=None)
        extra["turn"] = turn.turn
    return control_request("resume", turn.session, turn.token, **extra)


def connect(
    url: str,
    *,
    api_key: str | None = None,
    codec: CodecName = "msgpack",
    reconnect: bool | ReconnectPolicy = True,
    open_timeout: float = 10.0,
    ws_options: Mapping[str, Any] | None = None,
) -> Client:
    """A client for ``url``: use as ``async with connect(url) as c`` (or ``await``)."""
    return Client(
        url,
        api_key=api_key,
        codec=codec,
        reconnect=reconnect,
        open_timeout=open_timeout,
        ws_options=ws_options,
    )
