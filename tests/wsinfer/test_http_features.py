"""What OpenAI-API users build on, through the official SDK against a real
``wsinfer serve`` (the tiny model): the prefix cache seen by a client that resends
the whole conversation, structured output on every door, and the legacy
completions' logprobs. The transport and resume tests stay in test_http.py."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import openai
import pytest

from tests.stack import Client, joined
from tests.wsinfer.test_http import AUTH, KEY, PROMPT, serve  # noqa: F401 (a fixture)


async def test_a_conversation_resent_in_full_reuses_the_kv_cache_on_every_door(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    """What every standard OpenAI client does, no session header: the whole history
    again. The prefix cache serves the blocks the first turn computed, and both doors
    say so (``cached_tokens``)."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    rules = " ".join(f"Rule {i}: answer in {i} words." for i in range(40))
    system = {"role": "system", "content": f"{random.random()} {rules}"}  # nobody's before
    first: list[Any] = [system, {"role": "user", "content": "What is a lighthouse?"}]
    one = await client.chat.completions.create(
        model="wsinfer", messages=first, temperature=0, max_tokens=8
    )
    assert one.usage is not None and one.usage.prompt_tokens > 200
    assert one.usage.prompt_tokens_details is not None
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    whole_blocks = one.usage.prompt_tokens // 16 * 16  # the first turn's prompt, computed
    history = first + [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "And a harbour?"},
    ]
    stream = await client.chat.completions.create(
        model="wsinfer", messages=history, temperature=0, max_tokens=8,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk async for chunk in stream][-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= whole_blocks
    ws = await Client.open(serve[0], additional_headers=AUTH)
    await ws.send(type="generate", messages=history, params={"max_new_tokens": 4})
    done = (await ws.until("done"))[-1]
    await ws.close()
    assert done["usage"]["cached_tokens"] >= usage.prompt_tokens_details.cached_tokens
    response = await client.responses.create(
        model="wsinfer",
        input=history,
        max_output_tokens=4,  # type: ignore[arg-type]
    )
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens >= whole_blocks


THING = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


async def test_structured_output_through_the_sdk_every_door(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    """response_format on chat (whole, streamed, the SDK's pydantic parse), the
    Responses API's text.format (over HTTP and its WebSocket mode), and the
    WebSocket's params: a random-weight model's
    answers all parse and validate; a schema that cannot be enforced is a 400."""
    import jsonschema
    from pydantic import BaseModel

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "thing", "schema": THING}}
    sampled = {"model": "wsinfer", "messages": PROMPT, "temperature": 1.0, "max_tokens": 60}
    for seed in range(3):
        whole = await client.chat.completions.create(**sampled, seed=seed, response_format=fmt)
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content or ""), THING)
    stream = await client.chat.completions.create(**sampled, response_format=fmt, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), THING)

    class Thing(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]

    parsed = await client.chat.completions.parse(**sampled, response_format=Thing)
    assert isinstance(parsed.choices[0].message.parsed, Thing)
    response = await client.responses.create(
        model="wsinfer", input="Describe a thing.", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "thing", "schema": THING, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), THING)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    async with client.responses.connect() as conn:  # OpenAI's WebSocket mode
        thing = {"type": "json_schema", "name": "thing", "schema": THING, "strict": True}
        await conn.response.create(
            model="wsinfer", input="Describe a thing.", max_output_tokens=60,
            temperature=1.0, text={"format": thing},  # type: ignore[typeddict-item]
        )  # fmt: skip
        async for event in conn:
            if event.type == "response.completed":
                over_socket = event.response
                break
    jsonschema.validate(json.loads(over_socket.output_text), THING)
    assert over_socket.text is not None and over_socket.text.format is not None
    assert over_socket.text.format.type == "json_schema"
    ws = await Client.open(serve[0], additional_headers=AUTH)
    await ws.send(type="generate", messages=PROMPT, params={"response_format": fmt, "seed": 4})
    messages = await ws.until("done")
    jsonschema.validate(json.loads(joined(messages)[0]), THING)
    await ws.send(type="generate", messages=PROMPT, params={"response_format": {"type": "yaml"}})
    refused = await ws.recv()
    assert refused["type"] == "error" and refused["code"] == "bad_request"
    await ws.close()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError, match="cannot be enforced"):
        await client.chat.completions.create(**sampled, response_format=bad)


