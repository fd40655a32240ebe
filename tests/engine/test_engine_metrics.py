"""Engine metrics on the engine's own port, and its turn-end and takeover log lines,
with real engine processes (the fake core), a real frontend and real Redis."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.stack import Client, Logged, joined, start_frontend, wait_for_engine
from wsinfer.engine.metrics import EngineMetrics
from wsinfer.server import Frontend
from wsinfer.sessions import keys


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def start_engine(
    folder: Path, redis_url: str, name: str, rate: str, *extra: str
) -> tuple[Logged, str]:
    engine = Logged.spawn(
        folder, name, "engine", "--model", f"fake:{rate}", "--engine-id", name,
        "--redis-url", redis_url, "--log-format", "json", "--metrics-port", "0",
        "--lease-ms", "1500", *extra,
    )  # fmt: skip
    wait_for_engine(redis_url, name, engine.process)
    return engine, str(engine.wait_for("engine metrics")["url"])


@pytest.fixture
async def frontend(redis_url: str) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(redis_url)
    yield frontend
    await asyncio.wait_for(frontend.stop(), 30)  # a hang here is a bug, not a slow machine


async def test_a_turn_and_its_next_turn_show_up_in_the_engine_metrics(
    tmp_path: Path, redis_url: str, frontend: Frontend
) -> None:
    engine, url = start_engine(tmp_path, redis_url, "e1", "200")
    try:
        client = await Client.open(frontend.port)
        await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 7})
        first = await client.until("done")
        ids = {"session": first[0]["session"], "token": first[0]["token"]}
        await client.send(type="generate", prompt="more", params={"max_new_tokens": 3}, **ids)
        second = await client.until("done")
        await client.close()
        engine.wait_for("turn finished", turn=2)
        metrics = scrape(url)
    finally:
        assert engine.stop() == 0
    assert metrics[("wsinfer_engine_generation_tokens_total", ())] == 10
    assert (
        metrics[("wsinfer_engine_requests_finished_total", (("finished_reason", "length"),))] == 2
    )
    hit = (("kind", "next_turn"), ("result", "hit"))
    assert metrics[("wsinfer_engine_kv_cache_lookups_total", hit)] == 1
    assert second[-1]["usage"]["cached_tokens"] > 0
    prefilled = first[-1]["usage"]["prompt_tokens"] + second[-1]["usage"]["prompt_tokens"]
    cached = second[-1]["usage"]["cached_tokens"]
    assert metrics[("wsinfer_engine_prompt_tokens_total", ())] == prefilled - cached
    assert metrics[("wsinfer_engine_kv_retained_handles", ())] == 1
    assert metrics[("wsinfer_engine_kv_cache_used_bytes", ())] > 0
    assert metrics[("wsinfer_engine_kv_cache_budget_bytes", ())] == 2 << 30
    assert metrics[("wsinfer_engine_time_to_first_token_seconds_count", ())] == 2
    assert metrics[("wsinfer_engine_e2e_request_latency_seconds_count", ())] == 2
    assert metrics[("wsinfer_engine_batch_size_count", ())] >= 1
    assert metrics[("wsinfer_engine_step_duration_seconds_count", ())] >= 2
    assert metrics[("wsinfer_engine_takeovers_total", ())] == 0
    assert metrics[("wsinfer_engine_info", (("engine", "e1"), ("model", "fake:200")))] == 1
    assert metrics[("process_resident_memory_bytes", ())] > 0


async def test_running_waiting_and_paused_turns(
    tmp_path: Path, redis_url: str, frontend: Frontend
) -> None:
    engine, url = start_engine(tmp_path, redis_url, "e1", "20")
    try:
        client = await Client.open(frontend.port)
        await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 4000})
        session = await client.recv()
        await client.recv()  # a delta: it runs
        running = scrape(url)[("wsinfer_engine_requests_running", ())]
        await client.send(type="pause", session=session["session"], token=session["token"])
        await client.until("paused")
        await client.close()
        paused = engine.wait_for("turn paused")
        metrics = scrape(url)
    finally:
        engine.stop()
    assert running == 1 and metrics[("wsinfer_engine_requests_running", ())] == 0
    assert metrics[("wsinfer_engine_requests_paused_total", ())] == 1
    assert paused["tokens"] >= 1 and "finish_reason" not in paused


async def test_turns_queued_in_redis_show_as_the_backlog(
    tmp_path: Path, redis_url: str, frontend: Frontend
) -> None:
    """An engine takes only what its batch has room for; the rest waits in Redis,
    which its own waiting count cannot see."""
    engine, url = start_engine(tmp_path, redis_url, "e1", "20", "--max-batch-size", "1")
    try:
        client = await Client.open(frontend.port)
        for _ in range(3):
            await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 4000})
            assert (await client.recv())["type"] == "session"
        deadline = asyncio.get_running_loop().time() + 30  # the next heartbeat
        while (metrics := scrape(url))[("wsinfer_engine_queued_turns", ())] != 2:
            assert asyncio.get_running_loop().time() < deadline, metrics
            await asyncio.sleep(0.2)
        await client.close()
    finally:
        engine.stop()
    assert metrics[("wsinfer_engine_requests_running", ())] == 1
    assert metrics[("wsinfer_engine_requests_waiting", ())] == 0


async def test_a_takeover_is_logged_and_counted_once_and_only_then(
    tmp_path: Path, redis_url: str, frontend: Frontend, redis_client: redis.Redis
) -> None:
    engines = {name: start_engine(tmp_path, redis_url, name, "40") for name in ("ea", "eb")}
    try:
        client = await Client.open(frontend.port)
        await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 120})
        session = (await client.recv())["session"]
        head = [await client.recv() for _ in range(3)]
        owner = redis_client.hget(keys.meta(session), "engine")
        assert owner
        victim = owner.decode()
        survivor, survivor_url = engines["eb" if victim == "ea" else "ea"]
        engines[victim][0].process.kill()
        text, seq = joined(head + await client.until("done", timeout=60))
        await client.close()
        assert seq == 120
        started = survivor.wait_for("turn started", takeover=True)
        finished = survivor.wait_for("turn finished")
        metrics = scrape(survivor_url)
    finally:
        for engine, _ in engines.values():
            engine.stop()
    assert started["resumed_at"] >= 3 and finished["finish_reason"] == "length"
    assert metrics[("wsinfer_engine_takeovers_total", ())] == 1
    all_records = engines["ea"][0].records() + engines["eb"][0].records()
    assert sum(bool(r.get("takeover")) for r in all_records) == 1
    assert sum(r["event"] == "turn finished" for r in all_records) == 1


def test_gpu_memory_series_only_on_cuda() -> None:
    metrics = EngineMetrics(engine_id="x")
    metrics.attach(None, "m", "cpu")
    assert b"gpu_memory" not in metrics.render()
    assert b"wsinfer_engine_requests_running 0.0" in metrics.render()


def core_samples(core: Any) -> dict[str, float]:
    """Every sample an engine's metrics give for ``core``, by name."""
    metrics = EngineMetrics(engine_id="e")
    metrics.attach(core, "tiny", "cpu", 2)
    return {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def test_the_paged_pool_and_core_counters_are_exported(tiny: Any) -> None:
    from tests.engine.conftest import run_all
    from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest
    from wsinfer.sessions.schema import GenerationParams

    per_block = EngineCore(tiny, EngineConfig(max_batch_size=1)).pool.block_bytes
    core = EngineCore(tiny, EngineConfig(max_batch_size=2, kv_pool_bytes=9 * per_block))
    params = GenerationParams(max_new_tokens=60, temperature=0.0)
    for rid in ("a", "b"):  # two rows of ~70 tokens need 10 blocks: one is preempted
        core.add(EngineRequest(rid, [5] * 10, params, cache_key=rid))
    run_all(core)
    samples = core_samples(core)
    assert samples["wsinfer_engine_kv_pool_blocks"] == 9
    # Both kept caches hold the same prompt's blocks (shared by the prefix cache).
    held = len({b for e in core.store.lru.values() for b in e.blocks})
    assert held > 0 and samples["wsinfer_engine_kv_pool_free_blocks"] == 9 - 1 - held
    assert samples["wsinfer_engine_kv_cache_usage_perc"] == pytest.approx((1 + held) / 9)
    assert samples["wsinfer_engine_preemptions_total"] >= 1
    assert samples["wsinfer_engine_gpu_idle_seconds_total"] == 0  # CPU: nothing to wait for


def test_prefix_cache_counters_are_exported(tiny: Any) -> None:
    from tests.engine.conftest import run_all
    from wsinfer.engine.core import EngineCore, EngineRequest
    from wsinfer.sessions.schema import GenerationParams

    core = EngineCore(tiny)
    params = GenerationParams(max_new_tokens=4, temperature=0.0)
    shared = list(range(3, 43))  # 40 tokens: two whole blocks of 16
    for rid, tail in (("a", [50]), ("b", [60, 61])):
        core.add(EngineRequest(rid, shared + tail, params))
        run_all(core)
    samples = core_samples(core)
    assert samples["wsinfer_engine_prefix_cache_queries_total"] == 41 + 42
    assert samples["wsinfer_engine_prefix_cache_hits_total"] == 32
    assert samples["wsinfer_engine_prefill_tokens_total"] == 41 + 42 - 32
    # a computed tokens 0-43 (2 whole blocks); b shared them, then computed 32-44.
    assert samples["wsinfer_engine_kv_pool_cached_blocks"] == 2


def test_every_core_gives_the_same_stats_object() -> None:
    # The fake core (no pool): its kept caches are exported, its pool reads zero.
    from tests.engine.conftest import run_all
    from wsinfer.engine.core import EngineRequest
    from wsinfer.engine.fake import FAKE_KV_BYTES_PER_TOKEN, FakeCore
    from wsinfer.engine.fake_spec import FakeSpec
    from wsinfer.engine.stats import CoreStats
    from wsinfer.sessions.schema import GenerationParams

    core = FakeCore(FakeSpec(float("inf")), kv_cache_bytes=1 << 20)
    core.add(EngineRequest("s:1", [1, 2, 3], GenerationParams(max_new_tokens=4), cache_key="s"))
    run_all(core)  # type: ignore[arg-type]
    stats = core.stats()
    assert stats == CoreStats(
        kept_caches=1, kept_bytes=7 * FAKE_KV_BYTES_PER_TOKEN, kept_budget_bytes=1 << 20
    )
    samples = core_samples(core)
    assert samples["wsinfer_engine_kv_retained_handles"] == 1
    assert samples["wsinfer_engine_kv_cache_used_bytes"] == 7 * FAKE_KV_BYTES_PER_TOKEN
    assert samples["wsinfer_engine_kv_pool_blocks"] == 0
    assert samples["wsinfer_engine_kv_cache_usage_perc"] == 0
