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
from websockets.exceptions import InvalidHeader

from wsinfer.http.framing import Refusal, check_head
from wsinfer.limits import TokenBucket
from wsinfer.waiting import wait_set

log = structlog.get_logger("wsinfer.http")

_REASONS = {s.value: s.phrase for s in HTTPStatus}
# Keep-alive: a connection idle this long between requests is closed.
IDLE_TIMEOUT_S = 75.0
# From its first byte, every request head (not only a connection's first) must be
# whole within this (slowloris); its body within BODY_TIMEOUT_S of the head.
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
# After refusing a request, how long its unread body is drained before closing.
LINGER_S = 2.0
# Bytes read ahead of the request being served. Beyond this the socket is not read
# until the request is answered: a pipelining client is held by TCP, not our memory.
READ_AHEAD_BYTES = 64 * 1024
# An error message quotes at most this much of the client's input.
MAX_QUOTE_CHARS = 200
# The error code of each refusal the HTTP layer makes itself (the app maps the rest).
REFUSAL_CODES = {405: "method", 408: "timeout", 413: "too_large", 414: "too_large"}
REFUSAL_CODES |= {429: "overloaded", 431: "too_large"}


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

    def refuse(
        self, status: int, message: str, code: str, retry_after: float | None = None
    ) -> HttpResponse:
        """A response for a request the HTTP layer itself refuses (malformed, too big)."""
        ...


