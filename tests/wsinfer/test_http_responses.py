"""The Responses API and text completions of a real ``wsinfer serve`` (the fake
model), driven by the official ``openai`` SDK: create, stream, retrieve, resume
``starting_after`` a cut at every kind of point, background past the idle pause,
cancel, delete, ``previous_response_id``, a WebSocket turn read as a response
and the other way round, and the refusals. The dialect alone, without sockets,
at the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.stack import Client, Stack, joined, start_serve, stop_serve, until
from wsinfer.http.openai import OpenAIError
from wsinfer.http.responses import (
    HEAD,
    Output,
    ResponseEvents,
    ResponseId,
    ResponseView,
    loggable,
    parse_response_request,
)
from wsinfer.messages import Limits
from wsinfer.sessions.schema import GenerationParams

KEY = "sekrit"
IDLE_PAUSE_S = 2.0
RATE = 100  # tokens a second: a 300-token turn runs 3 s, past the idle pause


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    state = tmp_path_factory.mktemp("serve")
    process, port = start_serve(
        state, "--model", f"fake:{RATE}", "--idle-pause", str(IDLE_PAUSE_S), "--api-key", KEY
    )
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


def parse_sse(raw: str) -> list[dict[str, Any]]:
    """The ``data`` of each complete event (comments skipped), checking that
    ``event:`` and ``id:`` say what the data does."""
    out = []
    for block in raw.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if "data" in fields:
            data = json.loads(fields["data"])
            assert fields["event"] == data["type"] and int(fields["id"]) == data["sequence_number"]
            out.append(data)
    return out


async def cut_stream(http: httpx.AsyncClient, body: dict[str, Any], keep: int) -> list[dict]:
    """A streaming create whose connection drops after ``keep`` events."""
    events: list[dict[str, Any]] = []
    raw = ""
    async with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        async for chunk in response.aiter_text():
            raw += chunk
            events = parse_sse(raw)
            if len(events) >= keep:
                return events[:keep]
    return events


def deltas(events: list[Any]) -> str:
    return "".join(_get(e, "delta") for e in events if _get(e, "type").endswith("text.delta"))


def _get(event: Any, name: str) -> Any:
    return event[name] if isinstance(event, dict) else getattr(event, name)


def numbers(events: list[Any]) -> list[int]:
    return [_get(e, "sequence_number") for e in events]


async def until_ended(sdk: openai.AsyncOpenAI, rid: str, timeout_s: float = 60) -> Any:
    ended: list[Any] = []

    async def has_ended() -> bool:
        response = await sdk.responses.retrieve(rid)
        if response.status in ("queued", "in_progress"):
            return False
        ended.append(response)
        return True

    await until(has_ended, timeout_s, f"response {rid} to end", every_s=0.1)
    return ended[0]


# --- create, stream, retrieve ---------------------------------------------------------


@pytest.mark.slow
async def test_create_whole_and_streamed_and_retrieve(sdk: openai.AsyncOpenAI) -> None:
    whole = await sdk.responses.create(
        model="wsinfer", input="Hello", instructions="Be brief.", max_output_tokens=12
    )
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage is not None and whole.usage.output_tokens == 12
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 12
    text = whole.output_text
    assert text and whole.output[0].type == "message"
    stream = await sdk.responses.create(
        model="wsinfer", input=[{"role": "user", "content": "Hello"}], max_output_tokens=12,
        stream=True,
    )  # fmt: skip
    events = [e async for e in stream]
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
    assert deltas(events) == events[-4].text == text  # the fake model: token i is one word
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 12
    again = await sdk.responses.retrieve(final.id)
    assert (again.status, again.output_text, again.created_at) == (
        "incomplete", text, events[0].response.created_at
    )  # fmt: skip


# --- resume ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("keep", [1, 4, 6, 12])
async def test_resume_starting_after_a_cut_is_exactly_once(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, keep: int
) -> None:
    """Cut in the opening events, right after them, and twice mid-text while the
    turn runs; then the SDK resumes from the last sequence number it saw."""
    body = {"model": "wsinfer", "input": "story", "max_output_tokens": 150, "stream": True}
    first = await cut_stream(http, body, keep)
    rid = first[0]["response"]["id"]
    stream = await sdk.responses.retrieve(rid, stream=True, starting_after=numbers(first)[-1])
    rest = [e async for e in stream]
    seen = numbers(first) + numbers(rest)
    assert seen == sorted(set(seen)), "a sequence number was repeated or went back"
    assert seen[:4] == [0, 1, 2, 3] and rest[-1].type == "response.incomplete"
    whole = (await sdk.responses.retrieve(rid)).output_text
    assert deltas(first) + deltas(rest) == whole == rest[-4].text
    assert rest[-1].response.output_text == whole
    assert rest[-1].response.created_at == first[0]["response"]["created_at"]


@pytest.mark.slow
async def test_a_stream_cut_on_one_frontend_resumes_on_another(redis_url: str) -> None:
    """Nothing of a response lives in a frontend: the second, which never saw
    it, resumes it exactly from the sequence number the first one sent last."""
    stack = Stack(redis_url, f"fake:{RATE}")
    try:
        stack.start_engine("engine-1")
        ports = [stack.start_frontend()[1] for _ in range(2)]
        one = f"http://127.0.0.1:{ports[0]}"
        body = {"model": "wsinfer", "input": "story", "max_output_tokens": 150, "stream": True}
        async with httpx.AsyncClient(base_url=one, timeout=60) as http:
            first = await cut_stream(http, body, keep=9)
        other = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{ports[1]}/v1", api_key="unused")
        rid = first[0]["response"]["id"]
        stream = await other.responses.retrieve(rid, stream=True, starting_after=numbers(first)[-1])
        rest = [e async for e in stream]
        seen = numbers(first) + numbers(rest)
        assert seen == sorted(set(seen)) and rest[-1].type == "response.incomplete"
        assert deltas(first) + deltas(rest) == rest[-1].response.output_text
        assert len(rest[-1].response.output_text.split()) == 150
    finally:
        stack.stop()


@pytest.mark.slow
async def test_resume_within_the_closing_events(sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.responses.create(
        model="wsinfer", input="x", max_output_tokens=8, stream=True
    )
    events = [e async for e in stream]
    rid = events[0].response.id
    for tail in (4, 2, 1):
        cut = numbers(events)[-tail - 1]
        rest = [e async for e in await sdk.responses.retrieve(rid, stream=True, starting_after=cut)]
        assert numbers(rest) == numbers(events)[-tail:]
        assert rest[-1].response.output_text == events[-1].response.output_text
    everything = [e async for e in await sdk.responses.retrieve(rid, stream=True)]
    assert numbers(everything)[:4] == [0, 1, 2, 3] and deltas(everything) == deltas(events)


# --- background, cancel, delete ------------------------------------------------------


@pytest.mark.slow
async def test_background_runs_on_unwatched_past_the_idle_pause(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    tokens = int(RATE * IDLE_PAUSE_S * 2)  # twice as long as the idle limit
    background = await sdk.responses.create(
        model="wsinfer", input="go", max_output_tokens=tokens, background=True
    )
    assert background.status in ("queued", "in_progress") and background.background is True
    # The same turn, not in the background, abandoned by its client: idle-paused.
    body = {"model": "wsinfer", "input": "go", "max_output_tokens": tokens, "stream": True}
    abandoned = (await cut_stream(http, body, keep=5))[0]["response"]["id"]
    ended = await until_ended(sdk, background.id)
    assert ended.status == "incomplete" and ended.usage is not None
    assert ended.usage.output_tokens == tokens and ended.background is True
    left = ResponseId.parse(abandoned)
    info = await http.get(f"/v1/sessions/{left.session}", headers={"X-Wsinfer-Token": left.token})
    assert info.json()["status"] == "paused"
    assert (await sdk.responses.retrieve(abandoned)).status == "in_progress"
    # Reading it as a stream continues it to its end, as a WebSocket resume would.
    rest = [e async for e in await sdk.responses.retrieve(abandoned, stream=True)]
    assert rest[-1].type == "response.incomplete"
    assert len(rest[-1].response.output_text.split()) == tokens


@pytest.mark.slow
async def test_cancel_then_delete(sdk: openai.AsyncOpenAI) -> None:
    running = await sdk.responses.create(
        model="wsinfer", input="go", max_output_tokens=2000, background=True
    )
    cancelled = await sdk.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.usage is not None
    assert cancelled.usage.output_tokens < 2000
    events = [e async for e in await sdk.responses.retrieve(running.id, stream=True)]
    # Not among the SDK's typed stream events (OpenAI names it for webhooks): a plain one.
    assert events[-1].type == "response.cancelled"
    assert events[-1].response["status"] == "cancelled"
    assert (await sdk.responses.cancel(running.id)).status == "cancelled"  # once is enough
    await sdk.responses.delete(running.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await sdk.responses.retrieve(running.id)
    assert caught.value.body == {
        "message": "No response found with that id",
        "type": "invalid_request_error",
        "param": None,
        "code": "not_found",
    }


# --- conversations ------------------------------------------------------------------


@pytest.mark.slow
async def test_previous_response_id_continues_the_session(sdk: openai.AsyncOpenAI) -> None:
    first = await sdk.responses.create(model="wsinfer", input="one", max_output_tokens=5)
    second = await sdk.responses.create(
        model="wsinfer", input="two", max_output_tokens=5, previous_response_id=first.id
    )
    one, two = ResponseId.parse(first.id), ResponseId.parse(second.id)
    assert (two.session, two.turn, two.token) == (one.session, 2, one.token)
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0
    # An earlier response: a branch, a new session that goes on from it.
    branch = await sdk.responses.create(
        model="wsinfer", input="x", max_output_tokens=5, previous_response_id=first.id
    )
    forked = ResponseId.parse(branch.id)
    assert forked.session != one.session and forked.turn == 1 and branch.status != "failed"
    assert branch.usage is not None and branch.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
    after = await sdk.responses.create(
        model="wsinfer", input="y", max_output_tokens=5, previous_response_id=branch.id
    )
    assert ResponseId.parse(after.id).turn == 2  # the branch goes on as any session
    assert (await sdk.responses.retrieve(second.id)).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(
            model="wsinfer", input="x", previous_response_id=f"resp_{one.session}_2_wrong"
        )
    running = await sdk.responses.create(
        model="wsinfer", input="x", max_output_tokens=2000, background=True,
        previous_response_id=second.id,
    )  # fmt: skip
    with pytest.raises(openai.ConflictError):  # one turn at a time per session
        await sdk.responses.create(model="wsinfer", input="y", previous_response_id=running.id)
    await sdk.responses.cancel(running.id)


@pytest.mark.slow
async def test_a_websocket_turn_is_a_response_and_back(serve: int, sdk: openai.AsyncOpenAI) -> None:
    client = await Client.open(serve, additional_headers={"Authorization": f"Bearer {KEY}"})
    try:
        await client.send(type="generate", prompt="hi", params={"max_new_tokens": 20})
        messages = await client.until("done")
        accepted = messages[0]
        text, _ = joined(messages)
        rid = f"resp_{accepted['session']}_{accepted['turn']}_{accepted['token']}"
        response = await sdk.responses.retrieve(rid)
        assert response.output_text == text and response.status == "incomplete"
        events = [e async for e in await sdk.responses.retrieve(rid, stream=True)]
        assert deltas(events) == text
        # And back: a response's id names the session a WebSocket client resumes.
        created = await sdk.responses.create(model="wsinfer", input="hi", max_output_tokens=9)
        ids = ResponseId.parse(created.id)
        await client.send(type="resume", session=ids.session, token=ids.token, after=0)
        assert joined(await client.until("done"))[0] == created.output_text
    finally:
        await client.close()


# --- text completions and finish reasons ------------------------------------------


@pytest.mark.slow
async def test_completions_whole_streamed_and_continued(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    raw = await sdk.completions.with_raw_response.create(
        model="wsinfer", prompt="Once", max_tokens=6
    )
    whole = raw.parse()
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    session, token = raw.headers["x-wsinfer-session"], raw.headers["x-wsinfer-token"]
    assert whole.id == f"cmpl-{session}-1"
    chunks = [
        c
        async for c in await sdk.completions.create(
            model="wsinfer", prompt=["Once"], max_tokens=6, stream=True,
            stream_options={"include_usage": True},
        )
    ]  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and len({c.created for c in chunks}) == 1
    more = await sdk.completions.create(
        model="wsinfer", prompt=" and", max_tokens=3,
        extra_headers={"X-Wsinfer-Session": session, "X-Wsinfer-Token": token},
    )  # fmt: skip
    assert more.id == f"cmpl-{session}-2" and more.usage is not None
    assert more.usage.prompt_tokens > whole.usage.prompt_tokens  # the text went on
    # Its resume speaks text_completion when asked, with the turn's one `created`;
    # unasked, chat chunks, as for every session (what resuming clients parse).
    auth = {"X-Wsinfer-Token": token}
    for wanted, shape in [("text_completion", "text"), ("", "delta")]:
        resumed = await http.get(
            f"/v1/sessions/{session}/stream", params={"turn": 1, "object": wanted}, headers=auth
        )
        first = json.loads(resumed.text.split("data: ", 2)[1].split("\n")[0])
        assert first["object"] == (wanted or "chat.completion.chunk"), first
        assert shape in first["choices"][0] and first["created"] == whole.created
    bad = await http.get(f"/v1/sessions/{session}/stream?object=x", headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "object"


@pytest.mark.slow
async def test_a_stopped_chat_turn_finishes_with_stop(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    raw = await sdk.chat.completions.with_raw_response.create(
        model="wsinfer", messages=[{"role": "user", "content": "go"}], max_tokens=2000,
        stream=True,
    )  # fmt: skip
    stream = raw.parse()
    session, token = raw.headers["x-wsinfer-session"], raw.headers["x-wsinfer-token"]
    first = await anext(aiter(stream))
    stopped = await http.post(f"/v1/sessions/{session}/stop", headers={"X-Wsinfer-Token": token})
    assert stopped.json()["finish_reason"] == "cancelled"  # wsinfer's own route says what it was
    chunks = [first, *[c async for c in stream]]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and "cancelled" not in reasons
    assert len({c.created for c in chunks}) == 1


# --- refusals -----------------------------------------------------------------------


@pytest.mark.slow
async def test_refusals_in_openai_shape(serve: int, sdk: openai.AsyncOpenAI) -> None:
    for bad in ({"temperature": 9}, {"input": []}, {"tools": [{"type": "function"}]},
                {"frobnicate": 1}, {"input": [{"type": "function_call_output"}]}):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.responses.create(model="wsinfer", extra_body={"input": "x", **bad})
        assert set(caught.value.body) == {"message", "type", "param", "code"}  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.create(model="other", input="x")
    made = await sdk.responses.create(model="wsinfer", input="x", max_output_tokens=2)
    rid = ResponseId.parse(made.id)
    for wrong in (
        f"resp_{rid.session}_{rid.turn}_not-the-token",  # another's session: not found
        f"resp_{rid.session}_9_{rid.token}",  # no such turn
        "resp_nonsense",
        "chatcmpl-x",
    ):
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.retrieve(wrong)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.cancel(wrong)
    with pytest.raises(openai.BadRequestError):
        await sdk.responses.retrieve(made.id, stream=True, extra_query={"starting_after": "x"})  # type: ignore[call-overload]
    stranger = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        await stranger.responses.retrieve(made.id)


# --- the dialect, without sockets --------------------------------------------------


def test_a_response_id_names_session_turn_and_token() -> None:
    rid = ResponseId("0123abcd", 7, "tok_en-with_under_scores")
    assert str(rid) == "resp_0123abcd_7_tok_en-with_under_scores"
    assert ResponseId.parse(str(rid)) == rid
    assert rid.previous == ResponseId("0123abcd", 6, rid.token)
    assert ResponseId("s", 1, "t").previous is None
    for text in ("resp_", "resp_s_0_t", "resp_s_x_t", "resp_s_1_", "resp_s-x_1_t", "msg_s_1_t",
                 "resp_s_²_t", f"resp_{'s' * 300}_1_t"):  # fmt: skip
        with pytest.raises(OpenAIError) as caught:
            ResponseId.parse(text)
        assert caught.value.status == 404 and "resp_" not in caught.value.message


def test_log_lines_never_carry_a_response_id_or_a_token() -> None:
    line = loggable("/v1/responses/resp_s_1_SECRET/cancel?stream=true&starting_after=3")
    assert "SECRET" not in line and line.startswith("/v1/responses/resp_[redacted]/cancel")
    line = loggable("/v1/sessions/s/stream?session_token=SECRET&token=KEY&after=2")
    assert "SECRET" not in line and "KEY" not in line and line.endswith("&after=2")


def request(**body: Any) -> Any:
    data = {"model": "m", "input": "hi", **body}
    return parse_response_request(json.dumps(data).encode(), Limits(), "m")


def test_a_request_becomes_a_generate() -> None:
    asked = request(
        instructions="brief", max_output_tokens=7, temperature=0, top_p=0.5, background=True,
        input=[{"type": "message", "role": "developer", "content": "x"},
               {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                            {"type": "input_text", "text": "b"}]}],
        previous_response_id="resp_s_3_t", store=True, tool_choice="auto", metadata={"k": "v"},
    )  # fmt: skip
    assert asked.generate.messages == [
        {"role": "system", "content": "brief"},
        {"role": "system", "content": "x"},
        {"role": "user", "content": "ab"},
    ]
    params = asked.generate.params
    assert (params.max_new_tokens, params.temperature, params.top_p) == (7, 0.0, 0.5)
    assert (asked.generate.session, asked.generate.token) == ("s", "t")
    assert asked.background and not asked.stream and asked.metadata == {"k": "v"}
    assert request().generate.messages == [{"role": "user", "content": "hi"}]


def test_function_calls_and_their_outputs_in_the_input_are_the_chats() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    asked = request(
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        input=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Let me see."},
            call,
            {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
        ],
    )
    params = asked.generate.params
    assert (params.tool_choice, params.parallel_tool_calls) == ("function:f", False)
    kept = {"type": "function", "function": {"name": "f", "arguments": {}}}
    assert asked.generate.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me see.",
         "tool_calls": [{**kept, "id": "c1"}, {**kept, "id": "c2"}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
    ]  # fmt: skip
    for bad, words in (
        ({**call, "call_id": 3}, "call_id must be a string"),
        ({**call, "arguments": "[]"}, "arguments must be a JSON object"),
        ({"type": "function_call_output", "call_id": "c1", "output": 5}, "output"),
        ({**call, "extra": 1}, "unknown fields"),
    ):
        with pytest.raises(OpenAIError, match=words):
            request(input=[{"role": "user", "content": "hi"}, bad])
    with pytest.raises(OpenAIError, match="only function tools"):
        request(tools=[{"type": "file_search"}])


def test_sequence_numbers_follow_the_turn_seq() -> None:
    view = ResponseView(ResponseId("s", 1, "t"), "m", 5, GenerationParams())
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 0}
    done = {"seq": 4, "finish_reason": "cancelled", "usage": usage}

    def replay(after: int) -> list[dict[str, Any]]:
        events = ResponseEvents(view, after)
        out = events.opening("queued")
        log = ((2, "a"), (4, "b"))  # the turn's deltas: (seq, text)
        for seq, text in log:
            if seq > events.seq_after:  # what the turn's resume from seq_after replays
                out += events.delta(seq, text)
        before = "".join(text for seq, text in log if seq <= events.seq_after)
        return parse_sse((out + events.closing(done, Output(before))).decode())

    everything = replay(-1)
    assert numbers(everything) == [0, 1, 2, 3, HEAD + 2, HEAD + 4, 8, 9, 10, 11]
    assert everything[-1]["type"] == "response.cancelled"
    assert everything[-4]["text"] == "ab" and everything[-1]["response"]["status"] == "cancelled"
    for after in range(-1, 12):
        tail = replay(after)
        assert numbers(tail) == [n for n in numbers(everything) if n > after]
        if tail and after >= HEAD + 2:
            assert tail[-1]["response"]["output"][0]["content"][0]["text"] == "ab"


def test_function_calls_come_after_the_message_and_resume_anywhere() -> None:
    """A delta that completes a call has no event; the call's four events follow the
    message's three, before the response's last, and a reader resumed after any
    number gets exactly the events after it, the calls it had before included."""
    weather = {"type": "function", "function": {"name": "get_weather"}}
    params = GenerationParams.parse({"tools": [weather]})
    view = ResponseView(ResponseId("s", 1, "t"), "m", 5, params)
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0}
    done = {"seq": 5, "finish_reason": "tool_calls", "usage": usage}
    call = {"index": 0, "id": "call_s_1_0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    log: list[tuple[int, str, list[dict[str, Any]]]] = [(2, "Let", []), (5, "", [call])]

    def replay(after: int) -> list[dict[str, Any]]:
        events = ResponseEvents(view, after)
        out = events.opening("queued")
        for seq, text, calls in log:
            if seq > events.seq_after:
                out += events.delta(seq, text, None, calls)
        had = [entry for entry in log if entry[0] <= events.seq_after]
        before = Output("".join(e[1] for e in had), [], [c for e in had for c in e[2]])
        return parse_sse((out + events.closing(done, before)).decode())

    everything = replay(-1)
    assert numbers(everything) == [0, 1, 2, 3, HEAD + 2, *range(HEAD + 6, HEAD + 14)]
    assert [e["type"] for e in everything[-5:]] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    item = everything[-2]["item"]
    assert (item["type"], item["call_id"], item["status"]) == (
        "function_call",
        "call_s_1_0",
        "completed",
    )
    assert everything[-2]["output_index"] == 1 and item["arguments"] == '{"city": "Paris"}'
    for after in range(-1, HEAD + 13):  # the last number: nothing after it
        tail = replay(after)
        assert numbers(tail) == [n for n in numbers(everything) if n > after]
        output = tail[-1]["response"]["output"]
        assert [o["type"] for o in output] == ["message", "function_call"]
        assert output[1]["call_id"] == "call_s_1_0" and output[0]["content"][0]["text"] == "Let"
    body = view.body("completed", "Let", done, None, [call])
    assert body["tools"] == [{"type": "function", "name": "get_weather", **body["tools"][0]}]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True


def test_include_logprobs_and_top_logprobs_ask_for_log_probabilities() -> None:
    assert not request().generate.params.logprobs
    asked = request(include=["message.output_text.logprobs"], top_logprobs=2).generate.params
    assert asked.logprobs and asked.top_logprobs == 2
    assert request(top_logprobs=3).generate.params.logprobs  # top_logprobs alone asks too
    assert request(include=[]).generate.params.logprobs is False
    for bad in ({"include": ["reasoning.encrypted_content"]}, {"include": "x"}):
        with pytest.raises(OpenAIError, match="include"):
            request(**bad)
    with pytest.raises(OpenAIError, match="top_logprobs"):
        request(top_logprobs=21)


def lp(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}


def test_a_resumed_readers_closing_events_carry_every_entry() -> None:
    """The deltas carry their own entries; the closing events and the final response
    carry the whole output's, those before the reader's resume point included."""
    params = GenerationParams(logprobs=True)
    view = ResponseView(ResponseId("s", 1, "t"), "m", 5, params)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    events = ResponseEvents(view, HEAD + 2)  # had the opening and the first delta
    out = events.delta(4, "b", [lp("b")])
    out += events.closing(
        {"seq": 4, "finish_reason": "stop", "usage": usage}, Output("a", [lp("a")])
    )
    parsed = parse_sse(out.decode())
    assert parsed[0]["logprobs"] == [lp("b")]
    assert parsed[1]["type"] == "response.output_text.done"
    assert parsed[1]["text"] == "ab" and parsed[1]["logprobs"] == [lp("a"), lp("b")]
    assert parsed[2]["part"]["logprobs"] == [lp("a"), lp("b")]
    final = parsed[-1]["response"]
    assert final["output"][0]["content"][0]["logprobs"] == [lp("a"), lp("b")]
    assert final["top_logprobs"] == 0


@pytest.mark.slow
async def test_logprobs_through_the_sdk_whole_streamed_resumed_and_retrieved(
    http: httpx.AsyncClient, sdk: openai.AsyncOpenAI
) -> None:
    """The fake model is sure of every word: log-probability 0, itself the top one."""
    asked: dict[str, Any] = {
        "model": "wsinfer", "input": "story", "max_output_tokens": 40,
        "include": ["message.output_text.logprobs"], "top_logprobs": 1,
    }  # fmt: skip
    whole = await sdk.responses.create(**asked)
    entries = whole.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert entries is not None and len(entries) == 40 and whole.top_logprobs == 1
    assert "".join(e.token for e in entries) == whole.output_text
    assert all(e.logprob == 0.0 and e.top_logprobs[0].token == e.token for e in entries)
    first = await cut_stream(http, {**asked, "stream": True}, 10)
    rid = first[0]["response"]["id"]
    stream = await sdk.responses.retrieve(rid, stream=True, starting_after=numbers(first)[-1])
    rest = [e async for e in stream]
    streamed = [x for e in first if e["type"].endswith("text.delta") for x in e["logprobs"]]
    streamed += [x.token for e in rest if e.type.endswith("text.delta") for x in e.logprobs]  # type: ignore[union-attr]
    tokens = [x if isinstance(x, str) else x["token"] for x in streamed]
    done = rest[-4]
    assert done.type == "response.output_text.done" and len(done.logprobs) == 40  # type: ignore[union-attr]
    assert tokens == [x.token for x in done.logprobs]  # type: ignore[union-attr]
    again = await sdk.responses.retrieve(rid)
    kept = again.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert kept is not None and [x.token for x in kept] == tokens


def test_calls_drawn_stream_their_events_and_resume_anywhere() -> None:
    """Held to its calls, a call's item is added once its name is drawn and each piece
    of its arguments is an event numbered by the token that drew it; a reader resumed
    after any number gets exactly the events after it. A call whose start shares its
    delta with text comes whole with the closing events instead (no token does that:
    the order of the events stays right whatever the tokens)."""
    from wsinfer.http.responses_routes import _output_of
    from wsinfer.sessions.schema import DeltaEvent

    weather = {"type": "function", "function": {"name": "get_weather"}}
    params = GenerationParams.parse({"tools": [weather], "tool_choice": "required"})
    view = ResponseView(ResponseId("s", 1, "t"), "m", 5, params)
    usage = {"prompt_tokens": 3, "completion_tokens": 14, "cached_tokens": 0}
    done = {"seq": 14, "finish_reason": "tool_calls", "usage": usage}

    def call(index: int, arguments: str) -> dict[str, Any]:
        function = {"name": "get_weather", "arguments": arguments}
        return {"index": index, "id": f"call_s_1_{index}", "type": "function", "function": function}

    def part(index: int, piece: str, first: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"index": index, "id": f"call_s_1_{index}"}
        out["function"] = {"arguments": piece}
        if first:
            out["type"], out["function"]["name"] = "function", "get_weather"
        return out

    log = [
        DeltaEvent(3, "", [3], tool_call_parts=[part(0, "", first=True)]),
        DeltaEvent(4, "", [4], tool_call_parts=[part(0, '{"city": ')]),
        DeltaEvent(6, "", [6], tool_call_parts=[part(0, '"Paris"}')]),
        DeltaEvent(
            8, "", [8], tool_calls=[call(0, '{"city": "Paris"}')], tool_call_parts=[part(0, "")]
        ),  # fmt: skip
        DeltaEvent(12, "\n", [12], tool_call_parts=[part(1, "", first=True)]),
        DeltaEvent(13, "", [13], tool_call_parts=[part(1, "{}")]),
        DeltaEvent(14, "", [14], tool_calls=[call(1, "{}")], tool_call_parts=[part(1, "")]),
    ]

    def replay(after: int) -> list[dict[str, Any]]:
        events = ResponseEvents(view, after)
        out = events.opening_events("queued")
        for e in log:
            if e.seq > events.seq_after:
                if events.before is None:  # as the route reads it, once needed
                    events.before = _output_of(log, events.seq_after)
                out += events.delta_events(e.seq, e.text, None, e.tool_calls, e.tool_call_parts)
        if events.before is None:
            events.before = _output_of(log, events.seq_after)
        return out + events.closing_events(done, events.before)

    everything = replay(-1)
    kinds = [e["type"] for e in everything]
    assert numbers(everything) == [0, 1, 2, 3, *(HEAD + s for s in (3, 4, 6, 12)),
                                   *range(HEAD + 15, HEAD + 25)]  # fmt: skip
    assert kinds[4:8] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.output_text.delta",
    ]  # fmt: skip
    assert kinds[8:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        # the call drawn as its events went: its last two
        "response.function_call_arguments.done", "response.output_item.done",
        # the call whose start came beside text: all four here
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert everything[4]["item"]["status"] == "in_progress" and everything[4]["output_index"] == 1
    drawn = everything[4]["item"]["arguments"] + everything[5]["delta"] + everything[6]["delta"]
    assert drawn == '{"city": "Paris"}' == everything[11]["arguments"]
    assert everything[5]["item_id"] == everything[4]["item"]["id"] == everything[12]["item"]["id"]
    for after in range(-1, HEAD + 25):
        tail = replay(after)
        assert numbers(tail) == [n for n in numbers(everything) if n > after]
        rest = [e["type"] for e in everything if e["sequence_number"] > after]
        assert [e["type"] for e in tail] == rest
