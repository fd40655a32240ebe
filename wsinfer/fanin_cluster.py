"""The fan-in on a Redis Cluster: one blocking read per node, not per session.

One XREAD cannot span hash slots, and every session has a slot of its own. So
each node that owns followed sessions gets one pub/sub connection, subscribed
(SSUBSCRIBE) to those sessions' wake channels, which the session scripts
publish on whenever a turn stream grows. A wake-up marks its session's
streams dirty; the reader then fetches only the dirty streams, as one
pipeline of non-blocking XREADs that the cluster client splits per node.

Wake-ups are hints, never the data: a stream is read from each subscriber's
position, so a lost or duplicated wake-up costs at most a delay. Every
``block_ms`` without wake-ups every stream is read anyway, which covers a
node's failover or a slot's migration (pub/sub messages are not replicated
and a migrated channel is unsubscribed), after which the slot map is fresh
and each channel is subscribed on its new owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, cast

import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster
import structlog

from wsinfer.clock import Clock
from wsinfer.fanin import Deliver, FanIn
from wsinfer.sessions import keys
from wsinfer.sessions.connect import async_node_client
from wsinfer.sessions.schema import as_str, entry_payload
from wsinfer.waiting import wait_set

log = structlog.get_logger("wsinfer.fanin")

LISTEN_POLL_S = 0.2  # how soon a listener notices a new subscription of its node


class _NodeListener:
    """One node's pub/sub connection: keeps its subscriptions to ``wanted``."""

    def __init__(self, fanin: ClusterFanIn, name: str, host: str, port: int) -> None:
        self.fanin = fanin
        self.name = name
        self.client = async_node_client(fanin.redis, host, port)
        self.wanted: set[str] = set()
        # Checked by the loops as well as cancelling the task: see close().
        self.closing = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self.closing:
            try:
                await self._listen()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the node failed over or went away
                log.warning("fan-in listener lost its node", node=self.name, error=str(exc))
                self.fanin.wake_all()
                await asyncio.sleep(0.5)

    async def _listen(self) -> None:
        pubsub = self.client.pubsub()
        subscribed: set[str] = set()
        try:
            while not self.closing:
                await self._sync(pubsub, subscribed)
                message = await pubsub.get_message(timeout=LISTEN_POLL_S)
                if message is not None:
                    self._on_message(message, subscribed)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _sync(self, pubsub: Any, subscribed: set[str]) -> None:
        added, dropped = self.wanted - subscribed, subscribed - self.wanted
        for channel in added:  # one per command: channels of different slots
            await pubsub.ssubscribe(channel)
        for channel in dropped:
            await pubsub.sunsubscribe(channel)
        subscribed |= added
        subscribed -= dropped
        for channel in added:  # what was written before the subscription took
            self.fanin.wake(keys.session_of(channel))

    def _on_message(self, message: dict[str, Any], subscribed: set[str]) -> None:
        kind, channel = as_str(message["type"]), as_str(message["channel"])
        if kind == "smessage":
            self.fanin.wake(keys.session_of(channel))
        elif kind == "sunsubscribe" and channel in self.wanted:
            # The slot moved away: the next full read refreshes the slot map.
            subscribed.discard(channel)
            self.fanin.wake_all()

    async def close(self) -> None:
        """Stop listening; returns within about ``LISTEN_POLL_S`` whatever the task was doing.

        Cancelling the task is not enough: redis-py sends each command under
        ``asyncio.wait_for`` (its default 5 s socket timeout), and Python 3.11's
        wait_for returns the send's result instead of raising a cancel that
        arrives just as the send completes. Such a listener read on for ever and
        this close waited for it for ever, so the fan-in stopped delivering to
        every session of its frontend. Hence ``closing``, which ends the loops at
        their next round, and a cancel repeated until the task has ended.
        """
        self.closing = True
        while not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=LISTEN_POLL_S)
        with contextlib.suppress(Exception):
            await self.client.aclose()


