"""Every Redis client wsinfer builds, from one URL: standalone, Cluster or Sentinel;
their pools and timeouts; what counts as an outage; reconnect backoff.

URL forms (``rediss`` for TLS works wherever ``redis`` does):

- ``redis://[user:pass@]host:port/db``, ``unix:///path/redis.sock``: one server.
- ``redis+cluster://[user:pass@]host:port,host:port,...``: a Redis Cluster; the
  nodes listed are only where discovery starts.
- ``redis+sentinel://[user:pass@]host:port,host:port/SERVICE[/db]``: the primary
  that the Sentinels name for SERVICE, found again after a failover. A
  ``sentinel_password`` query parameter authenticates to the Sentinels.

The rest of wsinfer sees a ``redis.Redis`` (or its asyncio twin): a cluster
client has the same command methods, and everything that differs (pipelined
scripts, multi-stream reads) asks ``is_cluster`` and goes its own way.

redis-py's asyncio pool refuses a request once its (default 100) connections are
in use: under load that surfaced as ``internal`` errors. A frontend's requests
are short, so a bounded ``BlockingConnectionPool`` makes request 101 wait a
moment for a free connection instead of failing, and keeps the number of
sockets to Redis fixed however many clients arrive. Connect and read timeouts
are set so that a Redis that vanishes is noticed in seconds (and reported to
clients), not waited on forever.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster
import redis.asyncio.sentinel as asentinel
import redis.cluster
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ClusterError, MaxConnectionsError, TryAgainError
from redis.retry import Retry

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
# A primary failover takes the cluster's node timeout plus an election (a few
# seconds): commands retry with backoff for about that long before failing.
FAILOVER_RETRIES = 12
FAILOVER_BACKOFF_CAP_S = 1.0
FAILOVER_WINDOW_S = 15.0  # a script call is retried this long before its error stands
# While a slot migrates, a command on keys of which some have moved and some
# not gets TRYAGAIN; redis-py retries it for about 0.4 s, then raises
# ClusterError("TTL exhausted"), and the frontend would refuse the request
# (a resume, a stop). The asyncio cluster client retries such a command (never
# run by Redis) for this long, which covers moving one session's keys even one
# at a time on a loaded machine.
CLUSTER_PATIENCE_S = 5.0
# redis-py's asyncio cluster client opens a connection per concurrent command
# to a node, up to its max_connections (100 by default), then fails at once
# (MaxConnectionsError): 200 turns started together on one frontend all XADD
# to the {q} node. So more connections per node, and a command that still
# finds none free waits for one (within CLUSTER_PATIENCE_S).
CLUSTER_MAX_CONNECTIONS = 1000


@dataclass(frozen=True)
class RedisTarget:
    kind: str  # standalone | cluster | sentinel
    url: str
    nodes: list[tuple[str, int]] = field(default_factory=list)
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # username, password, ssl, db


def parse(url: str) -> RedisTarget:
    """What a ``--redis-url`` names; ValueError if it cannot be used."""
    parts = urlsplit(url)
    if parts.scheme not in CLUSTER_SCHEMES + SENTINEL_SCHEMES:
        return RedisTarget("standalone", url)
    netloc = parts.netloc.rpartition("@")[2]
    nodes = [_host_port(item) for item in netloc.split(",") if item]
    if not nodes:
        raise ValueError(f"{parts.scheme} URL names no host: {url}")
    options: dict[str, Any] = {"ssl": parts.scheme.startswith("rediss")}
    if parts.username:
        options["username"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    if parts.scheme in CLUSTER_SCHEMES:
        return RedisTarget("cluster", url, nodes, options=options)
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError(f"sentinel URL needs a service name: {url}")
    options["db"] = int(path[1]) if len(path) > 1 else 0
    if "sentinel_password" in query:
        options["sentinel_password"] = query["sentinel_password"]
    return RedisTarget("sentinel", url, nodes, service=path[0], options=options)


def _host_port(item: str) -> tuple[str, int]:
    host, _, port = item.rpartition(":")
    if not host:
        return item, 6379
    return host.strip("[]"), int(port)


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(cap=FAILOVER_BACKOFF_CAP_S), FAILOVER_RETRIES)


def _async_retry() -> AsyncRetry:
    return AsyncRetry(ExponentialWithJitterBackoff(cap=FAILOVER_BACKOFF_CAP_S), FAILOVER_RETRIES)


def _sync_topology_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for a Cluster or Sentinel ``url``."""
    target = parse(url)
    if target.kind == "cluster":
        nodes = [redis.cluster.ClusterNode(h, p) for h, p in target.nodes]
        client = redis.cluster.RedisCluster(
            startup_nodes=nodes, retry=_retry(), **_auth(target), **kwargs
        )
        return cast(redis.Redis, client)  # same command methods; see is_cluster
    sentinel = redis.sentinel.Sentinel(
        target.nodes, sentinel_kwargs=_sentinel_auth(target), **kwargs
    )
    return sentinel.master_for(target.service, retry=_retry(), **_auth(target, db=True))