async def test_legacy_completion_logprobs_whole_and_streamed(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    body: Any = {"model": "wsinfer", "prompt": "Once upon a time", "max_tokens": 12,
                 "temperature": 0, "logprobs": 3}  # fmt: skip
    whole = await client.completions.create(**body)
    text, lp = whole.choices[0].text, whole.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert b"".join(t.encode() for t in lp.tokens).decode() == text or "\ufffd" in text
    for top, drawn in zip(lp.top_logprobs, lp.token_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(drawn)  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] < len(text)
    stream = await client.completions.create(**body, stream=True)
    chunks = [c.choices[0] async for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.logprobs.tokens or []] == lp.tokens  # type: ignore[union-attr]
    offsets = [o for c in chunks for o in c.logprobs.text_offset or []]  # type: ignore[union-attr]
    assert offsets == lp.text_offset  # counted across the stream's chunks
    plain = await client.completions.create(**{**body, "logprobs": None})
    assert plain.choices[0].logprobs is None
    for bad in (21, -1, True, "3"):
        with pytest.raises(openai.BadRequestError, match="logprobs must be an integer"):
            await client.completions.create(**{**body, "logprobs": bad})


WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "A city's weather",
        "parameters": WEATHER_ARGS,
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The Responses API's flat tool, and a request held to a call of it.
RESPONSES_WEATHER = {
    "type": "function", "name": "get_weather", "parameters": WEATHER_ARGS, "strict": True
}  # fmt: skip
ASKED_FOR_A_CALL: Any = {
    "model": "wsinfer", "input": "What is the weather in Paris?", "tools": [RESPONSES_WEATHER],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "parallel_tool_calls": False, "temperature": 1.0, "max_output_tokens": 80,
}  # fmt: skip


async def test_tool_calls_through_the_sdk_the_websocket_and_the_python_client(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    """A required call (the random-weight model left alone never calls): the SDK's
    whole answer, its stream helper's accumulated calls, the results sent back as
    the next request; over WebSocket the call in a delta, the same on a resume; the
    Python client's ``turn.tool_calls``."""
    import jsonschema

    from wsinfer.clients import connect

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    named = {"type": "function", "function": {"name": "get_weather"}}
    asked: Any = {
        "model": "wsinfer", "messages": ASK, "tools": [WEATHER], "tool_choice": named,
        "parallel_tool_calls": False, "temperature": 1.0, "max_tokens": 80,
    }  # fmt: skip
    whole = await client.chat.completions.create(**asked, seed=1)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].type == "function"
    call = calls[0].function  # type: ignore[union-attr]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_ARGS)
    async with client.chat.completions.stream(**asked, seed=1) as stream:
        final = await stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed is not None and streamed[0].function.arguments == call.arguments  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"
    # Held to its call, the call streams as drawn: OpenAI's chunks, its id and name first.
    chunks = [c async for c in await client.chat.completions.create(**asked, seed=1, stream=True)]
    entries = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert len(entries) > 3 and entries[0].function is not None
    assert entries[0].id is not None and entries[0].id.endswith("_1_0")  # its session's
    assert entries[0].function.name == "get_weather" and all(e.id is None for e in entries[1:])
    assert "".join(e.function.arguments or "" for e in entries if e.function) == call.arguments
    # The result goes back with the call, as every OpenAI client sends it.
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear"}'},
    ]
    answer = await client.chat.completions.create(
        model="wsinfer", messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.prompt_tokens > whole.usage.prompt_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError, match="not one of the tools"):
        other = {"type": "function", "function": {"name": "get_time"}}
        await client.chat.completions.create(**{**asked, "tool_choice": other})

    params = {"tools": [WEATHER], "tool_choice": named, "parallel_tool_calls": False, "seed": 1}
    ws = await Client.open(serve[0], additional_headers=AUTH)
    await ws.send(type="generate", messages=ASK, params={**params, "temperature": 1.0})
    messages = await ws.until("done")
    session = messages[0]
    delivered = [c for m in messages if m["type"] == "delta" for c in m.get("tool_calls", ())]
    assert messages[-1]["finish_reason"] == "tool_calls" and len(delivered) == 1
    assert delivered[0]["function"]["arguments"] == call.arguments  # the same draws (seed 1)
    assert delivered[0]["id"] == f"call_{session['session']}_1_0"
    await ws.send(type="resume", session=session["session"], token=session["token"], after=0)
    replayed = await ws.until("done")
    again = [c for m in replayed if m["type"] == "delta" for c in m.get("tool_calls", ())]
    assert again == delivered
    # Its parts join to its arguments, and a resume inside them gives the rest.
    drawn = [m for m in messages if m["type"] == "delta" and m.get("tool_call_parts")]
    assert len(drawn) > 3 and drawn[0]["tool_call_parts"][0]["function"]["name"] == "get_weather"

    def pieces(deltas: list[dict[str, Any]]) -> str:
        return "".join(p["function"]["arguments"] for m in deltas for p in m["tool_call_parts"])

    assert pieces(drawn) == call.arguments
    middle = drawn[len(drawn) // 2]["seq"]
    await ws.send(type="resume", session=session["session"], token=session["token"], after=middle)
    rest = [m for m in await ws.until("done") if m["type"] == "delta"]
    assert all(m["seq"] > middle for m in rest)
    before = [m for m in drawn if m["seq"] <= middle]
    assert pieces(before) + pieces([m for m in rest if m.get("tool_call_parts")]) == call.arguments
    await ws.close()
    async with connect(f"ws://127.0.0.1:{serve[0]}/v1/ws", api_key=KEY) as python:
        turn = await python.start(messages=ASK, params={**params, "temperature": 1.0})
        await turn.wait()
        assert turn.finish_reason == "tool_calls" and len(turn.tool_calls) == 1
        assert turn.tool_calls[0]["function"] == delivered[0]["function"]
        assert turn.drawn_calls == turn.tool_calls  # drawn piece by piece, the same


async def test_n_choices_whole_streamed_and_legacy(serve: tuple[int, Path]) -> None:  # noqa: F811
    """``n``: each choice a session of its own, seeded seed + index, so a choice is
    what a single request with that seed draws; one id, the usage of all; the
    headers name every choice's session, which resumes on its own."""
    import httpx

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    sampled: Any = {"model": "wsinfer", "messages": PROMPT, "temperature": 1.0, "max_tokens": 12}
    raw = await client.chat.completions.with_raw_response.create(**sampled, n=3, seed=5)
    three = raw.parse()
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) > 1  # different seeds, different draws
    alone = await client.chat.completions.create(**sampled, seed=7)
    assert alone.choices[0].message.content == texts[2]
    assert three.usage is not None and alone.usage is not None
    assert (
        three.usage.completion_tokens == 36
        and three.usage.prompt_tokens == alone.usage.prompt_tokens
    )
    sessions = raw.headers["X-Wsinfer-Session"].split(", ")
    tokens = raw.headers["X-Wsinfer-Token"].split(", ")
    assert len(sessions) == len(tokens) == 3 and three.id == f"chatcmpl-{sessions[0]}-1"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serve[0]}", headers=AUTH) as http:
        for session, token in zip(sessions, tokens, strict=True):
            info = await http.get(f"/v1/sessions/{session}", headers={"X-Wsinfer-Token": token})
            assert info.json()["status"] == "done"

    stream = await client.chat.completions.create(
        **sampled, n=2, seed=5, stream=True, stream_options={"include_usage": True}
    )
    parts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str | None] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            parts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert [parts[0], parts[1]] == texts[:2] and reasons == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 24

    legacy = await client.completions.create(
        model="wsinfer", prompt="Once upon a time", n=2, max_tokens=4, seed=1, temperature=1.0
    )
    assert [c.index for c in legacy.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="n must be"):
        await client.chat.completions.create(**sampled, n=9)
    with pytest.raises(openai.BadRequestError, match="cannot continue"):
        await client.chat.completions.create(
            **sampled, n=2,
            extra_headers={"X-Wsinfer-Session": sessions[0], "X-Wsinfer-Token": tokens[0]},
        )  # fmt: skip


