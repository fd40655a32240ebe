"""Declaring and running wsinfer's Lua scripts (``sessions/scripts.py``): in
pipelines, in bulk, on one Redis or a Cluster.

A script's call is declared once, as a ``Script``: its fields, in order, are
the script's KEYS and ARGV. The caller builds it by name (``keys()`` and
``args()`` lay it out), and the script's Lua opens with a header that binds
each field to a local of the same name (``header()``), so neither side
counts positions and the two cannot disagree on them.

A script call is an EVALSHA queued in a pipeline, never redis-py's ``Script``
object there (which costs a SCRIPT EXISTS round trip per pipeline); scripts are
loaded once per client, and again when Redis says it lacks them. Many calls at
once (a step's publishes, a frontend's touches) are one round trip on one Redis
and one pipeline per node on a Cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast, dataclass_transform

import msgpack
import redis
import redis.asyncio as aioredis
import redis.cluster
from redis.exceptions import ClusterError, TryAgainError

from wsinfer.sessions.connect import FAILOVER_WINDOW_S, is_cluster

# --- a script's call, declared ------------------------------------------------


class Slot(enum.Enum):
    """Where a field of a script's call goes."""

    KEY = "one KEYS entry"
    REST_KEYS = "every KEYS entry after the declared ones: a list in Lua"
    ARG = "one ARGV entry, as redis-py encodes it"
    PACKED = "one ARGV entry, msgpack-encoded; decoded in the header"
    COUNTED = "a count, then that many groups of ARGV: a list of tables in Lua"


_SLOT, _GROUP = "wsinfer_slot", "wsinfer_group"


def key() -> Any:
    return dataclasses.field(metadata={_SLOT: Slot.KEY})


def rest_keys() -> Any:
    return dataclasses.field(metadata={_SLOT: Slot.REST_KEYS})


def arg() -> Any:
    return dataclasses.field(metadata={_SLOT: Slot.ARG})


def packed() -> Any:
    return dataclasses.field(metadata={_SLOT: Slot.PACKED})


def counted(*names: str) -> Any:
    """Tuples of ``names`` in Python; tables with those fields in Lua."""
    return dataclasses.field(metadata={_SLOT: Slot.COUNTED, _GROUP: names})


# Lua's reserved words: a field so named would be a syntax error in the header.
_LUA_RESERVED = frozenset(
    {"and", "break", "do", "else", "elseif", "end", "false", "for", "function", "if", "in"}
    | {"local", "nil", "not", "or", "repeat", "return", "then", "true", "until", "while"}
)


@dataclass_transform(
    kw_only_default=True,
    frozen_default=True,
    field_specifiers=(key, rest_keys, arg, packed, counted),
)
class Script:
    """One script's call: subclasses are frozen keyword-only dataclasses whose
    fields, each declared with ``key()``, ``arg()``..., are its KEYS and ARGV
    in order. ``LUA`` is the script (set where it is written, ``scripts.py``)."""

    LUA: ClassVar[str]
    _layout: ClassVar[tuple[tuple[str, Slot, tuple[str, ...]], ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True, kw_only=True)(cls)
        cls._layout = tuple(
            (f.name, f.metadata[_SLOT], f.metadata.get(_GROUP, ()))
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        )
        cls.header()  # a bad layout fails at import

    @classmethod
    def header(cls) -> str:
        """The Lua that binds each field to a local of its name: the only
        place a script reads KEYS or ARGV."""
        lines: list[str] = []
        keys, args = 1, 1
        for name, slot, group in cls._layout:
            if name in _LUA_RESERVED or not name.isidentifier():
                raise TypeError(f"{cls.__name__}.{name} is no Lua name")
            if (slot in (Slot.KEY, Slot.REST_KEYS) and keys == 0) or args == 0:
                raise TypeError(f"{cls.__name__}.{name} follows a field that takes the rest")
            if slot is Slot.KEY:
                lines.append(f"local {name} = KEYS[{keys}]")
                keys += 1
            elif slot is Slot.REST_KEYS:
                lines.append(f"local {name} = {{}}")
                lines.append(f"for i = {keys}, #KEYS do {name}[#{name} + 1] = KEYS[i] end")
                keys = 0
            elif slot is Slot.ARG:
                lines.append(f"local {name} = ARGV[{args}]")
                args += 1
            elif slot is Slot.PACKED:
                lines.append(f"local {name} = cmsgpack.unpack(ARGV[{args}])")
                args += 1
            else:
                lines += _counted_header(name, group, args)
                args = 0
        return "\n".join(lines) + "\n"

    def keys(self) -> list[Any]:
        """The call's KEYS, in the declared order."""
        out: list[Any] = []
        for name, slot, _ in self._layout:
            if slot is Slot.KEY:
                out.append(getattr(self, name))
            elif slot is Slot.REST_KEYS:
                out += getattr(self, name)
        return out

    def args(self) -> list[Any]:
        """The call's ARGV, in the declared order."""
        out: list[Any] = []
        for name, slot, group in self._layout:
            value = getattr(self, name)
            if slot is Slot.ARG:
                out.append(value)
            elif slot is Slot.PACKED:
                out.append(msgpack.packb(value, use_bin_type=False))
            elif slot is Slot.COUNTED:
                out.append(len(value))
                for one in value:
                    if len(one) != len(group):
                        raise ValueError(f"{name} takes groups of {group}, not {one!r}")
                    out += one
        return out


def _counted_header(name: str, group: tuple[str, ...], at: int) -> list[str]:
    fields = ", ".join(
        f"{field} = ARGV[{at + 1 + j} + {len(group)} * i]" for j, field in enumerate(group)
    )
    return [
        f"local {name} = {{}}",
        f"for i = 0, tonumber(ARGV[{at}]) - 1 do {name}[i + 1] = {{{fields}}} end",
    ]


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


def bound(script: Any, call: Script) -> ScriptCall:
    """A registered script with its call's KEYS and ARGV, for ``run_scripts``."""
    return (script, call.keys(), call.args())


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
