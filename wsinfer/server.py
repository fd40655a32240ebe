"""The frontend: a thin websockets adapter around ``ConnectionProtocol``.

It only moves frames, runs each request against Redis through ``Frontend``'s
handlers, and feeds turn events from the shared ``FanIn`` into each
connection's protocol object. The plain routes (/healthz, /metrics, the chat
page: ``wsinfer/plain_routes.py``) answer on the same port during the handshake.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import structlog
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from wsinfer.access import Access, Denied, request_path
from wsinfer.contract import CloseCode, ErrorCode
from wsinfer.errors import ClientError, StoreUnavailable, WsinferError
from wsinfer.fanin import FanIn
from wsinfer.fanin_cluster import ClusterFanIn
from wsinfer.handlers import Handlers, Peer, to_protocol_error
from wsinfer.http.app import HttpApp
from wsinfer.http.door import front_door
from wsinfer.http.responses_ws import PATH as RESPONSES_PATH
from wsinfer.http.responses_ws import ResponsesSocket, handshake, handshake_refusal
from wsinfer.limits import CapacityGate, LogThrottle, TokenBucket
from wsinfer.messages import SUBPROTOCOLS, Limits, codec_for
from wsinfer.metrics import Metrics
from wsinfer.plain_routes import PlainRoutes
from wsinfer.protocol import ConnectionProtocol
from wsinfer.sendpath import DeflateLargeFactory, Sender
from wsinfer.sessions.connect import DEFAULT_POOL_SIZE, async_client, is_cluster, ready
from wsinfer.sessions.schema import DEFAULT_SESSION_TTL_S, ENGINE_FRESH_S
from wsinfer.sessions.store import SessionStore

if TYPE_CHECKING:
    from wsinfer.grpc_door import GrpcDoor

log = structlog.get_logger("wsinfer.frontend")


@dataclass
class FrontendConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    api_keys: frozenset[str] = frozenset()
    session_ttl_s: int = DEFAULT_SESSION_TTL_S
    max_queued_turns: int = 256  # beyond this, generate gets `overloaded`
    max_frame_bytes: int = 1 << 20
    touch_interval_s: float = 5.0
    # A followed turn queued this long unclaimed gets its work item again (its
    # starter may have died before writing it; a duplicate is refused by the claim).
    resend_queued_after_s: float = 30.0
    model_name: str = "wsinfer"  # the model id of the OpenAI-compatible routes
    engine_heartbeat_s: float = ENGINE_FRESH_S  # an engine silent longer is not counted
    redis_pool_size: int = DEFAULT_POOL_SIZE  # requests beyond it wait for a connection
    # Per connection: output waiting for a slow reader before its sources pause,
    # and requests per second (bursts of twice that) before `overloaded`.
    max_outgoing_bytes: int = 1 << 20
    request_rate: float = 50.0
    # Web origins allowed besides the page's own and localhost ("*": any).
    allowed_origins: frozenset[str] = frozenset()
    # Host names this server answers to besides its bind address, IP literals and
    # localhost ("*": any); checked only without API keys (DNS rebinding).
    allowed_hosts: frozenset[str] = frozenset()
    limits: Limits = field(default_factory=Limits)
    grpc_port: int | None = None  # the v2 gRPC service (wsinfer/grpc_door.py); None: off


class Frontend:
    """One frontend process: the websockets server plus shared Redis plumbing.

    The doors it builds (``HttpApp``, ``PlainRoutes``) take it as
    ``wsinfer/services.py``'s protocols, which list what they use of it, so
    that they never import this module."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.id = f"frontend-{uuid.uuid4().hex[:8]}"
        self.redis = async_client(config.redis_url, pool_size=config.redis_pool_size)
        # The fan-in blocks in XREAD: it gets connections of its own.
        self.fanin_redis = async_client(config.redis_url, pool_size=4, read_timeout_s=None)
        self.store = SessionStore(self.redis, ttl_s=config.session_ttl_s)
        self.capacity = CapacityGate(
            lambda: self.store.capacity(config.engine_heartbeat_s), config.max_queued_turns
        )
        self.fanin = _fanin_for(self.fanin_redis, self.id)
        self.metrics = Metrics(lambda: self.connections)
        self.connections: set[Connection] = set()
        self.log_throttle = LogThrottle()
        self.access = Access(
            config.api_keys, config.allowed_origins, config.allowed_hosts, config.host
        )
        self.routes = PlainRoutes(self)  # /healthz, /metrics, the chat page
        self.http = HttpApp(self)  # plain HTTP on the same port (wsinfer/http/)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.server: Server | None = None
        self.grpc: GrpcDoor | None = None  # when grpc_port is set
        self.draining = False

    async def start(self) -> Server:
        await ready(self.redis)
        await ready(self.fanin_redis)
        self._tasks = [asyncio.create_task(self.fanin.run()), asyncio.create_task(self._touch())]
        self.server = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            subprotocols=list(SUBPROTOCOLS),  # type: ignore[arg-type]
            select_subprotocol=_select_subprotocol,
            process_request=self._answer_handshake,
            create_connection=front_door(self.http),
            max_size=self.config.max_frame_bytes,
            extensions=[DeflateLargeFactory()],
            ping_interval=20,
            ping_timeout=20,
        )
        log.info("frontend listening", frontend=self.id, host=self.config.host, port=self.port)
        if self.config.grpc_port is not None:
            from wsinfer.grpc_door import serve_grpc  # grpcio: an extra, imported when asked

            self.grpc = await serve_grpc(self, self.http, self.config.host, self.config.grpc_port)
        return self.server

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def drain(self) -> None:
        """A rolling restart: stop accepting, then close every WebSocket with
        1012 (service restart) so that clients reconnect, through the load
        balancer, to another frontend and resume. Nothing is lost: a turn's
        state is in Redis and the engines keep generating meanwhile."""
        self.draining = True
        if self.server is not None:
            log.info("draining", frontend=self.id, connections=len(self.connections))
            self.server.close(code=CloseCode.SERVICE_RESTART, reason="service restart")
            await self.server.wait_closed()

    async def stop(self) -> None:
        self._closing = True  # a cancel that redis-py swallows must not keep _touch looping
        if self.grpc is not None:
            await self.grpc.stop()
        if self.server is not None:
            self.server.close()
            self.http.close()
            await self.server.wait_closed()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.fanin.close()
        await self.redis.aclose()
        await self.fanin_redis.aclose()

    def log_limited(self, level: str, event: str, **fields: Any) -> None:
        """Log unless this event (and code) was logged too often lately."""
        allowed, suppressed = self.log_throttle.allow(f"{event}:{fields.get('code', '')}")
        if allowed:
            extra = {"suppressed": suppressed} if suppressed else {}
            getattr(log, level)(event, frontend=self.id, **fields, **extra)

    async def _touch(self) -> None:
        """Keep followed sessions marked as watched (idle pause) and alive (TTL)."""
        while not self._closing:
            await asyncio.sleep(self.config.touch_interval_s)
            followed: dict[str, int] = {}
            peers: list[Peer] = [*self.connections, *self.http.peers]
            for conn in peers:
                followed.update({s: f.turn for s, f in conn.protocol.feeds.items()})
            await self._ping_redis()
            if not followed:
                continue
            try:
                touched = await self.store.touch(followed, self.config.resend_queued_after_s)
            except aioredis.RedisError as exc:
                self.log_limited("warning", "redis unavailable: cannot touch", error=str(exc))
                continue
            for session, turn in touched.resent:
                self.metrics.resent.inc()
                log.warning("re-sent a queued turn's work item", session=session, turn=turn)
            for session in touched.gone:
                self._session_lost(session)

    async def _ping_redis(self) -> None:
        """Sample the Redis round-trip time (a metric; failures show up elsewhere)."""
        started = time.perf_counter()
        try:
            await self.redis.ping()
        except aioredis.RedisError:
            return
        self.metrics.redis_rtt.observe(time.perf_counter() - started)

    def _session_lost(self, session: str) -> None:
        peers: list[Peer] = [*self.connections, *self.http.peers]
        for conn in peers:
            if session in conn.protocol.feeds:
                self.fanin.unsubscribe((conn.id, session))
                conn.protocol.lost(session, "the session no longer exists (closed or expired)")
                conn.flush()

    # --- HTTP on the same port -------------------------------------------------

    def refused(self, code: str, **fields: Any) -> None:
        """A request refused before it ran (key, host, origin, malformed): one INFO line."""
        if code == "invalid_api_key":
            self.metrics.refusals.labels(code=ErrorCode.UNAUTHORIZED.value).inc()
        self.log_limited("info", "request refused", code=code, **fields)

    def log_failure(self, exc: Exception, error: WsinferError, request: str) -> None:
        """Client mistakes are one INFO line; outages one WARNING; only our own
        bugs get a traceback. Repeats of each are rate-limited."""
        if isinstance(error, ClientError):
            self.log_limited("info", "request refused", code=error.code.value, request=request)
        elif isinstance(error, StoreUnavailable):
            self.log_limited("warning", "redis unavailable", error=str(exc))
        elif isinstance(exc, WsinferError):
            self.log_limited("warning", "request failed", code=error.code.value)
        else:
            self.log_limited("exception", "request failed", request=request)

    # --- WebSocket ---------------------------------------------------------------

    async def _answer_handshake(self, _conn: ServerConnection, request: Request) -> Any:
        """Which door a handshake opens: the Responses API's WebSocket mode on
        /v1/responses; /v1/ws, or a plain route, otherwise."""
        try:
            path = request_path(request.path)
        except Denied as exc:
            return handshake_refusal(exc)
        if path == RESPONSES_PATH:
            return handshake(self.http, request)
        return await self.routes.answer(request)

    async def _handle(self, ws: ServerConnection) -> None:
        if ws.request is not None and request_path(ws.request.path) == RESPONSES_PATH:
            self.metrics.connections.inc()
            try:
                await ResponsesSocket(self.http, ws).run()
            finally:
                self.metrics.connections.dec()
            return
        conn = Connection(self, ws)
        self.connections.add(conn)
        self.metrics.connections.inc()
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.metrics.connections.dec()
            self.fanin.unsubscribe_all(lambda owner: owner[0] == conn.id)  # type: ignore[index]