async def test_a_choice_refused_after_others_started_closes_theirs(
    serve: tuple[int, Path],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Choice 1 is refused (here: it names a session that does not exist) after
    choice 0 started: the request is answered the refusal, and choice 0's session,
    which nobody could name, is closed rather than left to run."""
    import dataclasses

    import httpx

    from tests.wsinfer.test_http import in_process_frontend
    from wsinfer.http import choices

    real_choice, closed = choices._choice, []

    def broken(generate: Any, index: int) -> Any:
        if index == 1:
            return dataclasses.replace(generate, session="nobody", token="t" * 32)
        return real_choice(generate, index)

    real_forget = choices.ManyChoices._forget

    async def spy(self: Any, accepted: list[dict[str, Any]]) -> None:
        closed.extend(accepted)
        await real_forget(self, accepted)

    monkeypatch.setattr(choices, "_choice", broken)
    monkeypatch.setattr(choices.ManyChoices, "_forget", spy)
    frontend = await in_process_frontend(serve)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{frontend.port}", headers=AUTH, timeout=30
        ) as http:
            body = {"model": "wsinfer", "messages": PROMPT, "n": 2, "max_tokens": 2000}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 404, response.text
            assert len(closed) == 1
            session, token = closed[0]["session"], closed[0]["token"]
            info = await http.get(f"/v1/sessions/{session}", headers={"X-Wsinfer-Token": token})
            assert info.status_code == 404
    finally:
        await frontend.stop()


async def test_function_calls_through_the_responses_api(serve: tuple[int, Path]) -> None:  # noqa: F811
    """The Responses API's function tools, as the Agents SDK uses them: a required
    call is a ``function_call`` output item; its ``function_call_output`` continues
    the conversation by ``previous_response_id``; streamed, the call's events follow
    the message's, and a stream resumed inside them (``starting_after``) gives the
    rest, numbered on."""
    import jsonschema

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    tool, asked = RESPONSES_WEATHER, ASKED_FOR_A_CALL
    first = await client.responses.create(**asked)
    assert first.status == "completed" and first.tools[0].name == "get_weather"  # type: ignore[union-attr]
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_ARGS)
    answer = await client.responses.create(
        model="wsinfer", previous_response_id=first.id, tools=[tool],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    assert not [item for item in answer.output if item.type == "function_call"]
    # The same conversation sent whole, as a client without previous_response_id does.
    whole = await client.responses.create(
        model="wsinfer", tools=[tool], max_output_tokens=8, temperature=0,  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            calls[0].model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
        ],
    )  # fmt: skip
    assert whole.output[0].type == "message"

    stream = await client.responses.create(**asked, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    final = events[-1].response  # type: ignore[union-attr]
    streamed = [item for item in final.output if item.type == "function_call"]
    jsonschema.validate(json.loads(streamed[0].arguments), WEATHER_ARGS)
    # Held to its call, the call streams as it is drawn: its item added, then a
    # delta per piece of its arguments, before the message's closing events.
    added = [i for i, e in enumerate(events) if e.type == "response.output_item.added"]
    call_added = events[added[1]]
    assert call_added.item.type == "function_call"  # type: ignore[union-attr]
    pieces = [i for i, k in enumerate(kinds) if k == "response.function_call_arguments.delta"]
    assert len(pieces) > 3 and added[1] < pieces[0]
    assert pieces[-1] < kinds.index("response.output_text.done")
    drawn = call_added.item.arguments + "".join(events[i].delta for i in pieces)  # type: ignore[union-attr]
    assert drawn == streamed[0].arguments
    assert kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    # A stream resumed inside the call's pieces goes on with the next one, numbered on.
    middle = numbers[pieces[len(pieces) // 2]]
    resumed = await client.responses.retrieve(final.id, stream=True, starting_after=middle)
    rest = [e async for e in resumed]
    after = [i for i, n in enumerate(numbers) if n > middle]
    assert [e.sequence_number for e in rest] == [numbers[i] for i in after]
    assert [e.type for e in rest] == [kinds[i] for i in after]
    # The SDK's stream helper puts the call together from its pieces.
    async with client.responses.stream(**asked) as helper:
        seen = [e async for e in helper]
        final_output = (await helper.get_final_response()).output
    snapshots = [e.snapshot for e in seen if e.type == "response.function_call_arguments.delta"]
    helper_call = [item for item in final_output if item.type == "function_call"]
    assert len(snapshots) > 3 and snapshots[-1] == helper_call[0].arguments
    with pytest.raises(openai.BadRequestError, match="only function tools"):
        await client.responses.create(**{**asked, "tools": [{"type": "web_search"}]})


async def test_a_call_drawn_over_the_responses_socket_resumes_inside_its_pieces(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    """OpenAI's WebSocket mode (``responses.connect()``): a call held to its tool
    streams as drawn; the socket dropped inside its pieces, a new one resumes
    (``response.resume``) with the next piece, each event once, numbered on."""
    from tests.wsinfer.test_responses_ws import drop, until_end

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    async with client.responses.connect() as conn:
        await conn.response.create(**ASKED_FOR_A_CALL)
        before: list[Any] = []
        async for event in conn:
            before.append(event)
            pieces = [e for e in before if e.type == "response.function_call_arguments.delta"]
            if len(pieces) == 2 or event.type in ("response.completed", "response.incomplete"):
                break
        drop(conn)
    assert before[-1].type == "response.function_call_arguments.delta"  # cut inside them
    rid, last = before[0].response.id, before[-1].sequence_number
    async with client.responses.connect() as conn:
        resume = {"type": "response.resume", "response_id": rid, "starting_after": last}
        await conn.send(resume)  # type: ignore[arg-type]
        after = await until_end(conn)
    got = [*before, *after]
    seen = [e.sequence_number for e in got]
    assert seen == sorted(set(seen)) and after[0].sequence_number > last
    added = next(e for e in got if e.type == "response.output_item.added" and e.output_index == 1)
    drawn = added.item.arguments + "".join(
        e.delta for e in got if e.type == "response.function_call_arguments.delta"
    )
    final = after[-1].response
    assert final.status == "completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert drawn == call.arguments and call.name == "get_weather"


async def test_a_vanished_reader_of_n_choices_leaves_nothing_followed(
    serve: tuple[int, Path],  # noqa: F811
) -> None:
    """A client that drops a stream of n choices mid-way: every choice's follower
    (a peer and a task each) goes with it; the turns run on, unwatched."""
    import asyncio

    import httpx

    from tests.wsinfer.test_http import in_process_frontend, read_until

    def followers() -> list[asyncio.Task[Any]]:
        tasks = asyncio.all_tasks()
        return [t for t in tasks if t.get_coro().__qualname__.endswith(".follow")]  # type: ignore[union-attr]

    frontend = await in_process_frontend(serve)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{frontend.port}", headers=AUTH, timeout=30
        ) as http:
            body = {"model": "wsinfer", "messages": PROMPT, "n": 3, "max_tokens": 4000,
                    "temperature": 0, "stream": True}  # fmt: skip
            response = await http.send(
                http.build_request("POST", "/v1/chat/completions", json=body), stream=True
            )
            await read_until(response, 700)
            assert len(frontend.http.peers) == 3 and len(followers()) == 3
            await response.aclose()
            for _ in range(100):
                if not frontend.http.peers and not frontend.fanin.owners and not followers():
                    break
                await asyncio.sleep(0.05)
            assert not frontend.http.peers and not frontend.fanin.owners and not followers()
            sessions = response.headers["x-wsinfer-session"].split(", ")
            tokens = response.headers["x-wsinfer-token"].split(", ")
            for session, token in zip(sessions, tokens, strict=True):
                await http.post(f"/v1/sessions/{session}/stop", headers={"X-Wsinfer-Token": token})
    finally:
        await frontend.stop()