def _async_topology_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for a Cluster or Sentinel ``url``."""
    target = parse(url)
    if target.kind == "cluster":
        nodes = [acluster.ClusterNode(h, p) for h, p in target.nodes]
        # redis-py's own retry policy: a custom one here made concurrent
        # commands on a fresh client share a connection and run twice.
        client = PatientCluster(
            startup_nodes=nodes, max_connections=CLUSTER_MAX_CONNECTIONS, **_auth(target), **kwargs
        )
        return cast(aioredis.Redis, client)
    sentinel = asentinel.Sentinel(target.nodes, sentinel_kwargs=_sentinel_auth(target), **kwargs)
    return sentinel.master_for(target.service, retry=_async_retry(), **_auth(target, db=True))


class PatientCluster(acluster.RedisCluster):
    """redis-py's asyncio cluster client, patient with a slot in migration and
    with a burst of commands."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + CLUSTER_PATIENCE_S
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            # The command did not run, so it is safe to repeat: TRYAGAIN,
            # CLUSTERDOWN, redis-py out of redirections or of connections.
            except (ClusterError, TryAgainError, MaxConnectionsError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)


async def ready(client: aioredis.Redis) -> None:
    """Learn a cluster's slot map before the first concurrent commands: redis-py
    8.1 can run a command twice when many race to initialise a fresh client."""
    if is_cluster(client):
        await cast(acluster.RedisCluster, client).initialize()


def async_node_client(cluster: aioredis.Redis, host: str, port: int) -> aioredis.Redis:
    """A plain client to one node of ``cluster`` (its pub/sub), same credentials."""
    kwargs = cast(acluster.RedisCluster, cluster).connection_kwargs
    wanted = ("username", "password", "ssl", "socket_connect_timeout", "credential_provider")
    return aioredis.Redis(host=host, port=port, **{k: v for k, v in kwargs.items() if k in wanted})


def _auth(target: RedisTarget, *, db: bool = False) -> dict[str, Any]:
    keys = ("username", "password", "ssl") + (("db",) if db else ())
    return {k: target.options[k] for k in keys if k in target.options and target.options[k]}


def _sentinel_auth(target: RedisTarget) -> dict[str, Any]:
    password = target.options.get("sentinel_password")
    return {"password": password} if password else {}


def is_cluster(client: Any) -> bool:
    return isinstance(client, redis.cluster.RedisCluster | acluster.RedisCluster)


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
    """An asyncio client for ``url`` (a frontend's); one server's on a bounded pool,
    which makes a request wait for a free connection rather than fail on count."""
    if parse(url).kind != "standalone":
        return _async_topology_client(
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


def sync_client(
    url: str,
    *,
    read_timeout_s: float = READ_TIMEOUT_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> redis.Redis:
    """A blocking client for ``url`` (an engine's: one thread, one connection at a time)."""
    timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": read_timeout_s}
    if parse(url).kind != "standalone":
        return _sync_topology_client(url, **timeouts)
    return redis.Redis.from_url(url, **timeouts)


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
