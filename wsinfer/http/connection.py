"""HTTP/1.1 on an asyncio transport, parsed by h11: requests in, (streamed) responses out.

h11 is the sans-I/O HTTP/1.1 state machine (python-hyper): it does the parsing,
keep-alive, chunked bodies and protocol-error detection; this module only
moves bytes and runs one request at a time through ``Application.handle``.

A client that goes away cancels the request's task at once, so a streamed
response stops following its session (the generation itself goes on
unwatched, as after a WebSocket disconnect).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

import h11
import structlog
from websockets.datastructures import Headers

log = structlog.get_logger("wsinfer.http")

_REASONS = {s.value: s.phrase for s in HTTPStatus}
# Keep-alive: a connection idle this long between requests is closed.
IDLE_TIMEOUT_S = 75.0
# After refusing a request, how long its unread body is drained before closing.
LINGER_S = 2.0
# A request head or body that takes longer than this is refused.
READ_TIMEOUT_S = 30.0


@dataclass
class HttpRequest:
    method: str
    target: str
    headers: Headers
    body: bytes = b""

    @property
    def path(self) -> str:
        return urlsplit(self.target).path

    @property
    def query(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(urlsplit(self.target).query).items()}


@dataclass
class HttpResponse:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None  # a streamed body (chunked), after the head
    cleanup: Callable[[], None] | None = None  # runs however the response ends

    @classmethod
    def json(cls, status: int, data: Any, headers: list[tuple[str, str]] | None = None) -> Any:
        body = json.dumps(data, ensure_ascii=False).encode()
        return cls(status, [("Content-Type", "application/json"), *(headers or [])], body)


class Application(Protocol):
    async def handle(self, request: HttpRequest) -> HttpResponse: ...

    def refuse(self, status: int, message: str) -> HttpResponse:
        """A response for a request the HTTP layer itself refuses (malformed, too big)."""
        ...


class RequestTooLarge(Exception):
    pass


class HttpConnection(asyncio.Protocol):
    """One client's HTTP/1.1 connection, taken over from the front door.

    ``upgrade`` is called with the raw bytes of a later request on this
    connection that asks for a WebSocket; it takes the transport over.
    """

    def __init__(
        self,
        app: Application,
        transport: asyncio.Transport,
        parser: h11.Connection,
        *,
        max_body: int,
        upgrade: Callable[[bytes], None],
        on_close: Callable[[HttpConnection], None],
    ) -> None:
        self.app = app
        self.transport = transport
        self.h11 = parser
        self.max_body = max_body
        self._upgrade = upgrade
        self._on_close = on_close
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = False
        self._discarding = False  # after refusing a request whose body is still coming
        self._eof = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.transport.set_protocol(self)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    # --- asyncio.Protocol -------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self.h11.receive_data(data)
        self._readable.set()

    def eof_received(self) -> bool:
        self._eof.set()
        if not self._discarding:
            self.h11.receive_data(b"")
            self._readable.set()
        return True  # half-open: a response may still be on its way

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._writable.set()
        self._eof.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # --- the request loop -----------------------------------------------------------

    async def _serve(self) -> None:
        try:
            while not self._lost:
                request = await self._read_request()
                if request is None:
                    return
                if wants_websocket(request.method, request.headers.get("Upgrade", "")):
                    self._hand_over(request)
                    return
                if not await self._respond(await self.app.handle(request)):
                    return
                self.h11.start_next_cycle()
        except (h11.RemoteProtocolError, RequestTooLarge) as exc:
            await self._refuse(exc)
        except asyncio.CancelledError:
            pass  # the client went away (or the frontend is stopping)
        except Exception:
            log.exception("http connection failed")
        finally:
            self._close()

    async def _next_event(self, timeout: float) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self._readable.clear()
            await asyncio.wait_for(self._readable.wait(), timeout)

    async def _read_request(self) -> HttpRequest | None:
        try:
            event = await self._next_event(IDLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None
        if not isinstance(event, h11.Request):
            return None  # the client closed the connection between requests
        headers = Headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        request = HttpRequest(event.method.decode(), event.target.decode("latin-1"), headers)
        length = headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise RequestTooLarge(f"the body is over {self.max_body} bytes")
        request.body = await asyncio.wait_for(self._read_body(), READ_TIMEOUT_S)
        return request

    async def _read_body(self) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event(READ_TIMEOUT_S)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body:
                    raise RequestTooLarge(f"the body is over {self.max_body} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise h11.RemoteProtocolError("connection closed in the middle of a body")

    async def _respond(self, response: HttpResponse) -> bool:
        """Send one response; False when the connection must close afterwards."""
        try:
            headers = [(k, v) for k, v in response.headers]
            if response.stream is None:
                headers.append(("Content-Length", str(len(response.body))))
            reason = _REASONS.get(response.status, "")
            self._write(h11.Response(status_code=response.status, headers=headers, reason=reason))
            if response.stream is None:
                self._write(h11.Data(data=response.body))
            else:
                async for chunk in response.stream:
                    self._write(h11.Data(data=chunk))
                    await self._writable.wait()
            self._write(h11.EndOfMessage())
        finally:
            if response.cleanup is not None:
                response.cleanup()
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    async def _refuse(self, exc: Exception) -> None:
        if self._lost or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        status = 413 if isinstance(exc, RequestTooLarge) else 400
        if isinstance(exc, h11.RemoteProtocolError):
            status = exc.error_status_hint
        response = self.app.refuse(status, str(exc) or "malformed HTTP request")
        response.headers.append(("Connection", "close"))
        with contextlib.suppress(h11.LocalProtocolError):
            await self._respond(response)
        await self._linger()

    async def _linger(self) -> None:
        """Read and drop what the client is still sending before closing: closing a
        socket with unread data resets it, and the client would never see our answer."""
        self._discarding = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._eof.wait(), LINGER_S)

    def _write(self, event: Any) -> None:
        data = self.h11.send(event)
        if data and not self._lost:
            self.transport.write(data)

    def _hand_over(self, request: HttpRequest) -> None:
        """A WebSocket upgrade after other requests on this connection: to websockets."""
        self._lost = True  # this object is done with the transport
        self._upgrade(raw_head(request) + self.h11.trailing_data[0])

    def _close(self) -> None:
        self._on_close(self)
        if not self._lost:
            self._lost = True
            self.transport.close()


def wants_websocket(method: str, upgrade: str) -> bool:
    """A WebSocket opening handshake goes to websockets; anything else is plain HTTP."""
    return method == "GET" and "websocket" in upgrade.lower()


def raw_head(request: HttpRequest) -> bytes:
    """The request head again, for websockets to parse and answer itself."""
    lines = [f"{request.method} {request.target} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in request.headers.raw_items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
