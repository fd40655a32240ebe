"""Prometheus metrics of one frontend process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.connections = Gauge("wsinfer_connections", "Open WebSocket connections", registry=r)
        self.active_sessions = Gauge(
            "wsinfer_active_sessions",
            "Sessions followed by a connection of this frontend",
            registry=r,
        )
        self.turns = Counter("wsinfer_turns_started", "Turns accepted", registry=r)
        self.deltas = Counter("wsinfer_deltas_sent", "Delta messages sent", registry=r)
        self.errors = Counter("wsinfer_errors", "Error messages sent", ["code"], registry=r)
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

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
