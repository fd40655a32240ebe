"""Checks any wsinfer process makes before it starts: one clear line and exit 1.

A busy port or an unreachable Redis is found before anything slow happens
(the engine checks before loading its model) and reported as a
``StartupError``, which ``cli.main`` logs as a single line. The frontend and
the engine both import this module; what only the frontend does at start-up
is ``wsinfer/startup.py``'s, so the engine never loads the frontend's code.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

from wsinfer.waiting import within

REDIS_CHECK_TIMEOUT_S = 5.0


class StartupError(Exception):
    """Something outside wsinfer keeps it from starting; the message says what."""


class MetricsServer(Protocol):
    def serve(self, port: int, host: str = ...) -> int: ...


def redact(url: str) -> str:
    """The URL without its password, fit for a log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=f"{user}{host}{port}"))


def _redis_error(url: str, exc: BaseException) -> StartupError:
    reason = str(exc) or type(exc).__name__
    return StartupError(f"cannot reach Redis at {redact(url)}: {reason}")


def require_redis(url: str) -> None:
    """Redis at ``url`` answers a PING."""
    from wsinfer.sessions.connect import sync_client  # any URL form: cluster, sentinel

    try:
        client = sync_client(url, connect_timeout_s=REDIS_CHECK_TIMEOUT_S)
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise _redis_error(url, exc) from None
    client.close()


async def require_redis_async(client: aioredis.Redis, url: str) -> None:
    try:
        await within(client.ping(), REDIS_CHECK_TIMEOUT_S)
    except (aioredis.RedisError, OSError, TimeoutError) as exc:
        raise _redis_error(url, exc) from None


def listen_error(what: str, host: str, port: int, exc: OSError) -> StartupError:
    reason = exc.strerror or str(exc)
    return StartupError(f"cannot listen on {host}:{port} for {what}: {reason}")


def serve_metrics(metrics: MetricsServer, host: str, port: int) -> int:
    """Serve a process's /metrics; the port it got."""
    try:
        return int(metrics.serve(port, host))
    except OSError as exc:
        raise listen_error("metrics", host, port, exc) from None
