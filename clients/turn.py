"""``Turn`` (one streaming answer) and ``Conversation`` (a multi-turn session).

The client's reader feeds turns; callers iterate them. Text is kept in the
turn, not in a queue, so any number of iterators (and ``wait()``) see all of
it, and ``turn.text`` is always what has been applied so far.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from wsinfer.clients.errors import WsinferError
from wsinfer.clients.protocol import ChatMessage, TurnState
from wsinfer.contract import CLIENT_MESSAGES, ClientMessageType, Usage


class Client(Protocol):
    """What a turn and a conversation ask of their client (``client.Client`` is
    it): a protocol here, so that this module does not import the client, which
    imports it."""

    async def start(
        self,
        *,
        messages: Sequence[ChatMessage] | None = None,
        prompt: str | None = None,
        params: Mapping[str, Any] | None = None,
        session: str | None = None,
        token: str | None = None,
    ) -> Turn: ...

    async def close_session(self, session: str, token: str | None = None) -> None: ...

    async def send_control(
        self, turn: Turn, kind: ClientMessageType, ack: asyncio.Future[None] | None
    ) -> None: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None: ...


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # Control acks only ever carry errors, and only a waiting caller reads
    # them; mark them retrieved so asyncio does not warn about the others.
    if not fut.cancelled():
        fut.exception()


def new_ack() -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.add_done_callback(_retrieve)
    return fut


class Turn:
    """One turn of a session, streaming text deltas.

    ``async for text in turn`` yields each delta exactly once, in order, across
    reconnects. When the turn ends with ``finish_reason == "error"`` the
    iteration (and ``wait()``) raises the mapped ``WsinferError`` after the
    text that did arrive; ``turn.finish_reason`` and ``turn.error`` say so too.
    Its state (``TurnState``) belongs to the client's sans-I/O core; this
    object only wakes the callers waiting on it.
    """

    def __init__(self, client: Client, state: TurnState) -> None:
        self._client = client
        self.state = state
        state.handle = self
        self._wakeup: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._events = 0

    # --- what the caller reads ----------------------------------------------

    @property
    def session(self) -> str:
        return self.state.session

    @property
    def token(self) -> str:
        return self.state.token

    @property
    def turn(self) -> int:
        return self.state.turn

    @property
    def seq(self) -> int:
        return self.state.seq

    @property
    def text(self) -> str:
        return self.state.text

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """With ``params={"logprobs": True}``: each token's entry so far (docs/protocol.md)."""
        return self.state.logprobs

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls the model made (a turn with ``params.tools``), in OpenAI's shape:
        ``{index, id, type: "function", function: {name, arguments}}``."""
        return self.state.tool_calls

    @property
    def drawn_calls(self) -> list[dict[str, Any]]:
        """A turn held to its calls (``tool_choice`` required or a named function):
        each call as the model has drawn it so far, in the shape of ``tool_calls``,
        its ``arguments`` growing with each delta (JSON only once the call is whole)."""
        return [self.state.drawn_calls[i] for i in sorted(self.state.drawn_calls)]

    @property
    def status(self) -> str | None:
        """``queued``, ``running``, ``paused`` or ``done``, as the server last said."""
        return None if self.state.status is None else self.state.status.value

    @property
    def finish_reason(self) -> str | None:
        return self.state.finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.state.usage

    @property
    def paused(self) -> bool:
        return self.state.paused

    @property
    def error(self) -> WsinferError | None:
        return self.state.error or self.state.failure

    @property
    def finished(self) -> bool:
        """Done on the server, or given up on by the client."""
        return self.state.finished

    @property
    def stop_requested(self) -> bool:
        return ClientMessageType.STOP.value in self.state.requested

    def __repr__(self) -> str:
        return (
            f"<Turn session={self.session} turn={self.turn} seq={self.seq} "
            f"finish_reason={self.finish_reason}>"
        )

    # --- fed by the client ----------------------------------------------------

    def changed(self) -> None:
        """The core applied an event to this turn (or gave up on it)."""
        self._events += 1
        wakeup, self._wakeup = self._wakeup, asyncio.get_running_loop().create_future()
        if not wakeup.done():
            wakeup.set_result(None)

    # --- iteration --------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        index = 0
        while True:
            parts = self.state.parts
            while index < len(parts):
                yield parts[index]
                index += 1
            if self.finished:
                self._raise_if_failed()
                return
            # Shielded: a cancelled reader must not cancel the shared future.
            await asyncio.shield(self._wakeup)

    def _raise_if_failed(self) -> None:
        error = self.error
        if error is not None:
            raise error

    async def wait(self) -> str:
        """Wait for the end of the turn; return its whole text (raise if it failed)."""
        await self._until(lambda: self.finished)
        self._raise_if_failed()
        return self.text

    # --- control ---------------------------------------------------------------

    async def control(self, kind: ClientMessageType | str) -> None:
        """Send a control of the turn by its type (``contract.CLIENT_MESSAGES``) and
        wait for what answers it: a stop's ``done``; a pause's ``paused`` (or the
        turn's end); for one answered ``session`` (a resume), the turn streaming
        again, or its end. A refusal raises."""
        kind = ClientMessageType(kind)
        seen, was_finished = self._events, self.finished
        ack = new_ack()
        await self._client.send_control(self, kind, ack)
        if CLIENT_MESSAGES[kind].rejoins:
            # A `paused` replayed from before the resume is not "streaming again".
            await self._until(
                lambda: (
                    (self._events != seen and not self.paused)
                    or (self.finished and not was_finished)
                ),
                ack,
            )
            self._raise_if_failed()
        else:
            await self._until(lambda: self.finished or self.state.answered(kind), ack)

    async def stop(self, *, wait: bool = True) -> str | None:
        """Ask the server to end the turn; by default wait for its ``done``.

        Returns the finish reason (``"cancelled"``, or how it ended first).
        """
        if self.finished:
            return self.finish_reason
        if wait:
            await self.control(ClientMessageType.STOP)
        else:
            await self._client.send_control(self, ClientMessageType.STOP, new_ack())
        return self.finish_reason

    async def pause(self) -> int:
        """Halt generation, keeping the turn; returns the seq it halted at."""
        pausing = ClientMessageType.PAUSE.value in self.state.requested
        if self.finished or (pausing and self.paused):
            return self.seq
        await self.control(ClientMessageType.PAUSE)
        return self.seq

    async def resume(self) -> None:
        """Continue a paused turn; returns once the server streams again."""
        if not self.finished:
            await self.control(ClientMessageType.RESUME)

    def stop_soon(self) -> None:
        """Stop without waiting, from code that must not await (e.g. a finalizer)."""
        if not self.finished and not self.stop_requested:
            # Recorded now, so that waiters see it before the task runs.
            self.state.requested[ClientMessageType.STOP.value] = None
            self._client.spawn(self.stop(wait=False))

    async def _until(
        self, ready: Callable[[], bool], ack: asyncio.Future[None] | None = None
    ) -> None:
        """Wait until ``ready()``; raise if the server refuses ``ack``'s request."""
        while not ready():
            if self.state.failure is not None:
                raise self.state.failure
            waiters: list[Awaitable[Any]] = [self._wakeup] if ack is None else [self._wakeup, ack]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            if ack is not None and ack.done():
                ack.result()
                ack = None  # settled without error: only `ready` matters now


class Conversation:
    """A multi-turn session: remembers the session id and token between turns."""

    def __init__(
        self,
        client: Client,
        *,
        session: str | None = None,
        token: str | None = None,
        system: str | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._client = client
        self.session = session
        self.token = token
        self.system = system
        self.params = dict(params or {})
        self.last_turn: Turn | None = None
        self._sending: Turn | None = None  # the turn a send() generator is yielding

    async def start(
        self,
        text: str | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Turn:
        """Start the next turn with a user message (or explicit ``messages``)."""
        await self._previous_stopped()
        turn = await self._client.start(
            messages=self._messages(text, messages),
            params={**self.params, **(params or {})},
            session=self.session,
            token=self.token,
        )
        self.session, self.token, self.last_turn = turn.session, turn.token, turn
        return turn

    async def _previous_stopped(self) -> None:
        """Make sure the previous turn is over before the next ``generate``.

        A ``send()`` left early is stopped by its generator's finalizer, which
        asyncio runs a loop iteration or two later; starting the next turn
        means the caller has moved on, so stop it now and wait for its
        ``done`` rather than let the server answer ``conflict``. A turn from
        ``start()`` is the caller's to manage: it is left alone.
        """
        last = self.last_turn
        if last is None or last.finished:
            return
        if last.stop_requested or last is self._sending:
            with contextlib.suppress(WsinferError):
                await last.stop()

    def _messages(
        self, text: str | None, messages: Sequence[ChatMessage] | None
    ) -> list[ChatMessage]:
        if (text is None) == (messages is None):
            raise ValueError("pass exactly one of text and messages=")
        out: list[ChatMessage] = (
            list(messages) if messages is not None else [{"role": "user", "content": text or ""}]
        )
        # The system prompt belongs to the session, so only its first turn sends it.
        if self.session is None and self.system:
            out.insert(0, {"role": "system", "content": self.system})
        return out

    async def send(
        self, text: str, *, params: Mapping[str, Any] | None = None
    ) -> AsyncIterator[str]:
        """Send a user message and yield the answer's deltas."""
        turn = await self.start(text, params=params)
        self._sending = turn
        try:
            async for delta in turn:
                yield delta
        finally:
            self._sending = None
            turn.stop_soon()

    async def close(self) -> None:
        """End the session on the server (``close``) and forget it here."""
        if self.session is not None and self.token is not None:
            await self._client.close_session(self.session, self.token)
        self.session = self.token = self.last_turn = None
