"""Prometheus metrics of one frontend process.

Gauges that describe the connections (open sessions, queued bytes) are read
from the live connections at scrape time, so they always agree with each
other. The standard ``process_*``/``python_*`` series are included. Names end
in ``_total``/``_seconds``/``_bytes`` as Prometheus asks; TTFT and end-to-end
latency mirror vLLM's ``time_to_first_token_seconds`` and
``e2e_request_latency_seconds`` as seen by the client.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import Metric

from wsinfer.contract import DeltaMessage, ServerMessage

# ``*_created`` samples double the exposition and no dashboard here reads them.
disable_created_metrics()

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TURN_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
_RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Metrics:
    def __init__(self, connections: Callable[[], Iterable[Any]] = tuple) -> None:
        """``connections``: the live ``server.Connection`` objects, read at scrape time."""
        self._connections = connections
        self.registry = r = CollectorRegistry()
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.connections = Gauge("wsinfer_connections", "Open WebSocket connections", registry=r)
        self._define_live(r)
        self._define_counters(r)
        self._define_latency(r)

    def _define_live(self, r: CollectorRegistry) -> None:
        self.active_sessions = Gauge(
            "wsinfer_active_sessions",
            "Sessions followed by a connection of this frontend",
            registry=r,
        )
        self.active_sessions.set_function(self._followed_sessions)
        Gauge(
            "wsinfer_send_queue_bytes",
            "Bytes queued for clients but not yet sent, all connections",
            registry=r,
        ).set_function(lambda: sum(self._queued()))
        Gauge(
            "wsinfer_send_queue_max_bytes",
            "The largest such backlog of one connection (a slow client)",
            registry=r,
        ).set_function(lambda: max(self._queued(), default=0))

    def _define_counters(self, r: CollectorRegistry) -> None:
        self.turns = Counter("wsinfer_turns_started", "Turns accepted", registry=r)
        self.deltas = Counter("wsinfer_deltas_sent", "Delta messages sent", registry=r)
        self.refusals = Counter(
            "wsinfer_refusals",
            "Requests refused, by protocol error code (error messages, 401 at the handshake)",
            ["code"],
            registry=r,
        )
        self.resumes = Counter("wsinfer_resumes", "resume requests served", registry=r)
        self.replayed = Counter(
            "wsinfer_replayed_deltas", "Delta events replayed to resuming clients", registry=r
        )
        self.resent = Counter(
            "wsinfer_resent_work_items",
            "Work items re-sent for followed turns left queued unclaimed (a lost item)",
            registry=r,
        )

    def _define_latency(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "wsinfer_time_to_first_delta_seconds",
            "From accepting a generate to sending its first delta",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "wsinfer_inter_token_latency_seconds",
            "Time between deltas of a turn, per token they carry",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.turn_seconds = Histogram(
            "wsinfer_e2e_turn_latency_seconds",
            "From accepting a generate to sending its done, on the connection that started it",
            buckets=_TURN_BUCKETS,
            registry=r,
        )
        self.redis_rtt = Histogram(
            "wsinfer_redis_rtt_seconds",
            "Round-trip time of a PING to Redis (sampled every few seconds)",
            buckets=_RTT_BUCKETS,
            registry=r,
        )

    # --- read at scrape time ------------------------------------------------------

    def _followed_sessions(self) -> int:
        return len({s for conn in self._connections() for s in conn.protocol.feeds})

    def _queued(self) -> list[int]:
        """Per connection: queued in the protocol, plus what the socket has not taken yet."""
        sizes = []
        for conn in self._connections():
            transport = getattr(conn.ws, "transport", None)
            size = transport.get_write_buffer_size() if transport is not None else 0
            size += getattr(conn.protocol, "outbox_bytes", 0)
            sizes.append(size)
        return sizes

    def clock(self) -> TurnClock:
        return TurnClock(self)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class TurnClock:
    """One connection's view of its turns: TTFT, per-token latency, turn time.

    Measured where the bytes leave (``sent`` is called for every message sent).
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        # (session, turn) -> (accepted at, last delta at, last seq, seen a delta)
        self._turns: dict[tuple[str, int], tuple[float, float, int, bool]] = {}

    def started(self, session: str, turn: int) -> None:
        now = time.monotonic()
        self._turns[(session, turn)] = (now, now, 0, False)

    def sent(self, message: ServerMessage) -> None:
        metrics = self.metrics
        if message["type"] == "delta":
            metrics.deltas.inc()
            self._delta(message)
        elif message["type"] == "error":
            metrics.refusals.labels(code=message["code"]).inc()
        elif message["type"] == "done":  # a long-lived connection must not keep every turn's clock
            clock = self._turns.pop((message["session"], message["turn"]), None)
            if clock is not None:
                metrics.turn_seconds.observe(time.monotonic() - clock[0])

    def _delta(self, message: DeltaMessage) -> None:
        key = (message["session"], message["turn"])
        clock = self._turns.get(key)
        if clock is None:
            return
        now = time.monotonic()
        accepted, last, seq, seen = clock
        if not seen:
            self.metrics.ttft.observe(now - accepted)
        elif message["seq"] > seq:
            self.metrics.inter_token.observe((now - last) / (message["seq"] - seq))
        self._turns[key] = (accepted, now, message["seq"], True)


# --- the engines' series on the frontend's /metrics -----------------------------------

ENGINE_PREFIX = "wsinfer_engine_"


def with_engines(own: bytes, engines: dict[str, bytes]) -> bytes:
    """The frontend's exposition and, after it, its engines' ``wsinfer_engine_*``
    families (as each engine's heartbeat last published them, ``WorkerStore.
    heartbeat``): one family per name across engines, each sample labelled with
    its ``engine``. The engines' process and Python series are left out (they
    would collide with the frontend's own). An exposition that does not parse is
    skipped, not the scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Metric] = {}
    for engine_id, text in sorted(engines.items()):
        try:
            families = list(text_string_to_metric_families(text.decode()))
        except (ValueError, UnicodeDecodeError):
            continue
        for family in families:
            if not family.name.startswith(ENGINE_PREFIX):
                continue
            into = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            for sample in family.samples:
                labels = {"engine": engine_id, **sample.labels}
                into.add_sample(sample.name, labels, sample.value, sample.timestamp)
    if not merged:
        return own
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return own + generate_latest(registry)


class _Families:
    """A collector of families already built (the engines', merged)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families
