"""The Responses API's WebSocket mode on ``/v1/responses``, driven by the official
``openai`` SDK's ``responses.connect()`` against a real ``wsinfer serve`` (the
fake model): responses streamed one after another on one socket, chained by
``previous_response_id``, refused as OpenAI's ``error`` event, and, beyond
OpenAI, resumed after a dropped socket over a new socket or over HTTP with one
numbering, cancelled and paused. The sans-I/O parts, and a frontend without an
engine, at the end (fast)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses.responses_server_event import ResponsesServerEvent
from pydantic import TypeAdapter
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.followers import RESPONSE_ENDS
from tests.stack import start_frontend, start_serve, stop_serve
from wsinfer.http.openai import OpenAIError
from wsinfer.http.responses import (
    Output,
    ResponseEvents,
    ResponseId,
    ResponseView,
    parse_response_request,
)
from wsinfer.http.responses_ws import (
    Control,
    Create,
    Follow,
    error_frame,
    event_frame,
    parse_client_event,
    paused_frame,
)
from wsinfer.messages import Limits
from wsinfer.sessions.schema import GenerationParams

KEY = "sekrit"
RATE = 200  # tokens a second
ENDS = RESPONSE_ENDS  # a response's last event
SERVER_EVENT: TypeAdapter[Any] = TypeAdapter(ResponsesServerEvent)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    state = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", f"fake:{RATE}", "--api-key", KEY)
    yield port
    assert stop_serve(process) == 0


@pytest.fixture
def sdk(serve: int) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve}/v1", api_key=KEY)


@pytest.fixture
async def http(serve: int) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    base = f"http://127.0.0.1:{serve}"
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
        yield client


async def one_response(conn: Any, **create: Any) -> list[Any]:
    """``response.create``, then its events up to its last."""
    await conn.response.create(model="wsinfer", **create)
    return await until_end(conn)


async def until_end(conn: Any, keep: int | None = None) -> list[Any]:
    """Events up to a response's last (or an ``error``), or the first ``keep``."""
    events: list[Any] = []
    async for event in conn:
        events.append(event)
        if event.type in (*ENDS, "error") or len(events) == keep:
            break
    return events


