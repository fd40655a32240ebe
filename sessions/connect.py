"""Every Redis client wsinfer builds, from one URL: standalone, Cluster or Sentinel.

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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
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


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for ``url`` (the engine's)."""
    target = parse(url)
    if target.kind == "standalone":
        return redis.Redis.from_url(url, **kwargs)
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


def async_client(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for ``url`` (the frontend's)."""
    target = parse(url)
    if target.kind == "standalone":
        return aioredis.from_url(url, **kwargs)
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


# --- scripts in bulk ---------------------------------------------------------
#
# A pipeline of script calls is one round trip on one server. A cluster client
# refuses pipelined EVALSHA, so there the calls are grouped by the node that
# owns each call's first key and sent as one pipeline per node; a call that
# meets a moved slot or a node that went away is retried alone through the
# cluster client, which follows redirections and refreshes its slot map.

ScriptCall = tuple[Any, Sequence[Any], Sequence[Any]]  # (registered script, keys, args)
# One server: load's run_pipeline (plain EVALSHA, scripts loaded once per client).


def run_scripts(client: redis.Redis, calls: list[ScriptCall]) -> list[Any]:
    """Every call's reply, in order; a failed call's reply is its exception."""
    if not is_cluster(client):
        from wsinfer.sessions.connection import queue_script, run_pipeline_sync

        def build(pipe: Any) -> None:
            for script, keys, args in calls:
                queue_script(pipe, script, list(keys), list(args))

        return run_pipeline_sync(client, build, _distinct(calls))
    cluster = cast(redis.cluster.RedisCluster, client)
    by_node: dict[str, list[int]] = {}
    nodes: dict[str, Any] = {}
    for index, (_, keys, _) in enumerate(calls):
        node = cluster.get_node_from_key(keys[0])
        nodes[node.name] = node
        by_node.setdefault(node.name, []).append(index)
    replies: list[Any] = [None] * len(calls)
    for name, indexes in by_node.items():
        _run_on_node(nodes[name].redis_connection, calls, indexes, replies)
    for index, reply in enumerate(replies):
        if isinstance(reply, redis.RedisError):
            replies[index] = _retry_alone(calls[index])
    return replies


def _distinct(calls: list[ScriptCall]) -> list[Any]:
    """The scripts ``calls`` use, each once (to load before the pipeline)."""
    return list({script.sha: script for script, _, _ in calls}.values())


def _retry_alone(call: ScriptCall) -> Any:
    """One call through the cluster client, again while a failover or a slot
    migration is under way.

    Safe to repeat: the session scripts recognise a call that already took
    effect (the publish's ``pub`` number), so a reply lost with its connection
    does not write twice.
    """
    script, keys, args = call
    deadline = time.monotonic() + FAILOVER_WINDOW_S
    while True:
        try:
            return script(keys=keys, args=args)
        # ClusterError: CLUSTERDOWN, or redis-py out of redirections while a
        # slot migrates; TryAgainError: the session's keys are half moved.
        except (redis.ConnectionError, redis.TimeoutError, ClusterError, TryAgainError) as exc:
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.25)
        except redis.RedisError as exc:
            return exc


def _run_on_node(
    node: redis.Redis, calls: list[ScriptCall], indexes: list[int], replies: list[Any]
) -> None:
    pipe = node.pipeline(transaction=False)
    for index in indexes:
        script, keys, args = calls[index]
        script(keys=keys, args=args, client=pipe)
    try:
        results = pipe.execute(raise_on_error=False)
    except redis.RedisError as exc:  # the node is gone: each call retries alone
        results = [exc] * len(indexes)
    for index, result in zip(indexes, results, strict=True):
        replies[index] = result


async def run_scripts_async(client: aioredis.Redis, calls: list[ScriptCall]) -> list[Any]:
    """``run_scripts`` for asyncio; on a cluster the calls go concurrently, 64 at a time."""
    if not is_cluster(client):
        from wsinfer.sessions.connection import queue_script, run_pipeline

        def build(pipe: Any) -> None:
            for script, keys, args in calls:
                queue_script(pipe, script, list(keys), list(args))

        return await run_pipeline(client, build, _distinct(calls))
    replies: list[Any] = []
    for start in range(0, len(calls), 64):
        chunk = calls[start : start + 64]
        replies += await asyncio.gather(
            *(script(keys=keys, args=args) for script, keys, args in chunk),
            return_exceptions=True,
        )
    return replies
