"""The frontend's start-up: check Redis, then listen, each failure one clear line.

The checks every process makes (Redis reachable, a port free) are
``wsinfer/preflight.py``'s, shared with the engine; this module is the
frontend's alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wsinfer.preflight import listen_error, require_redis_async

if TYPE_CHECKING:
    from websockets.asyncio.server import Server

    from wsinfer.server import Frontend


async def start_frontend(frontend: Frontend) -> Server:
    """Check Redis, then listen; either failing is a ``StartupError``."""
    config = frontend.config
    await require_redis_async(frontend.redis, config.redis_url)
    try:
        return await frontend.start()
    except OSError as exc:
        raise listen_error("WebSocket clients", config.host, config.port, exc) from None
