"""Asyncio client for the wsinfer WebSocket protocol (v1).

A thin adapter around the sans-I/O ``ClientProtocol`` (clients/protocol.py),
which holds the pending requests, routes answers by ``id`` and turn events by
``session``, and decides what a fresh connection repeats. This module only
moves frames: one ``Client`` owns one WebSocket at a time and a supervisor
task that reads it and, while the core wants a connection, reconnects with
backoff.

Usage::

    async with wsinfer.connect("ws://127.0.0.1:8000/v1/ws") as client:
        async for text in client.generate(prompt="Once upon a time"):
            print(text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
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
from wsinfer.clients.errors import ClientClosed, ConnectionLost, Unauthorized, WsinferError
from wsinfer.clients.protocol import (
    ChatMessage,
    ClientEvent,
    ClientProtocol,
    GenerateAnswered,
    Message,
    RequestFailed,
)
from wsinfer.clients.turn import Conversation, Turn, new_ack
from wsinfer.contract import ClientMessageType

__all__ = ["Client", "ReconnectPolicy", "connect"]

log = logging.getLogger("wsinfer.clients")


@dataclass(frozen=True)
class ReconnectPolicy:
    """How hard to try to get a dropped connection back before failing live turns.

    ``max_time`` is the bound that matters (attempts are many, and backed off):
    long enough for a restart of ``wsinfer serve`` (a warm start is seconds)."""

    max_attempts: int = 40
    max_time: float = 60.0
    base_delay: float = 0.1
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        # Equal jitter: at least half of the exponential step, so retries really
        # back off, and random in the other half so that many clients cut by
        # the same frontend restart do not come back in lockstep.
        step = min(self.max_delay, self.base_delay * 2**attempt)
        return step / 2 + random.uniform(0, step / 2)


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
        self._core = ClientProtocol(reconnect=self._policy is not None)
        self._open_timeout = open_timeout
        self._ws_options = dict(ws_options or {})
        self._ws: ClientConnection | None = None  # set only once attached
        self._supervisor: asyncio.Task[WsinferError | None] | None = None
        self._changed: asyncio.Future[None] | None = None
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
        self._handle(self._core.fail_all(ClientClosed("the client was closed"), everything=True))

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
        """Start a turn (a new session, or the next turn of ``session``) and return it.

        A connection lost before the answer does not lose the turn: the
        reconnect sends the same ``generate`` (same idempotency key), and the
        server answers the turn it already started, if it did.
        """
        answer: asyncio.Future[Turn] = new_ack()
        await self._connection()
        self._core.generate(
            answer, messages=messages, prompt=prompt, params=params, session=session, token=token
        )
        await self._flush()
        return await answer

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
            token = self._core.tokens.get(session)
        return Conversation(self, session=session, token=token, system=system, params=params)

    async def attach(
        self, session: str, token: str, *, turn: int | None = None, after: int = 0
    ) -> Turn:
        """Follow a turn started elsewhere (another process, a lost client)."""
        attached = Turn(self, self._core.attach(session, token, turn, after))
        await self.send_control(attached, ClientMessageType.RESUME, None)
        return attached

    async def close_session(self, session: str, token: str | None = None) -> None:
        """End a session on the server (``close``).

        The protocol does not acknowledge ``close``; a refusal is only logged.
        A turn of that session still running here ends with ``ClientClosed``.
        """
        self._handle(self._core.close_session(session, token))
        await self._connection()
        await self._flush()

    # --- used by Turn ----------------------------------------------------------------

    async def send_control(
        self, turn: Turn, kind: ClientMessageType, ack: asyncio.Future[None] | None
    ) -> None:
        """A control of the turn (stop, pause, resume...), repeated after a reconnect."""
        await self._connection()
        self._core.control(turn.state, kind, ack)
        await self._flush()

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

    async def _flush(self) -> None:
        """Send what the core has queued, on the attached connection.

        Without one the messages wait: the supervisor drains the outbox once
        it has re-joined a fresh connection.
        """
        ws = self._ws
        if ws is not None:
            await self._send_all(ws, self._core.data_to_send())

    async def _send_all(self, ws: ClientConnection, messages: list[Message]) -> bool:
        for index, msg in enumerate(messages):
            try:
                await ws.send(self._codec.encode(msg))
            except ConnectionClosed:
                # The reader notices too; the core repeats what must be repeated.
                self._core.send_failed(messages[index:])
                self._drop_connection(ws)
                return False
        return True

    # --- connection ------------------------------------------------------------------

    async def _connection(self) -> None:
        """Wait for an attached connection, reconnecting first if it dropped while idle."""
        while True:
            if self._closed:
                raise ClientClosed("the client is closed")
            if self._ws is not None:
                return
            supervisor = self._supervisor
            if supervisor is None or supervisor.done():
                if self._policy is None and self._failure is not None:
                    raise self._failure
                supervisor = self._supervisor = asyncio.create_task(self._supervise(None))
            waiters: list[asyncio.Future[Any]] = [supervisor, self._changed_future()]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
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
        """Own the connection: read it, and get it back while the core needs one."""
        try:
            while True:
                if ws is None:
                    ws = await self._redial()
                await self._serve(ws)
                ws = None
                self._ws = None
                self._handle(self._core.connection_lost())
                self._signal()
                if self._closed:
                    return None
                if self._policy is None:
                    raise ConnectionLost("the connection dropped and reconnect is off")
                if not self._core.wants_connection():
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
        self._handle(self._core.fail_all(exc))
        return exc

    async def _serve(self, ws: ClientConnection) -> None:
        try:
            if await self._attach(ws):
                async for frame in ws:
                    self._receive(frame)
        except (ConnectionClosed, OSError):
            pass

    async def _attach(self, ws: ClientConnection) -> bool:
        """Adopt a fresh connection: what the core repeats goes out before anyone else sends."""
        self._codec = codec_for_subprotocol(ws.subprotocol)
        messages = self._core.connection_made()
        while messages:  # requests made meanwhile queue behind the repeats
            if not await self._send_all(ws, messages):
                return False
            messages = self._core.data_to_send()
        self._ws = ws
        self._failure = None
        self._signal()
        return True

    # --- receiving -------------------------------------------------------------------

    def _receive(self, frame: str | bytes) -> None:
        try:
            msg = self._codec.decode(frame)
            events = self._core.receive(msg)
        except (DecodeError, KeyError, TypeError, ValueError) as exc:
            # One malformed message must not take down the reader and with it
            # every turn on this connection.
            log.warning("ignoring malformed server message: %r", exc)
            return
        self._handle(events)

    def _handle(self, events: list[ClientEvent]) -> None:
        """Carry out what the core decided: settle waiters, wake turns."""
        for event in events:
            if isinstance(event, GenerateAnswered):
                self._on_started(event)
            elif isinstance(event, RequestFailed):
                _settle(event.waiter, event.error)
            elif event.turn.handle is not None:
                event.turn.handle.changed()

    def _on_started(self, event: GenerateAnswered) -> None:
        turn = Turn(self, event.turn)
        if event.waiter.done():
            turn.stop_soon()  # its caller gave up waiting: do not leave it generating
        else:
            event.waiter.set_result(turn)


def _settle(waiter: asyncio.Future[Any] | None, exc: WsinferError) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_exception(exc)


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
