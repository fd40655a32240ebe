"""Running wsinfer's Lua scripts (``sessions/scripts.py``): in pipelines, in bulk,
on one Redis or a Cluster.

A script call is an EVALSHA queued in a pipeline, never redis-py's ``Script``
object there (which costs a SCRIPT EXISTS round trip per pipeline); scripts are
loaded once per client, and again when Redis says it lacks them. Many calls at
once (a step's publishes, a frontend's touches) are one round trip on one Redis
and one pipeline per node on a Cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.cluster
from redis.exceptions import ClusterError, TryAgainError

from wsinfer.sessions.connect import FAILOVER_WINDOW_S, is_cluster

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


# The scripts this process has loaded on a client, kept on the client itself:
# loading before a script's first pipeline keeps the other commands of that
# pipeline from running twice. (Keyed by ``id(client)`` in a module set, a new
# client that reused a collected one's id was taken for loaded: its first
# pipeline failed NOSCRIPT and ran again, and its XADD wrote a second work item.)
_LOADED = "_wsinfer_loaded_scripts"


def _loaded(client: Any) -> set[str]:
    shas: set[str] | None = getattr(client, _LOADED, None)
    if shas is None:
        shas = set()
        setattr(client, _LOADED, shas)
    return shas


def _to_load(client: Any, scripts: list[Any]) -> list[Any]:
    return [s for s in scripts if s.sha not in _loaded(client)]


def load_scripts_once(client: redis.Redis, scripts: list[Any]) -> None:
    """Load the scripts this process has not loaded on ``client`` yet."""
    for script in _to_load(client, scripts):
        client.script_load(script.script)
        _loaded(client).add(script.sha)


def _lacks_script(results: list[Any]) -> bool:
    return any(isinstance(r, redis.exceptions.NoScriptError) for r in results)


async def run_pipeline(
    client: aioredis.Redis, build: Callable[[Any], None], scripts: list[Any]
) -> list[Any]:
    """Build and run a pipeline (errors as values); loads ``scripts`` if needed."""
    for attempt in range(2):
        for script in _to_load(client, scripts) if attempt == 0 else scripts:
            await client.script_load(script.script)
            _loaded(client).add(script.sha)
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
        for script in _to_load(client, scripts) if attempt == 0 else scripts:
            client.script_load(script.script)
            _loaded(client).add(script.sha)
        pipe = client.pipeline(transaction=False)
        build(pipe)
        results = list(pipe.execute(raise_on_error=False))
        if attempt or not _lacks_script(results):
            return results
    raise AssertionError("unreachable")


# --- scripts in bulk ---------------------------------------------------------
#
# A pipeline of script calls is one round trip on one server. A cluster client
# refuses pipelined EVALSHA, so there the calls are grouped by the node that
# owns each call's first key and sent as one pipeline per node; a call that
# meets a moved slot or a node that went away is retried alone through the
# cluster client, which follows redirections and refreshes its slot map.

ScriptCall = tuple[Any, Sequence[Any], Sequence[Any]]  # (registered script, keys, args)


def run_scripts(client: redis.Redis, calls: list[ScriptCall]) -> list[Any]:
    """Every call's reply, in order; a failed call's reply is its exception."""
    if not is_cluster(client):
        return run_pipeline_sync(client, _queue_all(calls), _distinct(calls))
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


def _queue_all(calls: list[ScriptCall]) -> Callable[[Any], None]:
    """A pipeline builder that queues every call, in order (one Redis)."""

    def build(pipe: Any) -> None:
        for script, keys, args in calls:
            queue_script(pipe, script, list(keys), list(args))

    return build


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
        return await run_pipeline(client, _queue_all(calls), _distinct(calls))
    replies: list[Any] = []
    for start in range(0, len(calls), 64):
        chunk = calls[start : start + 64]
        replies += await asyncio.gather(
            *(script(keys=keys, args=args) for script, keys, args in chunk),
            return_exceptions=True,
        )
    return replies
