"""How wsinfer processes connect to Redis: bounded pools and reconnect backoff.

redis-py's asyncio pool refuses a request once its (default 100) connections
are in use: under load that surfaced as ``internal`` errors. A frontend's
requests are short, so a bounded ``BlockingConnectionPool`` makes request 101
wait a moment for a free connection instead of failing, and keeps the number
of sockets to Redis fixed however many clients arrive.

Connect and read timeouts are set so that a Redis that vanishes is noticed in
seconds (and reported to clients), not waited on forever.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import ClusterError, TryAgainError

from wsinfer.sessions import connect

# Enough to keep Redis busy from one frontend; more only adds contention.
DEFAULT_POOL_SIZE = 32
# How long a request waits for a free pooled connection before failing.
POOL_WAIT_S = 20.0
CONNECT_TIMEOUT_S = 2.0
# Replies to our commands take milliseconds; a silent socket this long is dead.
READ_TIMEOUT_S = 15.0

# Errors that mean "Redis is not reachable right now" (as opposed to a bad
# command): the caller backs off and tries again, or reports unavailability.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ConnectionError,  # the builtin one (resets, refusals) when redis-py does not wrap it
)


def is_outage(exc: BaseException) -> bool:
    """True for a lost or refused connection; also the empty replica a
    restarted Redis without persistence is while it loads (BUSY/LOADING)."""
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    # A cluster failing over or moving a slot: CLUSTERDOWN, TRYAGAIN, or
    # redis-py giving up on its own redirections ("TTL exhausted").
    if isinstance(exc, ClusterError | TryAgainError):
        return True
    return isinstance(exc, redis.ResponseError) and str(exc).startswith(("LOADING", "BUSY"))


def async_client(
    url: str, *, pool_size: int = DEFAULT_POOL_SIZE, read_timeout_s: float | None = READ_TIMEOUT_S
) -> aioredis.Redis:
    """An asyncio client on a bounded pool: waits for a connection, never errors on count."""
    if connect.parse(url).kind != "standalone":  # Cluster or Sentinel: connect.py
        return connect.async_client(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=read_timeout_s
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=pool_size,
        timeout=POOL_WAIT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=read_timeout_s,
    )
    return aioredis.Redis(connection_pool=pool)


def sync_client(url: str, *, read_timeout_s: float = READ_TIMEOUT_S) -> redis.Redis:
    """The engine's client (one thread, one connection at a time)."""
    if connect.parse(url).kind != "standalone":
        return connect.sync_client(
            url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=read_timeout_s
        )
    return redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=read_timeout_s
    )


@dataclass
class Backoff:
    """Exponential backoff with jitter for reconnect loops; ``reset`` on success."""

    first_s: float = 0.1
    max_s: float = 2.0
    failures: int = 0
    down_since: float | None = field(default=None)

    def failed(self) -> float:
        """Record a failure; returns how long to wait before the next try."""
        if self.down_since is None:
            self.down_since = time.monotonic()
        self.failures += 1
        delay = min(self.max_s, self.first_s * 2 ** (self.failures - 1))
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> float | None:
        """Record a success; returns how long the outage lasted (None: there was none)."""
        lasted = None if self.down_since is None else time.monotonic() - self.down_since
        self.failures, self.down_since = 0, None
        return lasted

    @property
    def down(self) -> bool:
        return self.down_since is not None


# --- Lua scripts in pipelines ------------------------------------------------------
#
# redis-py sends SCRIPT EXISTS before every pipeline that holds a Script object:
# an extra round trip per generate, per touch and per engine step. These queue
# plain EVALSHAs instead and load the scripts only when Redis says it lacks
# them (first use, or a Redis that restarted without them). After a restart
# a pipeline may run twice: its other commands are idempotent or, for a
# turn's work item, a stray that the engine's claim refuses.


def queue_script(pipe: Any, script: Any, keys: list[Any], args: list[Any]) -> None:
    pipe.evalsha(script.sha, len(keys), *keys, *args)


# (client, script sha) pairs loaded by this process: loading before a script's
# first pipeline keeps the other commands of that pipeline from running twice.
_loaded: set[tuple[int, str]] = set()


def _to_load(client: Any, scripts: list[Any]) -> list[Any]:
    return [s for s in scripts if (id(client), s.sha) not in _loaded]


def load_scripts_once(client: redis.Redis, scripts: list[Any]) -> None:
    """Load the scripts this process has not loaded on ``client`` yet."""
    for script in _to_load(client, scripts):
        client.script_load(script.script)
        _loaded.add((id(client), script.sha))


def _lacks_script(results: list[Any]) -> bool:
    return any(isinstance(r, redis.exceptions.NoScriptError) for r in results)


async def run_pipeline(
    client: aioredis.Redis, build: Callable[[Any], None], scripts: list[Any]
) -> list[Any]:
    """Build and run a pipeline (errors as values); loads ``scripts`` if needed."""
    for attempt in range(2):
        for script in _to_load(client, scripts) if attempt == 0 else scripts:
            await client.script_load(script.script)
            _loaded.add((id(client), script.sha))
        pipe = client.pipeline(transaction=False)
        build(pipe)
        results = list(await pipe.execute(raise_on_error=False))
        if attempt or not _lacks_script(results):
            return results
    raise AssertionError("unreachable")


def run_pipeline_sync(
    client: redis.Redis, build: Callable[[Any], None], scripts: list[Any]
) -> list[Any]:
    """``run_pipeline`` for the engine's synchronous client."""
    for attempt in range(2):
        if attempt == 0:
            load_scripts_once(client, scripts)
        else:
            for script in scripts:
                client.script_load(script.script)
        pipe = client.pipeline(transaction=False)
        build(pipe)
        results = list(pipe.execute(raise_on_error=False))
        if attempt or not _lacks_script(results):
            return results
    raise AssertionError("unreachable")
