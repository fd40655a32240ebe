"""The service over real sockets: real Redis, a real engine process (tiny model),
real WebSocket connections. Resume, failover of the frontend, stop, pause,
multi-turn and every error code."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import pytest
import redis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from tests.stack import Client, Stack, joined, start_frontend
from wsinfer.server import Frontend
from wsinfer.sessions import keys

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
GREEDY = {"temperature": 0, "max_new_tokens": 120}


@pytest.fixture
def stack(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[Stack]:
    """The module's engine; a test marked idle_pause gets an engine of its own with
    that idle limit, on a Redis of its own. The frontend fixture touches watched
    sessions every 0.3 s, so attached turns never hit the limit."""
    marker = request.node.get_closest_marker("idle_pause")
    if marker is None:
        yield request.getfixturevalue("engine_stack")
        return
    stack = Stack(request.getfixturevalue("redis_url"), tiny_model)
    try:
        stack.start_engine("engine-1", "--idle-pause", str(marker.args[0]))
        yield stack
    finally:
        stack.stop()


@pytest.fixture
async def frontend(stack: Stack) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(stack.redis_url)
    yield frontend
    await frontend.stop()


async def run_turn(
    port: int, messages: list[dict[str, str]] = PROMPT, params: dict[str, Any] = GREEDY
) -> tuple[str, dict[str, Any]]:
    client = await Client.open(port)
    await client.send(type="generate", id=1, messages=messages, params=params)
    out = await client.until("done")
    await client.close()
    assert out[0]["type"] == "session" and out[0]["id"] == 1
    return joined(out)[0], out[-1]


async def test_generate_streams_deltas_then_done(frontend: Frontend) -> None:
    text, done = await run_turn(frontend.port)
    assert text and done["finish_reason"] in ("stop", "length")
    assert done["usage"]["completion_tokens"] == done["seq"] > 0
    assert done["usage"]["prompt_tokens"] > 10


async def test_msgpack_subprotocol(frontend: Frontend) -> None:
    reference, _ = await run_turn(frontend.port)
    url = f"ws://127.0.0.1:{frontend.port}/v1/ws"
    async with connect(url, subprotocols=["wsinfer.v1.msgpack"]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == "wsinfer.v1.msgpack"
        await ws.send(msgpack.packb({"type": "generate", "messages": PROMPT, "params": GREEDY}))
        text = ""
        while True:
            message = msgpack.unpackb(await ws.recv())
            text += message.get("text", "")
            if message["type"] == "done":
                break
    assert text == reference


async def test_no_subprotocol_gets_json(frontend: Frontend) -> None:
    async with connect(f"ws://127.0.0.1:{frontend.port}/v1/ws") as ws:
        assert ws.subprotocol is None
        await ws.send("{oops")
        assert json.loads(await ws.recv())["code"] == "bad_request"


async def test_resume_after_cuts_at_random_points_loses_and_repeats_nothing(
    frontend: Frontend,
) -> None:
    reference, done = await run_turn(frontend.port)
    rng = random.Random(1234)
    for _ in range(3):
        client = await Client.open(frontend.port)
        await client.send(type="generate", messages=PROMPT, params=GREEDY)
        session = await client.recv()
        text, seq = "", 0
        cuts = sorted(rng.sample(range(1, done["seq"]), 4))
        while True:
            message = await client.recv()
            if message["type"] == "delta":
                assert message["seq"] > seq
                text, seq = text + message["text"], message["seq"]
                if cuts and seq >= cuts[0]:
                    cuts.pop(0)
                    client.ws.transport.abort()  # the network drops; no close frame
                    client = await Client.open(frontend.port)
                    await client.send(
                        type="resume", session=session["session"], token=session["token"], after=seq
                    )
            elif message["type"] == "done":
                break
        await client.close()
        assert text == reference


async def test_a_frontend_killed_mid_turn_loses_nothing(stack: Stack, frontend: Frontend) -> None:
    reference, _ = await run_turn(frontend.port)
    first, port = stack.start_frontend()
    client = await Client.open(port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = await client.recv()
    head, seq = joined([await client.recv()])
    first.kill()  # SIGKILL: no goodbye
    second, port2 = stack.start_frontend()
    resumed = await Client.open(port2)
    await resumed.send(type="resume", session=session["session"], token=session["token"], after=seq)
    tail, _ = joined(await resumed.until("done"), after=seq)
    assert head + tail == reference
    await resumed.close()


async def test_stop_ends_the_turn_cancelled(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params={"max_new_tokens": 4000})
    session = await client.recv()
    await client.recv()  # first delta
    await client.send(type="stop", session=session["session"], token=session["token"])
    done = (await client.until("done"))[-1]
    assert done["finish_reason"] == "cancelled" and done["seq"] < 4000
    # The session takes a new turn afterwards.
    await client.send(
        type="generate",
        session=session["session"],
        token=session["token"],
        messages=PROMPT,
        params={"max_new_tokens": 3},
    )
    assert (await client.recv())["turn"] == 2
    await client.close()


async def test_pause_then_resume_continues_the_same_text(frontend: Frontend) -> None:
    reference, _ = await run_turn(frontend.port)
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = await client.recv()
    first = await client.recv()  # running on the engine now
    await client.send(type="pause", session=session["session"], token=session["token"])
    before = [first, *await client.until("paused")]
    text, seq = joined(before)
    assert before[-1]["seq"] >= seq
    with pytest.raises(TimeoutError):  # halted: nothing more arrives
        await client.recv(timeout=0.5)
    await client.send(type="pause", id="again", session=session["session"], token=session["token"])
    assert (await client.recv())["type"] == "paused"  # idempotent
    await client.send(type="resume", session=session["session"], token=session["token"], after=seq)
    tail = await client.until("done")
    rest, _ = joined(tail, after=seq)
    assert text + rest == reference
    assert tail[-1]["usage"]["cached_tokens"] > 0  # resumed from the kept KV cache
    await client.close()


async def test_a_resumed_turn_whose_work_item_was_lost_still_runs_to_its_end(
    stack: Stack,
) -> None:
    """A resume queues the turn, then writes its work item in a second call: a
    frontend that died between the two left a turn no engine would run. A frontend
    following it sends the item again once it has waited; the client gets the rest,
    nothing lost, nothing repeated."""
    frontend = await start_frontend(stack.redis_url, resend_queued_after_s=0.5)
    try:
        reference, _ = await run_turn(frontend.port)
        lost: list[tuple[str, int]] = []
        enqueue = frontend.store.enqueue

        async def lose_the_first(session: str, turn: int) -> None:
            if not lost:
                lost.append((session, turn))  # the script ran; the XADD never does
                return
            await enqueue(session, turn)

        frontend.store.enqueue = lose_the_first  # type: ignore[method-assign]
        client = await Client.open(frontend.port)
        await client.send(type="generate", messages=PROMPT, params=GREEDY)
        session = await client.recv()
        ids = {"session": session["session"], "token": session["token"]}
        await client.send(type="pause", **ids)
        text, seq = joined(await client.until("paused"))
        await client.send(type="resume", after=seq, **ids)
        tail = await client.until("done")
        rest, _ = joined(tail, after=seq)
        assert lost == [(session["session"], 1)]
        assert text + rest == reference
        assert frontend.metrics.resent._value.get() == 1
        await client.close()
    finally:
        await frontend.stop()


async def test_multi_turn_and_conflict_while_running(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    # Greedy: sampling is ~4x slower per token on CPU, and not what this checks.
    long_turn = {"temperature": 0, "max_new_tokens": 200}
    await client.send(type="generate", messages=PROMPT, params=long_turn)
    session = await client.recv()
    ids = {"session": session["session"], "token": session["token"]}
    await client.send(type="generate", id="busy", messages=PROMPT, **ids)
    messages = await client.until("error")
    assert messages[-1]["code"] == "conflict" and messages[-1]["id"] == "busy"
    turn1 = (await client.until("done"))[-1]
    follow_up = [{"role": "user", "content": "And then?"}]
    await client.send(type="generate", messages=follow_up, params=GREEDY, **ids)
    turn2 = await client.until("done")
    assert turn2[0]["turn"] == 2 and turn2[-1]["turn"] == 2
    usage = turn2[-1]["usage"]
    # Turn 2's context holds turn 1's; the engine kept its KV cache for it.
    assert usage["prompt_tokens"] > turn1["usage"]["prompt_tokens"] + turn1["seq"] // 2
    assert usage["cached_tokens"] >= turn1["usage"]["prompt_tokens"]
    # Turn 1 stays replayable.
    await client.send(type="resume", turn=1, after=0, **ids)
    replay = await client.until("done")
    assert replay[-1]["turn"] == 1
    await client.close()


async def test_wrong_token_unknown_session_and_close(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    await client.send(type="generate", prompt="Hello", params={"max_new_tokens": 2})
    session = await client.recv()
    await client.until("done")
    for kind in ("resume", "stop", "pause", "close"):
        await client.send(type=kind, id=kind, session=session["session"], token="wrong")
        error = await client.recv()
        assert (error["code"], error["id"]) == ("not_found", kind)
    await client.send(type="resume", session="no-such-session", token="x")
    assert (await client.recv())["code"] == "not_found"
    await client.send(type="resume", session=session["session"], token=session["token"], turn=9)
    assert (await client.recv())["code"] == "not_found"
    await client.send(
        type="generate", session=session["session"], token=session["token"], messages=PROMPT
    )
    assert (await client.recv())["code"] == "bad_request"  # a text session takes prompts
    await client.send(type="close", session=session["session"], token=session["token"])
    await client.send(type="resume", id="gone", session=session["session"], token=session["token"])
    assert (await client.recv())["code"] == "not_found"
    await client.close()


async def test_bad_input_leaves_other_sessions_untouched(frontend: Frontend) -> None:
    reference, _ = await run_turn(frontend.port)
    good = await Client.open(frontend.port)
    await good.send(type="generate", messages=PROMPT, params=GREEDY)
    bad = await Client.open(frontend.port)
    for frame in [
        "{",
        "[]",
        '{"type": 1}',
        json.dumps({"type": "generate", "prompt": "x" * 256_001}),
    ]:
        await bad.ws.send(frame)
        assert (await bad.recv())["type"] == "error"
    await good.ws.send('{"type": "stop"}')  # bad input on the streaming connection too
    messages = await good.until("done")
    assert [m for m in messages if m["type"] == "error"][0]["code"] == "bad_request"
    assert joined(messages)[0] == reference
    await bad.ws.send(b"\x00" * (2 << 20))  # frame over the size limit: close 1009
    with pytest.raises(ConnectionClosedError):
        await bad.recv()
    assert bad.ws.close_code == 1009
    await good.close()


async def test_no_engine_means_engine_unavailable(redis_url: str) -> None:
    frontend = await start_frontend(redis_url)
    try:
        client = await Client.open(frontend.port)
        await client.send(type="generate", prompt="hi")
        error = await client.recv()
        assert error["code"] == "engine_unavailable" and error["retry_after"] > 0
        await client.close()
        status, body = await http_get(frontend.port, "/healthz")
        assert status == 503 and "engine" in body
    finally:
        await frontend.stop()


@pytest.mark.parametrize("limit", [0, 2])
async def test_overloaded_when_the_queue_is_full(redis_url: str, limit: int) -> None:
    # An engine that is alive (its heartbeat is fresh) but takes no work: the
    # turns stay queued, so the limit is what refuses the one past it.
    redis.Redis.from_url(redis_url).zadd(keys.ENGINES, {"engine-busy": time.time()})
    frontend = await start_frontend(redis_url, max_queued_turns=limit)
    try:
        client = await Client.open(frontend.port)
        for n in range(limit):
            await client.send(type="generate", id=n, prompt="hi")
            assert (await client.recv())["type"] == "session"
        await client.send(type="generate", id=limit, prompt="hi")
        refused = await client.recv()
        assert (refused["type"], refused["code"], refused["id"]) == ("error", "overloaded", limit)
        await client.close()
    finally:
        await frontend.stop()


async def test_api_keys_refuse_at_the_handshake(stack: Stack) -> None:
    frontend = await start_frontend(stack.redis_url, api_keys=frozenset({"sekrit"}))
    url = f"ws://127.0.0.1:{frontend.port}/v1/ws"
    try:
        with pytest.raises(InvalidStatus) as refused:
            await connect(url)
        assert refused.value.response.status_code == 401
        async with connect(url, additional_headers={"Authorization": "Bearer sekrit"}):
            pass
        async with connect(url + "?token=sekrit"):
            pass
    finally:
        await frontend.stop()


@pytest.mark.idle_pause(2)
async def test_an_unwatched_turn_pauses_after_the_idle_limit(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params={"max_new_tokens": 4000})
    session = await client.recv()
    client.ws.transport.abort()
    await asyncio.sleep(4)  # idle limit 2 s
    back = await Client.open(frontend.port)
    # A stop attaches it from the current seq: it is told the pause, then the end.
    await back.send(type="stop", session=session["session"], token=session["token"])
    paused = await back.recv()
    assert paused["type"] == "paused" and 0 < paused["seq"] < 4000
    assert (await back.until("done"))[-1]["finish_reason"] == "cancelled"
    await back.close()


async def test_healthz_metrics_and_chat_page(frontend: Frontend) -> None:
    await run_turn(frontend.port)
    status, body = await http_get(frontend.port, "/healthz")
    assert status == 200 and body.startswith("ok")
    status, body = await http_get(frontend.port, "/metrics")
    assert status == 200
    for name in (
        "wsinfer_time_to_first_delta_seconds_count 1.0",
        "wsinfer_deltas_sent_total",
        "wsinfer_inter_token_latency_seconds_bucket",
        "wsinfer_active_sessions",
    ):
        assert name in body
    status, _ = await http_get(frontend.port, "/nope")
    assert status == 404
    status, _ = await http_get(frontend.port, "/static/../../pyproject.toml")
    assert status == 404


async def http_get(port: int, path: str) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    return await asyncio.to_thread(fetch)