class HttpConnection(asyncio.Protocol):
    """One client's HTTP/1.1 connection, taken over from the front door.

    Flow control, as on a WebSocket connection: at most ``READ_AHEAD_BYTES``
    are read ahead of the request being served (then the socket is not read),
    and the next request is not read before the last response has drained
    below ``max_outgoing`` bytes. A client that hangs up (EOF) while its
    request is in flight abandons the request at once: a response that was
    following a session stops following it.

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
        max_outgoing: int,
        request_rate: float,
        upgrade: Callable[[bytes], None],
        on_close: Callable[[HttpConnection], None],
    ) -> None:
        self.app = app
        self.transport = transport
        self.h11 = parser
        self.max_body = max_body
        self.max_outgoing = max_outgoing
        self.bucket = TokenBucket(request_rate, max(1.0, 2 * request_rate))
        self._upgrade = upgrade
        self._on_close = on_close
        self._inbox = bytearray()  # read, not yet given to h11
        self._reading_paused = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost = False
        self._eof = asyncio.Event()
        self._eof_fed = False  # h11 has been told of the EOF
        self._in_flight = False  # a request is being handled or answered
        self._head_request = False  # the request being answered is a HEAD: no body
        self._discarding = False  # after refusing a request whose body is still coming
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.transport.set_protocol(self)
        self.transport.set_write_buffer_limits(self.max_outgoing, self.max_outgoing // 2)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    # --- asyncio.Protocol -------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._inbox += data
        if len(self._inbox) >= READ_AHEAD_BYTES and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()
        self._readable.set()

    def eof_received(self) -> bool:
        self._eof.set()
        self._readable.set()
        if self._in_flight and self.task is not None:
            self.task.cancel()  # the client hung up: stop following its session now
        return True  # half-open: a refusal may still be on its way

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
            while not self._lost and not self.transport.is_closing():
                request = await self._read_request()
                if request is None:
                    return
                if _is_handshake(request):
                    self._hand_over(request)
                    return
                if not await self._answer(request):
                    return
                self.h11.start_next_cycle()
        except (h11.RemoteProtocolError, Refusal) as exc:
            await self._refuse(exc)
        except asyncio.CancelledError:
            pass  # the client went away (or the frontend is stopping)
        except Exception:
            log.exception("http connection failed")
        finally:
            self._close()

    async def _answer(self, request: HttpRequest) -> bool:
        """Handle one request and send its response; False when the connection must close."""
        self._in_flight = True
        try:
            wait = self.bucket.take()
            if wait > 0:  # as a WebSocket request over --request-rate: refused, not acted on
                response = self._refusal(Refusal(429, "too many requests", retry_after=wait))
            else:
                response = await self.app.handle(request)
            keep_alive = await self._respond(response)
            await self._writable.wait()  # nothing more is read while the client does not read
            return keep_alive
        finally:
            self._in_flight = False

    async def _next_event(self, deadline: float) -> Any:
        """h11's next event, reading (until ``deadline``, loop time) as it needs."""
        loop = asyncio.get_running_loop()
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            if not self._feed():
                self._readable.clear()
                if not await wait_set(self._readable, deadline - loop.time()):
                    raise TimeoutError

    def _feed(self) -> bool:
        """Give h11 what has been read (and resume reading); False if there was nothing."""
        if self._inbox:
            data, self._inbox = bytes(self._inbox), bytearray()
            self.h11.receive_data(data)
            if self._reading_paused and not self._lost:
                self._reading_paused = False
                self.transport.resume_reading()
            return True
        if self._eof.is_set() and not self._eof_fed:
            self._eof_fed = True
            self.h11.receive_data(b"")
            return True
        return False

    async def _read_request(self) -> HttpRequest | None:
        event = await self._read_head()
        if not isinstance(event, h11.Request):
            return None  # the client closed the connection between requests
        self._head_request = event.method == b"HEAD"
        check_head(event)
        try:
            headers = Headers((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        except InvalidHeader as exc:  # h11 lets control characters through; websockets not
            raise Refusal(400, f"invalid header field {exc.name!r}") from None
        request = HttpRequest(event.method.decode(), event.target.decode("latin-1"), headers)
        length = next(iter(headers.get_all("Content-Length")), None)  # h11: one value
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise Refusal(413, f"the body is over {self.max_body} bytes")
        request.body = await self._read_body()
        return request

    async def _read_head(self) -> Any:
        """The next request head: up to IDLE_TIMEOUT_S for it to start, then
        HEAD_TIMEOUT_S for it to be whole. None if the client left or idled out."""
        loop = asyncio.get_running_loop()
        if not self._inbox and not self.h11.trailing_data[0] and not self._eof.is_set():
            self._readable.clear()
            if not await wait_set(self._readable, IDLE_TIMEOUT_S):
                return None
        try:
            return await self._next_event(loop.time() + HEAD_TIMEOUT_S)
        except TimeoutError:
            raise Refusal(408, f"the request head took over {HEAD_TIMEOUT_S:g} s") from None

    async def _read_body(self) -> bytes:
        deadline = asyncio.get_running_loop().time() + BODY_TIMEOUT_S
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                event = await self._next_event(deadline)
            except TimeoutError:
                raise Refusal(408, f"the request body took over {BODY_TIMEOUT_S:g} s") from None
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_body:
                    raise Refusal(413, f"the body is over {self.max_body} bytes")
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(chunks)
            else:
                raise h11.RemoteProtocolError("connection closed in the middle of a body")

    async def _respond(self, response: HttpResponse) -> bool:
        """Send one response (only its head to a HEAD); False when the connection must
        close afterwards."""
        try:
            headers = [(k, v) for k, v in response.headers]
            if response.stream is None:
                headers.append(("Content-Length", str(len(response.body))))
            reason = _REASONS.get(response.status, "")
            self._write(h11.Response(status_code=response.status, headers=headers, reason=reason))
            if self._head_request:
                pass  # h11 counts a HEAD response's body as 0 bytes: sending one is an error
            elif response.stream is None:
                self._write(h11.Data(data=response.body))
            else:
                async for chunk in response.stream:
                    if self._lost or self._eof.is_set():  # gone, its cancel lost on the way
                        return False
                    self._write(h11.Data(data=chunk))
                    await self._writable.wait()
            self._write(h11.EndOfMessage())
        finally:
            if response.cleanup is not None:
                response.cleanup()
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def _refusal(self, exc: Exception) -> HttpResponse:
        if isinstance(exc, Refusal):
            status, message, retry_after = exc.status, exc.message, exc.retry_after
        else:
            status = getattr(exc, "error_status_hint", 400)
            message, retry_after = str(exc) or "malformed HTTP request", None
        code = REFUSAL_CODES.get(status, "bad_request")
        return self.app.refuse(status, _cut(message), code, retry_after)

    async def _refuse(self, exc: Exception) -> None:
        """Answer a request the HTTP layer refuses, then close the connection."""
        if self._lost or self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        response = self._refusal(exc)
        response.headers.append(("Connection", "close"))
        with contextlib.suppress(h11.LocalProtocolError):
            await self._respond(response)
        await self._linger()

    async def _linger(self) -> None:
        """Read and drop what the client is still sending before closing: closing a
        socket with unread data resets it, and the client would never see our answer."""
        self._discarding = True
        self._inbox = bytearray()
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        if self.transport.can_write_eof():
            # A reset that came in since the answer was sent makes shutdown() fail.
            with contextlib.suppress(OSError):
                self.transport.write_eof()
        await wait_set(self._eof, LINGER_S)

    def _write(self, event: Any) -> None:
        data = self.h11.send(event)
        # is_closing: the socket failed and connection_lost is yet to come
        # (asyncio logs a warning for every write after that).
        if data and not self._lost and not self.transport.is_closing():
            self.transport.write(data)

    def _hand_over(self, request: HttpRequest) -> None:
        """A WebSocket upgrade after other requests on this connection: to websockets."""
        self._lost = True  # this object is done with the transport
        rest = self.h11.trailing_data[0] + bytes(self._inbox)
        if self._reading_paused:
            self.transport.resume_reading()
        self._upgrade(raw_head(request) + rest)

    def _close(self) -> None:
        self._on_close(self)
        if not self._lost:
            self._lost = True
            self.transport.close()


def _cut(text: str) -> str:
    """h11's messages quote the offending line (up to a whole head): cut it short."""
    return text if len(text) <= MAX_QUOTE_CHARS else text[: MAX_QUOTE_CHARS - 3] + "..."


def wants_websocket(method: str, upgrade: str, length: str | None, chunked: bool) -> bool:
    """A WebSocket opening handshake goes to websockets; anything else is plain HTTP.

    A handshake has no body: websockets drops one that has (no answer at all),
    so such a request stays with the HTTP side, which answers it."""
    has_body = chunked or (length is not None and length.strip() != "0")
    return method == "GET" and "websocket" in upgrade.lower() and not has_body


def _is_handshake(request: HttpRequest) -> bool:
    headers = request.headers
    upgrade = ", ".join(headers.get_all("Upgrade"))  # may be repeated
    length = ", ".join(headers.get_all("Content-Length")) or None
    return wants_websocket(request.method, upgrade, length, "Transfer-Encoding" in headers)


def raw_head(request: HttpRequest) -> bytes:
    """The request head again, for websockets to parse and answer itself."""
    lines = [f"{request.method} {request.target} HTTP/1.1"]
    lines += [f"{name}: {value}" for name, value in request.headers.raw_items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