def text_of(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def numbers(events: list[Any]) -> list[int]:
    return [e.sequence_number for e in events]


def parse_sse(raw: str) -> list[dict[str, Any]]:
    blocks = [b for b in raw.split("\n\n") if b and not b.startswith(":")]
    return [json.loads(line[6:]) for b in blocks for line in b.split("\n") if line[:6] == "data: "]


def drop(conn: Any) -> None:
    """The socket dies under the client (no close frame), as on a network cut."""
    conn._connection.transport.abort()


# --- OpenAI's WebSocket mode ------------------------------------------------------------


@pytest.mark.slow
async def test_connect_streams_a_response_as_its_sse_stream_does(
    sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    async with sdk.responses.connect() as conn:
        events = await one_response(conn, input="Hello", instructions="Be brief.",
                                    max_output_tokens=12, metadata={"k": "v"})  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete",
    ]  # fmt: skip
    assert numbers(events) == sorted(set(numbers(events))) and numbers(events)[:4] == [0, 1, 2, 3]
    final = events[-1].response
    assert final.metadata == {"k": "v"} and final.instructions == "Be brief."
    assert final.output_text == text_of(events) and final.usage.output_tokens == 12
    # The same response over HTTP: the same numbers for the same events, the same text.
    async with http.stream("GET", f"/v1/responses/{final.id}?stream=true") as answer:
        sse = parse_sse((await answer.aread()).decode())
    ends = [(e["type"], e["sequence_number"]) for e in sse[-4:]]
    assert ends == [(e.type, e.sequence_number) for e in events[-4:]]
    assert [e["sequence_number"] for e in sse[:4]] == [0, 1, 2, 3]
    assert sse[-1]["response"]["output"][0]["content"][0]["text"] == final.output_text
    retrieved = await sdk.responses.retrieve(final.id)
    assert retrieved.output_text == final.output_text and retrieved.status == "incomplete"


@pytest.mark.slow
async def test_several_responses_on_one_socket_chained_by_previous_response_id(
    sdk: openai.AsyncOpenAI,
) -> None:
    async with sdk.responses.connect() as conn:
        first = (await one_response(conn, input="one", max_output_tokens=5))[-1].response
        second = (
            await one_response(
                conn, input="two", max_output_tokens=5, previous_response_id=first.id
            )  # fmt: skip
        )[-1].response
        # Sent before the second ends: it waits for it (one response at a time).
        await conn.response.create(model="wsinfer", input="three", max_output_tokens=5,
                                   previous_response_id=second.id)  # fmt: skip
        await conn.response.create(model="wsinfer", input="apart", max_output_tokens=3)
        third, apart = await until_end(conn), await until_end(conn)
    one, two = ResponseId.parse(first.id), ResponseId.parse(second.id)
    assert (two.session, two.turn, two.token) == (one.session, 2, one.token)
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    three = ResponseId.parse(third[-1].response.id)
    assert (three.session, three.turn) == (one.session, 3)
    assert third[-1].response.usage.input_tokens_details.cached_tokens > 0
    assert ResponseId.parse(apart[-1].response.id).session != one.session
    for events in (third, apart):  # not interleaved: each whole, numbered from 0
        assert numbers(events)[0] == 0 and events[-1].type in ENDS


@pytest.mark.slow
async def test_refusals_are_openai_error_events_and_the_socket_goes_on(
    sdk: openai.AsyncOpenAI,
) -> None:
    async with sdk.responses.connect() as conn:
        bad: list[tuple[dict[str, Any], int, str | None]] = [
            ({"input": "x", "background": True}, 400, "background"),
            ({"input": "x", "temperature": 9}, 400, None),
            ({"input": "x", "reasoning": {"effort": "high", "budget": 9}}, 400, "reasoning"),
            ({"input": "x", "previous_response_id": "resp_nope_1_x"}, 404, None),
            ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
        ]
        for fields, status, param in bad:
            (error,) = await one_response(conn, **fields)
            assert error.type == "error" and error.status == status, fields
            assert error.error.type == "invalid_request_error" and error.error.message
            if param is not None:
                assert error.error.param == param
        await conn.send_raw(json.dumps({"type": "response.fly"}))
        error = await conn.recv()
        assert error.type == "error" and error.error.param == "type"
        await conn.send_raw(json.dumps({"type": "response.create", "input": "x", "bogus": 1}))
        assert (await conn.recv()).error.param == "bogus"
        await conn.send_raw(b"{not json")
        assert (await conn.recv()).status == 400
        events = await one_response(conn, input="ok", max_output_tokens=3, stream_id="lane-a")
        assert events[-1].type == "response.incomplete"
        assert {e.stream_id for e in events} == {"lane-a"}
    with pytest.raises(InvalidStatus) as refused:  # no key: the upgrade itself is refused
        nokey = openai.AsyncOpenAI(base_url=str(sdk.base_url), api_key="wrong")
        async with nokey.responses.connect():
            pass
    assert refused.value.response.status_code == 401


@pytest.mark.slow
async def test_tools_and_function_call_outputs_over_the_socket(sdk: openai.AsyncOpenAI) -> None:
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "name": "get_weather", "parameters": city}
    async with sdk.responses.connect() as conn:
        events = await one_response(conn, input="weather?", tools=[tool], max_output_tokens=4)
        created = events[0].response
        assert [t.name for t in created.tools] == ["get_weather"] and created.tool_choice == "auto"
        follow_up = [
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]  # fmt: skip
        events = await one_response(conn, input=follow_up, tools=[tool], max_output_tokens=4,
                                    previous_response_id=events[-1].response.id)  # fmt: skip
        assert events[-1].type == "response.incomplete"