class Connection:
    """One client connection: reader loop, writer task, fan-in subscriptions."""

    def __init__(self, frontend: Frontend, ws: ServerConnection) -> None:
        self.frontend = frontend
        self.ws = ws
        self.id = uuid.uuid4().hex[:12]
        self.protocol = ConnectionProtocol(codec_for(ws.subprotocol), frontend.config.limits)
        self.log = log.bind(conn=self.id)
        self.handlers = Handlers(self)
        self.clock = frontend.metrics.clock()
        self.sender = Sender(ws, self.protocol, self.clock.sent, self._check_pressure)
        config = frontend.config
        self.bucket = TokenBucket(config.request_rate, max(1.0, 2 * config.request_rate))
        self.congested = False  # the client is not reading: sources are paused
        self._drained = asyncio.Event()
        self._drained.set()

    async def run(self) -> None:
        writer = asyncio.create_task(self.sender.run())
        try:
            async for frame in self.ws:
                await self._on_frame(frame)
                # A client that sends but does not read is not read from either.
                await self._drained.wait()
        except ConnectionClosed:
            pass
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    async def _on_frame(self, frame: str | bytes) -> None:
        message = self.protocol.receive(frame)
        wait = self.bucket.take() if message is not None else 0.0
        if message is not None and wait > 0:
            self.protocol.too_fast(message, wait)
        elif message is not None:
            try:
                await self.handlers.handle(message)
            except Exception as exc:  # every failure becomes an error message
                error = to_protocol_error(exc)
                cause = error.__cause__ if isinstance(error.__cause__, Exception) else exc
                self.frontend.log_failure(cause, error, type(message).__name__)
                session = getattr(message, "session", None)
                self.protocol.fail(error, msg_id=message.id, session=session)
        self.flush()

    def flush(self) -> None:
        self.sender.schedule()
        self._check_pressure()

    def _check_pressure(self) -> None:
        """Pause this connection's sources (its requests, its turns' streams) while
        more than ``max_outgoing_bytes`` wait for the client; resume at half."""
        pending = self.protocol.outbox_bytes + self.sender.buffered
        limit = self.frontend.config.max_outgoing_bytes
        fanin = self.frontend.fanin
        if not self.congested and pending > limit:
            self.congested = True
            self._drained.clear()
            for session in self.protocol.feeds:
                fanin.hold((self.id, session))
        elif self.congested and pending <= limit // 2:
            self.congested = False
            self._drained.set()
            for session in self.protocol.feeds:
                fanin.let_go((self.id, session))

    def started_turn(self, session: str, turn: int) -> None:
        self.clock.started(session, turn)

    def on_events(self, session: str, turn: int) -> Any:
        def deliver(events: list[Any]) -> None:
            self.protocol.deliver(session, turn, events)
            self.flush()

        return deliver


def _fanin_for(redis: aioredis.Redis, frontend_id: str) -> FanIn:
    """The fan-in for this Redis: one XREAD, or one reader per node on a cluster.

    Chosen here, by the fan-in's user, so that the base class never imports
    its subclass."""
    if is_cluster(redis):
        return ClusterFanIn(redis, frontend_id)
    return FanIn(redis, frontend_id)


def _select_subprotocol(conn: ServerConnection, offered: Any) -> Any:
    """The first offered subprotocol we know; none offered means JSON."""
    for name in offered:
        if name in SUBPROTOCOLS:
            return name
    return None