class ClusterFanIn(FanIn):
    def __init__(
        self,
        redis: aioredis.Redis,
        frontend_id: str,
        *,
        block_ms: int = 1000,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(redis, frontend_id, block_ms=block_ms, clock=clock)
        self.cluster = cast(acluster.RedisCluster, redis)
        self.listeners: dict[str, _NodeListener] = {}
        self._dirty: set[str] = set()  # sessions whose streams to read
        self._all = False
        self._event = asyncio.Event()

    def subscribe(self, stream: str, owner: Hashable, position: str, deliver: Deliver) -> None:
        self._dirty.add(keys.session_of(stream))
        super().subscribe(stream, owner, position, deliver)

    def let_go(self, owner: Hashable) -> None:
        stream = self.owners.get(owner)
        if stream is not None:
            self._dirty.add(keys.session_of(stream))
        super().let_go(owner)

    def _readers(self) -> list[Callable[[], Awaitable[None]]]:
        """Only reads of the dirty streams: a quiet stream costs nothing here anyway."""
        return [self._read_once]

    def _request_wake(self) -> None:
        """No wake-up stream on a cluster: the streams to read are marked dirty."""
        self._event.set()

    def wake(self, session: str) -> None:
        self._dirty.add(session)
        self._event.set()

    def wake_all(self) -> None:
        self._all = True
        self._event.set()

    async def _read_once(self) -> None:
        await self.cluster.initialize()  # a no-op unless first use or the slot map was reset
        await self._assign()
        idle = not self._dirty and not self._all
        if idle and not await wait_set(self._event, self.block_ms / 1000):
            self._all = True
        self._event.clear()
        dirty, everything = self._dirty, self._all
        self._dirty, self._all = set(), False
        wanted = [s for s in self.streams if everything or keys.session_of(s) in dirty]
        try:
            await self._read(wanted)
        except BaseException:
            self._all = True  # read them all once the cluster answers again
            raise

    async def _read(self, streams: list[str]) -> None:
        if not streams:
            return
        positions: dict[str, Any] = {s: self.streams[s].position() for s in streams}
        wanted = [s for s in streams if positions[s] is not None]  # None: all held
        if not wanted:
            return
        pipe = self.cluster.pipeline()
        for stream in wanted:
            pipe.xread({stream: positions[stream]})
        for stream, reply in zip(wanted, await pipe.execute(), strict=True):
            for _, entries in reply or []:
                if entries:
                    payloads = [(as_str(i), entry_payload(f)) for i, f in entries]
                    self._dispatch(stream, positions[stream], payloads)

    async def _assign(self) -> None:
        """Each followed session's wake channel, subscribed on the node owning its slot."""
        by_node: dict[str, set[str]] = {}
        where: dict[str, tuple[str, int]] = {}
        for stream in self.streams:
            channel = keys.session_wake(keys.session_of(stream))
            node = self.cluster.get_node_from_key(channel)
            if node is None:  # slot map being refreshed: the next round places it
                continue
            by_node.setdefault(node.name, set()).add(channel)
            where[node.name] = (str(node.host), int(node.port))
        for name in list(self.listeners):
            if name not in by_node:
                await self.listeners.pop(name).close()
        for name, channels in by_node.items():
            listener = self.listeners.get(name)
            if listener is not None and listener.task.done():
                await self._bury(listener)
                listener = None
            if listener is None:
                listener = self.listeners[name] = _NodeListener(self, name, *where[name])
            listener.wanted = channels

    async def _bury(self, listener: _NodeListener) -> None:
        """A listener ended without being closed: say so, and read everything now
        (its wake-ups were lost meanwhile); the caller starts a new one."""
        task = listener.task
        error = "cancelled" if task.cancelled() else repr(task.exception() or "returned")
        log.error("fan-in listener died; restarting it", node=listener.name, error=error)
        self.wake_all()
        await listener.close()

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            for listener in list(self.listeners.values()):
                await listener.close()
            self.listeners.clear()
