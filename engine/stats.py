"""``CoreStats``: what every engine core counts, one typed object for its metrics.

A leaf (no torch): the metrics module reads it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CoreStats:
    """A core's gauges and counters, as its metrics read them at scrape time:
    the same fields for every core, zero where a core has no such part (the
    eager and the fake core have no paged pool, nor a prefix cache)."""

    kept_caches: int = 0  # KV caches kept for paused and finished turns
    kept_bytes: int = 0
    kept_budget_bytes: int = 0  # --kv-cache-mb
    pool_blocks: int = 0  # the paged KV pool, allocated once at start-up
    pool_free_blocks: int = 0
    pool_cached_blocks: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0  # prompt tokens that went through the model
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    gpu_idle_seconds: float = 0.0
    graph_capture_seconds: float = 0.0


def kept_caches(store: Any) -> dict[str, int]:
    """``CoreStats``' fields for a store of kept KV caches (an ``LRUBacked``)."""
    return {
        "kept_caches": len(store),
        "kept_bytes": store.used_bytes,
        "kept_budget_bytes": store.budget_bytes,
    }
