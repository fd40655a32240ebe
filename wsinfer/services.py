"""What the doors need of their frontend, as protocols: no door imports ``server.py``.

``Frontend`` (``wsinfer/server.py``) builds the HTTP door (``wsinfer/http/``)
and the plain routes (``wsinfer/plain_routes.py``) and hands itself to them.
Typed as ``Frontend``, each of them imported ``server.py`` back: one import
circle through seven modules, and a door that could reach anything the
frontend holds. Typed by these protocols instead, the doors depend on a list
of exactly what they use, and ``Frontend`` satisfies it (mypy checks that where
``Frontend`` passes itself). This module imports nothing from ``server.py``,
``wsinfer/http/`` or ``plain_routes.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from wsinfer.handlers import Services

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from websockets.http11 import Request, Response

    from wsinfer.access import Access
    from wsinfer.errors import WsinferError
    from wsinfer.messages import Limits
    from wsinfer.metrics import Metrics
    from wsinfer.sessions.store import SessionStore


class DoorConfig(Protocol):
    """The settings the HTTP door reads (``FrontendConfig`` has them all)."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_frame_bytes(self) -> int: ...

    @property
    def max_outgoing_bytes(self) -> int: ...

    @property
    def request_rate(self) -> float: ...

    @property
    def limits(self) -> Limits: ...


class PlainAnswers(Protocol):
    """The plain routes, as the HTTP door asks them (``PlainRoutes``)."""

    async def answer(self, request: Request) -> Response | None: ...


class FrontendServices(Services, Protocol):
    """What the HTTP door needs of its frontend: besides a request's ``Services``
    (store, admission, fan-in, metrics), its settings, the access checks, the
    plain routes, and the frontend's rate-limited logging of refusals and
    failures."""

    @property
    def config(self) -> DoorConfig: ...

    @property
    def access(self) -> Access: ...

    @property
    def routes(self) -> PlainAnswers: ...

    def refused(self, code: str, **fields: Any) -> None: ...

    def log_failure(self, exc: Exception, error: WsinferError, request: str) -> None: ...

    def log_limited(self, level: str, event: str, **fields: Any) -> None: ...


class HealthConfig(Protocol):
    """The setting ``/healthz`` reads: how fresh an engine's heartbeat must be."""

    @property
    def engine_heartbeat_s(self) -> float: ...


class RouteServices(Protocol):
    """What the plain routes (``/healthz``, ``/metrics``, the chat page) need of
    their frontend."""

    @property
    def config(self) -> HealthConfig: ...

    @property
    def access(self) -> Access: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def store(self) -> SessionStore: ...

    @property
    def redis(self) -> aioredis.Redis: ...

    @property
    def draining(self) -> bool: ...

    def refused(self, code: str, **fields: Any) -> None: ...

    def log_limited(self, level: str, event: str, **fields: Any) -> None: ...
