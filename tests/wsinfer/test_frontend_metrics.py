"""The frontend's /metrics: what operators asked for, consistent at every scrape,
with a real engine process (the module's), real Redis and real sockets."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.stack import Client, Stack, joined, start_frontend, until
from wsinfer.server import Frontend

KEY = "k1"


@pytest.fixture
async def frontend(engine_stack: Stack) -> AsyncIterator[Frontend]:
    settings = {"touch_interval_s": 0.2, "api_keys": frozenset({KEY})}
    frontend = await start_frontend(engine_stack.redis_url, **settings)
    yield frontend
    await frontend.stop()


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    def fetch() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            return str(resp.read().decode())

    text = await asyncio.to_thread(fetch)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def open_client(port: int) -> Client:
    return await Client.open(port, additional_headers={"Authorization": f"Bearer {KEY}"})


async def test_turns_resumes_and_refusals_are_counted(frontend: Frontend) -> None:
    port = frontend.port
    client = await open_client(port)
    await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 5})
    messages = await client.until("done")
    session = messages[0]
    await client.send(type="generate", bogus=1)
    assert (await client.recv())["code"] == "bad_request"
    await client.close()
    with pytest.raises(InvalidStatus):
        await connect(f"ws://127.0.0.1:{port}/v1/ws")  # no key: 401
    again = await open_client(port)
    await again.send(type="resume", session=session["session"], token=session["token"], after=2)
    replay = await again.until("done")
    assert joined(replay, after=2)[1] == 5
    await again.close()

    async def rtt_sampled() -> bool:  # by a touch tick's Redis ping
        return (await scrape(port)).get(("wsinfer_redis_rtt_seconds_count", ()), 0) >= 1

    await until(rtt_sampled, timeout_s=10, what="a Redis round trip sampled")
    metrics = await scrape(port)
    assert metrics[("wsinfer_turns_started_total", ())] == 1
    assert metrics[("wsinfer_resumes_total", ())] == 1
    assert metrics[("wsinfer_replayed_deltas_total", ())] == 3  # seq 3, 4, 5
    assert metrics[("wsinfer_refusals_total", (("code", "bad_request"),))] == 1
    assert metrics[("wsinfer_refusals_total", (("code", "unauthorized"),))] == 1
    assert metrics[("wsinfer_e2e_turn_latency_seconds_count", ())] == 1
    assert metrics[("wsinfer_time_to_first_delta_seconds_count", ())] == 1
    assert metrics[("wsinfer_redis_rtt_seconds_count", ())] >= 1
    assert metrics[("process_resident_memory_bytes", ())] > 0
    assert metrics[("process_open_fds", ())] > 0


async def test_connections_and_followed_sessions_agree_at_every_scrape(
    frontend: Frontend,
) -> None:
    port = frontend.port
    clients = [await open_client(port) for _ in range(3)]
    for client in clients[:2]:  # two follow a long turn, one is idle
        await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 4000})
        await client.recv()
    live = await scrape(port)
    assert live[("wsinfer_connections", ())] == 3
    assert live[("wsinfer_active_sessions", ())] == 2
    assert live[("wsinfer_send_queue_bytes", ())] >= 0
    assert ("wsinfer_send_queue_max_bytes", ()) in live
    for client in clients:
        await client.close()
    for _ in range(50):  # the server notices the closes
        after = await scrape(port)
        if after[("wsinfer_connections", ())] == 0:
            break
        await asyncio.sleep(0.1)
    assert after[("wsinfer_connections", ())] == 0
    assert after[("wsinfer_active_sessions", ())] == 0  # at once, not at the next tick


async def test_the_main_port_shows_the_engines_series_too(frontend: Frontend) -> None:
    # The engine's heartbeat publishes its exposition (its first one at once).
    async def engine_series() -> bool:
        samples = await scrape(frontend.port)
        return any(name.startswith("wsinfer_engine_") for name, _ in samples)

    await until(engine_series, timeout_s=15, what="the engine's series on /metrics")
    samples = await scrape(frontend.port)
    info = [labels for name, labels in samples if name == "wsinfer_engine_info"]
    assert len(info) == 1 and dict(info[0])["engine"]
    assert ("wsinfer_engine_requests_running", (("engine", dict(info[0])["engine"]),)) in samples
    assert any(name.startswith("wsinfer_") and "engine" not in name for name, _ in samples)


def test_engines_expositions_merge_into_one_family_per_name() -> None:
    from wsinfer.engine.metrics import EngineMetrics
    from wsinfer.metrics import with_engines

    engines = {}
    for engine_id in ("ea", "eb"):
        metrics = EngineMetrics(engine_id=engine_id)
        metrics.attach(None, "m", "cpu")
        engines[engine_id] = metrics.render()
    engines["broken"] = b"this is { not an exposition\n"
    own = b"# HELP wsinfer_x a frontend series\n# TYPE wsinfer_x gauge\nwsinfer_x 1.0\n"
    text = with_engines(own, engines).decode()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))  # one family per name
    assert "wsinfer_x" in names and not any(n.startswith(("process_", "python_")) for n in names)
    running = next(f for f in families if f.name == "wsinfer_engine_requests_running")
    assert sorted(s.labels["engine"] for s in running.samples) == ["ea", "eb"]
