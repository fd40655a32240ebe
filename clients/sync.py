"""A blocking wrapper around the asyncio client, for scripts and notebooks.

The asyncio client runs on an event loop in a background thread; each call
here hands a coroutine to that loop and waits for its result, so reconnects
and keep-alive pings go on while the caller's thread is busy elsewhere.

    with wsinfer.clients.sync.connect("ws://127.0.0.1:8000/v1/ws") as client:
        for text in client.generate(prompt="Hello"):
            print(text, end="")
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from wsinfer.clients.client import Client, ReconnectPolicy
from wsinfer.clients.codec import CodecName
from wsinfer.clients.protocol import ChatMessage
from wsinfer.clients.turn import Turn
from wsinfer.contract import Usage

__all__ = ["SyncClient", "SyncTurn", "connect"]

T = TypeVar("T")


class _LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="wsinfer-sync", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class SyncTurn:
    """Blocking view of a ``Turn``: iterate for text, and stop/pause/resume it."""

    def __init__(self, runner: _LoopThread, turn: Turn) -> None:
        self._runner = runner
        self.aturn = turn

    def __iter__(self) -> Iterator[str]:
        deltas = self.aturn.__aiter__()
        while True:
            try:
                yield self._runner.run(_next(deltas))
            except StopAsyncIteration:
                return

    def wait(self) -> str:
        return self._runner.run(self.aturn.wait())

    def stop(self) -> str | None:
        return self._runner.run(self.aturn.stop())

    def pause(self) -> int:
        return self._runner.run(self.aturn.pause())

    def resume(self) -> None:
        self._runner.run(self.aturn.resume())

    def control(self, kind: str) -> None:
        """Any control of the turn by its type, as ``Turn.control``."""
        self._runner.run(self.aturn.control(kind))

    def stop_soon(self) -> None:
        """Stop without waiting (safe from any thread)."""
        self._runner.loop.call_soon_threadsafe(self.aturn.stop_soon)

    # Reads of the asyncio turn are safe from this thread: the loop thread only
    # ever replaces these values whole.
    @property
    def session(self) -> str:
        return self.aturn.session

    @property
    def token(self) -> str:
        return self.aturn.token

    @property
    def turn(self) -> int:
        return self.aturn.turn

    @property
    def seq(self) -> int:
        return self.aturn.seq

    @property
    def text(self) -> str:
        return self.aturn.text

    @property
    def status(self) -> str | None:
        return self.aturn.status

    @property
    def finish_reason(self) -> str | None:
        return self.aturn.finish_reason

    @property
    def usage(self) -> Usage | None:
        return self.aturn.usage


async def _next(deltas: Any) -> str:
    text: str = await deltas.__anext__()
    return text


class SyncClient:
    """A connected client; close it (or use ``with``) to stop its thread."""

    def __init__(self, client: Client) -> None:
        self._runner = _LoopThread()
        self._client = client
        try:
            self._runner.run(client.open())
        except BaseException:
            self._runner.stop()
            raise

    def start(
        self,
        *,
        messages: Sequence[ChatMessage] | None = None,
        prompt: str | None = None,
        params: Mapping[str, Any] | None = None,
        session: str | None = None,
        token: str | None = None,
    ) -> SyncTurn:
        turn = self._runner.run(
            self._client.start(
                messages=messages, prompt=prompt, params=params, session=session, token=token
            )
        )
        return SyncTurn(self._runner, turn)

    def generate(
        self,
        *,
        messages: Sequence[ChatMessage] | None = None,
        prompt: str | None = None,
        params: Mapping[str, Any] | None = None,
        session: str | None = None,
        token: str | None = None,
    ) -> Iterator[str]:
        """Start a turn now (so errors raise here) and return an iterator of its text."""
        turn = self.start(
            messages=messages, prompt=prompt, params=params, session=session, token=token
        )
        return _stopping(turn)

    def close_session(self, session: str, token: str | None = None) -> None:
        self._runner.run(self._client.close_session(session, token))

    def close(self) -> None:
        if not self._runner.loop.is_closed():
            self._runner.run(self._client.close())
            self._runner.stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _stopping(turn: SyncTurn) -> Iterator[str]:
    # Like the asyncio generate(): walking away early stops the turn.
    try:
        yield from turn
    finally:
        if not turn.aturn.finished:
            turn.stop_soon()


def connect(
    url: str,
    *,
    api_key: str | None = None,
    codec: CodecName = "msgpack",
    reconnect: bool | ReconnectPolicy = True,
    open_timeout: float = 10.0,
    ws_options: Mapping[str, Any] | None = None,
) -> SyncClient:
    """Connect now and return a blocking client."""
    client = Client(
        url,
        api_key=api_key,
        codec=codec,
        reconnect=reconnect,
        open_timeout=open_timeout,
        ws_options=ws_options,
    )
    return SyncClient(client)