# --- beyond OpenAI: resume, a second follower, cancel, pause ----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("door", ["socket", "http"])
async def test_a_dropped_socket_resumes_exactly_once(
    door: str, sdk: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """Cut after the opening and a few deltas; the rest comes once, numbered on."""
    async with sdk.responses.connect() as conn:
        await conn.response.create(model="wsinfer", input="long", max_output_tokens=300)
        before = await until_end(conn, keep=10)
        drop(conn)
    rid, last = before[0].response.id, before[-1].sequence_number
    if door == "socket":
        async with sdk.responses.connect() as conn:
            await conn.send({"type": "response.resume", "response_id": rid,  # type: ignore[misc,arg-type]
                             "starting_after": last})  # fmt: skip
            after = [e.model_dump(mode="json") for e in await until_end(conn)]
    else:
        url = f"/v1/responses/{rid}?stream=true&starting_after={last}"
        async with http.stream("GET", url) as answer:
            after = parse_sse((await answer.aread()).decode())
    got = [e.model_dump(mode="json") for e in before] + after
    seen = [e["sequence_number"] for e in got]
    assert seen == sorted(set(seen)) and seen[:4] == [0, 1, 2, 3]  # each once, in order
    assert after[0]["sequence_number"] > last
    final = after[-1]["response"]
    joined = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert joined == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 300 and len(joined.split()) == 300


@pytest.mark.slow
async def test_the_sdks_own_reconnect_resumes_the_response(sdk: openai.AsyncOpenAI) -> None:
    """``on_reconnecting`` queues a ``response.resume``: the SDK sends it first on the
    new socket, and the loop reading events never sees the cut."""
    state: dict[str, Any] = {"last": -1, "rid": None, "cuts": 0}

    def on_reconnecting(event: Any) -> None:
        state["cuts"] += 1
        resume = {"type": "response.resume", "response_id": state["rid"],
                  "starting_after": state["last"]}  # fmt: skip
        asyncio.get_running_loop().create_task(conn.send_raw(json.dumps(resume)))

    manager = sdk.responses.connect(on_reconnecting=on_reconnecting, initial_delay=0.05)
    events: list[Any] = []
    async with manager as conn:
        await conn.response.create(model="wsinfer", input="long", max_output_tokens=200)
        async for event in conn:
            events.append(event)
            state["last"] = event.sequence_number
            state["rid"] = state["rid"] or event.response.id
            if len(events) in (8, 60):
                drop(conn)
            if event.type in ENDS:
                break
    assert state["cuts"] == 2
    seen = numbers(events)
    assert seen == sorted(set(seen))
    assert text_of(events) == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 200


@pytest.mark.slow
async def test_a_second_socket_follows_what_another_created(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.responses.connect() as first, sdk.responses.connect() as second:
        await first.response.create(model="wsinfer", input="long", max_output_tokens=200)
        created = await first.recv()
        await second.send({"type": "response.resume", "response_id": created.response.id})  # type: ignore[misc,arg-type]
        one, two = await asyncio.gather(until_end(first), until_end(second))
    one = [created, *one]
    assert text_of(one) == text_of(two) == one[-1].response.output_text
    assert one[-1].model_dump() == two[-1].model_dump()


@pytest.mark.slow
async def test_pause_resume_and_cancel_from_the_socket(sdk: openai.AsyncOpenAI) -> None:
    async with sdk.responses.connect() as conn:
        await conn.response.create(model="wsinfer", input="long", max_output_tokens=2000)
        events = await until_end(conn, keep=6)
        rid = events[0].response.id
        await conn.send_raw(json.dumps({"type": "response.pause", "response_id": rid}))
        async for event in conn:
            if event.type == "response.paused":
                break
            events.append(event)
        paused = json.loads(event.model_dump_json())
        assert paused["response_id"] == rid and paused["seq"] > 0
        assert (await sdk.responses.retrieve(rid)).status == "in_progress"
        resume = {"type": "response.resume", "response_id": rid}
        await conn.send_raw(json.dumps(resume))  # the stream here goes on, nothing twice
        events += await until_end(conn, keep=5)
        await conn.send_raw(json.dumps({"type": "response.cancel", "response_id": rid}))
        events += await until_end(conn)
    assert events[-1].type == "response.cancelled"  # the SDK has no type of it: a dict
    assert numbers(events) == sorted(set(numbers(events)))
    final = json.loads(events[-1].model_dump_json())["response"]
    assert final["status"] == "cancelled"
    assert text_of(events) == final["output"][0]["content"][0]["text"]


# --- sans I/O, and a frontend without an engine (fast) -----------------------------------


LIMITS = Limits()


def client_event(**fields: Any) -> Any:
    return parse_client_event(json.dumps(fields), LIMITS, "wsinfer")


def test_a_create_is_the_http_bodys_request() -> None:
    body = {"model": "wsinfer", "input": "hi", "instructions": "brief", "max_output_tokens": 7,
            "metadata": {"a": "b"}, "tools": [{"type": "function", "name": "f"}]}  # fmt: skip
    event = client_event(type="response.create", stream=True, stream_id="l", **body)
    assert isinstance(event, Create) and event.lane == "l"
    assert event.ask == parse_response_request(json.dumps(body).encode(), LIMITS, "wsinfer")
    for bad, param in (
        ({"background": True}, "background"),
        ({"generate": False}, "generate"),
        ({"stream_id": 3}, "stream_id"),
        ({"nope": 1}, "nope"),
    ):
        with pytest.raises(OpenAIError) as refused:
            client_event(type="response.create", input="x", **bad)
        assert refused.value.param == param and refused.value.status == 400


def test_resume_cancel_and_pause_name_a_response() -> None:
    rid = "resp_abc_2_tok"
    follow = client_event(type="response.resume", response_id=rid, starting_after=9)
    assert follow == Follow(ResponseId("abc", 2, "tok"), 9, None)
    assert client_event(type="response.resume", response_id=rid).after == -1
    cancel = client_event(type="response.cancel", response_id=rid)
    assert isinstance(cancel, Control) and cancel.kind.value == "stop"
    assert client_event(type="response.pause", response_id=rid).kind.value == "pause"
    for bad in (
        {"type": "response.resume", "response_id": rid, "starting_after": -1},
        {"type": "response.resume", "response_id": rid, "starting_after": True},
        {"type": "response.cancel", "response_id": rid, "extra": 1},
        {"type": "response.steer", "input": "x", "previous_response_id": rid},
        {"type": "nope"},
    ):
        with pytest.raises(OpenAIError):
            client_event(**bad)
    with pytest.raises(OpenAIError) as wrong:
        client_event(type="response.cancel", response_id="resp_nothing")
    assert wrong.value.status == 404


def test_every_frame_is_one_the_sdk_knows() -> None:
    """A whole response's frames, a stream's error and a refusal validate as the SDK's
    server events; the lane is echoed; the numbers are the builder's own."""
    view = ResponseView(ResponseId("s", 1, "t"), "m", 5, GenerationParams())
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0}
    events = ResponseEvents(view, -1)
    out = events.opening_events("queued") + events.delta_events(2, "a")
    out += events.closing_events({"seq": 4, "finish_reason": "stop", "usage": usage}, Output())
    frames = [event_frame(e, "lane") for e in out]
    parsed = [SERVER_EVENT.validate_json(f) for f in frames]
    assert [p.sequence_number for p in parsed] == [0, 1, 2, 3, 5, 8, 9, 10, 11]
    assert {p.stream_id for p in parsed} == {"lane"} and parsed[-1].type == "response.completed"
    failed = SERVER_EVENT.validate_json(event_frame(events.error_event("not_found", "gone"), None))
    assert (failed.type, failed.status, failed.error.code) == ("error", 404, "not_found")
    assert failed.sequence_number == 12
    refusal = OpenAIError(429, "slow down", code="overloaded", retry_after=1.5)
    error = SERVER_EVENT.validate_json(error_frame(refusal))
    assert (error.status, error.error.type) == (429, "rate_limit_error")
    assert error.error.headers["retry-after-ms"] == "1500" and error.sequence_number is None
    paused = json.loads(paused_frame(view.rid, 4, None))
    assert paused == {"type": "response.paused", "response_id": "resp_s_1_t", "seq": 4}


async def test_the_upgrade_checks_the_key_and_refusals_need_no_engine(redis_url: str) -> None:
    frontend = await start_frontend(redis_url, api_keys=frozenset({KEY}))
    url = f"ws://127.0.0.1:{frontend.port}/v1/responses"
    try:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url):
                pass
        assert refused.value.response.status_code == 401
        async with connect(f"{url}?token={KEY}") as ws:  # the browser's query token
            await ws.send(json.dumps({"type": "response.create", "model": "x", "input": "a"}))
            unknown_model = json.loads(await ws.recv())
            assert unknown_model["status"] == 404 and unknown_model["type"] == "error"
            await ws.send(
                json.dumps(
                    {"type": "response.create", "model": "wsinfer", "input": "a", "stream_id": "z"}
                )
            )
            no_engine = json.loads(await ws.recv())
            assert (no_engine["status"], no_engine["stream_id"]) == (503, "z")
            assert no_engine["error"]["code"] == "engine_unavailable"
        headers = {"Authorization": f"Bearer {KEY}"}
        async with connect(url.replace("/v1/responses", "/v1/ws"), additional_headers=headers):
            pass  # the session protocol's door is where it was
    finally:
        await frontend.stop()
