"""A WebSocket connection's outgoing frames: one socket write per batch.

The fan-in hands a round's events to many connections at once. Each
connection schedules one send with ``call_soon``, so everything that round
(or one request) produced for it leaves in a single ``transport.write``: one
syscall per connection per round, not one ``await ws.send`` per message, and
no writer task to wake while the client keeps up.

Only a client that falls behind (the socket's buffer above websockets'
high-water mark) takes the awaited path: a task waits for the buffer to
drain, then sends everything that piled up meanwhile, which the protocol has
merged into fewer frames by then.

Compression: a delta frame is about 100 bytes, and deflating each one cost a
relaying frontend about 6% of its CPU to save a few dozen bytes. Messages
shorter than ``DEFLATE_MIN_BYTES`` go out uncompressed (RFC 7692 lets any
message be sent plain: RSV1 unset), as in the ``ws`` library's threshold;
longer ones (a replay, a lagging client's merged deltas) are still deflated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from websockets.asyncio.server import ServerConnection
from websockets.extensions.base import Extension
from websockets.extensions.permessage_deflate import (
    PerMessageDeflate,
    ServerPerMessageDeflateFactory,
)
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.typing import ExtensionParameter

from wsinfer.contract import ServerMessage
from wsinfer.protocol import ConnectionProtocol

DEFLATE_MIN_BYTES = 1024


class _DeflateLarge(PerMessageDeflate):
    """permessage-deflate that sends short unfragmented messages plain."""

    def encode(self, frame: Frame) -> Frame:
        if (
            frame.fin
            and frame.opcode in (Opcode.TEXT, Opcode.BINARY)
            and len(frame.data) < DEFLATE_MIN_BYTES
        ):
            return frame
        return super().encode(frame)


class DeflateLargeFactory(ServerPerMessageDeflateFactory):
    """websockets' default server compression settings, with ``_DeflateLarge``."""

    def __init__(self) -> None:
        super().__init__(
            server_max_window_bits=12,
            client_max_window_bits=12,
            compress_settings={"memLevel": 5},
        )

    def process_request_params(
        self, params: Sequence[ExtensionParameter], accepted_extensions: Sequence[Extension]
    ) -> tuple[list[ExtensionParameter], PerMessageDeflate]:
        response, ext = super().process_request_params(params, accepted_extensions)
        return response, _DeflateLarge(
            ext.remote_no_context_takeover,
            ext.local_no_context_takeover,
            ext.remote_max_window_bits,
            ext.local_max_window_bits,
            ext.compress_settings,
        )


class Sender:
    """Moves a ``ConnectionProtocol``'s output to its WebSocket.

    ``sent`` is called with each message as it is written (the metrics clock);
    ``progressed`` after each write, so the connection can re-check its
    outgoing budget.
    """

    def __init__(
        self,
        ws: ServerConnection,
        protocol: ConnectionProtocol,
        sent: Callable[[ServerMessage], None],
        progressed: Callable[[], None],
    ) -> None:
        self.ws = ws
        self.protocol = protocol
        self._sent = sent
        self._progressed = progressed
        self._scheduled = False
        self._behind = False  # above the high-water mark: only ``run`` writes
        self._wake = asyncio.Event()

    @property
    def buffered(self) -> int:
        """Bytes handed to the socket that it has not sent yet."""
        transport = self.ws.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def schedule(self) -> None:
        """Send what the protocol holds once the running callback is done, so
        that every delivery of the same fan-in round shares the write."""
        if not self._scheduled and not self._behind:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send_now)

    def _send_now(self) -> None:
        self._scheduled = False
        if self._behind:
            return
        self._write()
        if self.ws.paused:  # websockets' flow control: the buffer passed high water
            self._behind = True
            self._wake.set()
        self._progressed()

    def _write(self) -> None:
        batch = self.protocol.data_to_send()
        ws = self.ws
        if not batch or ws.protocol.state is not State.OPEN:
            return  # closing: what is left has nowhere to go, the reader ends it
        for out in batch:
            self._sent(out.message)
            frame = out.frame
            if isinstance(frame, str):
                ws.protocol.send_text(frame.encode())
            else:
                ws.protocol.send_binary(frame)
        # Only data frames were queued in state OPEN: no end-of-stream marker.
        ws.transport.write(b"".join(ws.protocol.data_to_send()))

    async def run(self) -> None:
        """Wait out a slow client: drain, send what piled up, until caught up."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                while self._behind:
                    await self.ws.drain()
                    self._write()
                    self._behind = self.ws.paused
            except Exception:  # lost while draining: what is queued has nowhere to go,
                self._behind = False  # and the reader waiting for the budget must go on
                self.protocol.data_to_send()
                return
            finally:
                self._progressed()
