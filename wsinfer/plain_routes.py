"""The plain GET routes on the service's port: /healthz, /metrics, the chat page
and its static files.

Asked two ways, so that both answer alike: during a WebSocket handshake
(websockets' ``process_request``, where ``None`` lets the upgrade to /v1/ws
proceed) and by the HTTP door (``wsinfer/http/app.py``) for a request that is not
an upgrade. The API key, host and origin checks come first, as for every route.
"""

from __future__ import annotations

import mimetypes
from http import HTTPStatus
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import redis.asyncio as aioredis
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from wsinfer.access import Denied, is_public, request_path, shorten
from wsinfer.metrics import with_engines

if TYPE_CHECKING:
    from wsinfer.services import RouteServices

# Resolved through the package, so it works installed as well as editable.
BROWSER_DIR = Path(str(files("wsinfer.clients") / "browser"))


class PlainRoutes:
    def __init__(self, frontend: RouteServices) -> None:
        self.frontend = frontend

    async def answer(self, request: Request) -> Response | None:
        """The route's response; ``None`` for /v1/ws, authorized: a WebSocket to accept."""
        frontend = self.frontend
        try:
            path = request_path(request.path)
            frontend.access.check(request.headers, request.path, needs_key=not is_public(path))
        except Denied as exc:
            frontend.refused(exc.code, path=shorten(request.path))
            return text(HTTPStatus(exc.status), f"{exc.message}\n")
        if path == "/v1/ws":
            return None
        if path == "/healthz":
            return await self.healthz()
        if path == "/metrics":
            return response(HTTPStatus.OK, await self.metrics(), "text/plain; version=0.0.4")
        if path == "/":
            return static("index.html")
        if path.startswith("/static/"):
            return static(path.removeprefix("/static/"))
        return text(HTTPStatus.NOT_FOUND, "not found\n")

    async def metrics(self) -> bytes:
        """The frontend's series, then every live engine's (one scrape sees all)."""
        frontend = self.frontend
        own = frontend.metrics.render()
        try:
            engines = await frontend.store.engine_metrics(frontend.config.engine_heartbeat_s)
        except aioredis.RedisError as exc:  # the frontend's own still answer
            frontend.log_limited("warning", "metrics: redis unavailable", error=str(exc))
            return own
        return with_engines(own, engines)

    async def healthz(self) -> Response:
        frontend = self.frontend
        if frontend.draining:
            return text(HTTPStatus.SERVICE_UNAVAILABLE, "draining\n")
        try:
            await frontend.redis.ping()
            engines = await frontend.store.engines_alive(frontend.config.engine_heartbeat_s)
        except aioredis.RedisError as exc:
            # Unauthenticated: say what is wrong, not where Redis lives.
            frontend.log_limited("warning", "healthz: redis unavailable", error=str(exc))
            return text(HTTPStatus.SERVICE_UNAVAILABLE, "redis unavailable\n")
        if engines == 0:
            return text(HTTPStatus.SERVICE_UNAVAILABLE, "no engine is answering\n")
        return text(HTTPStatus.OK, f"ok: {engines} engine(s)\n")


def response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
        ]
    )
    return Response(status.value, status.phrase, headers, body)


def text(status: HTTPStatus, body: str) -> Response:
    return response(status, body.encode(), "text/plain; charset=utf-8")


def static(name: str) -> Response:
    path = (BROWSER_DIR / name).resolve()
    if BROWSER_DIR.resolve() not in path.parents or not path.is_file():
        return text(HTTPStatus.NOT_FOUND, "not found\n")
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    if path.suffix in (".js", ".mjs"):
        kind = "text/javascript"
    return response(HTTPStatus.OK, path.read_bytes(), f"{kind}; charset=utf-8")
