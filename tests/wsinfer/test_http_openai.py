"""The OpenAI dialect without sockets: request translation, errors, SSE framing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from wsinfer.errors import EngineUnavailable, Overloaded
from wsinfer.http.completions import parse_completion_request
from wsinfer.http.openai import (
    Completion,
    OpenAIError,
    ignored_headers,
    mark_closed,
    parse_chat_request,
    sse_for,
)
from wsinfer.http.responses import parse_response_request
from wsinfer.messages import Limits

USER = [{"role": "user", "content": "hi"}]


def parse(session: str | None = None, token: str | None = None, **body: Any) -> Any:
    data = {"model": "m", "messages": USER, **body}
    return parse_chat_request(json.dumps(data).encode(), Limits(), "m", session, token)


def test_openai_names_become_generate_params() -> None:
    chat = parse(
        max_tokens=7, temperature=0, top_p=0.5, seed=3, stop="\n", stream=True,
        stream_options={"include_usage": True}, user="x", n=1, presence_penalty=0,
    )  # fmt: skip
    params = chat.generate.params
    assert (params.max_new_tokens, params.temperature, params.top_p) == (7, 0.0, 0.5)
    assert (params.seed, params.stop) == (3, ("\n",))
    assert chat.stream and chat.include_usage
    assert parse(max_completion_tokens=9).generate.params.max_new_tokens == 9
    # vLLM's extensions, which benchmark clients send.
    extended = parse(top_k=5, repetition_penalty=1.2, ignore_eos=True, min_tokens=3).generate
    values = (extended.params.top_k, extended.params.repetition_penalty)
    assert values == (5, 1.2) and extended.params.ignore_eos and extended.params.min_tokens == 3
    with pytest.raises(OpenAIError, match="ignore_eos must be true or false"):
        parse(ignore_eos="yes")
    with pytest.raises(OpenAIError, match="min_tokens must not be above max_tokens"):
        parse(min_tokens=9, max_tokens=8)


def test_messages_text_parts_and_developer_role() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    chat = parse(messages=messages)
    assert chat.generate.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_the_model_may_be_left_out_when_one_is_served() -> None:
    for body in ({}, {"model": None}):  # as vLLM and llama.cpp take it
        raw = json.dumps({"messages": USER, **body}).encode()
        chat = parse_chat_request(raw, Limits(), "m", None, None)
        assert chat.generate.messages == USER


def test_session_headers_continue_a_session() -> None:
    chat = parse(session="s1", token="t1")
    assert (chat.generate.session, chat.generate.token) == ("s1", "t1")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other"}, 404, "model"),
        ({"model": 3}, 400, "model"),
        ({"n": 0}, 400, "n"),
        ({"n": True}, 400, "n"),
        ({"tools": [{"type": "function"}]}, 400, "tools"),
        ({"frobnicate": 1}, 400, "frobnicate"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
        ({"tool_choice": "required"}, 400, "needs tools"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, 400, "tool_calls"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"stream": "yes"}, 400, "stream"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "max_tokens"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format"),
    ],
)
def test_refused_requests(body: dict[str, Any], status: int, param: str | None) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse(**body)
    assert caught.value.status == status
    if param is not None:
        assert caught.value.param == param or param in caught.value.message


def test_a_response_format_reaches_the_turns_params_checked() -> None:
    chat = parse(response_format={"type": "json_object"})
    assert chat.generate.params.response_format == '{"type":"json_object"}'
    assert parse(response_format={"type": "text"}).generate.params.response_format is None


def test_tools_calls_and_results_reach_the_turn_checked() -> None:
    weather = {"type": "function", "function": {"name": "get_weather"}}
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    chat = parse(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        ],
        tools=[weather],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    params = chat.generate.params
    assert params.tools is not None and '"name":"get_weather"' in params.tools
    assert (params.tool_choice, params.parallel_tool_calls) == ("function:get_weather", False)
    # The calls kept structured, for the engine to write as its model does.
    kept = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
    assert chat.generate.messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{**kept, "id": "c"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c"},
    ]


def test_an_empty_tool_calls_list_is_no_calls() -> None:
    said = {"role": "assistant", "content": "Hello.", "tool_calls": []}
    chat = parse(messages=[{"role": "user", "content": "hi"}, said])
    assert chat.generate.messages is not None
    assert chat.generate.messages[1] == {"role": "assistant", "content": "Hello."}


def test_values_are_checked_by_the_websocket_parser() -> None:
    for body in ({"temperature": -1}, {"max_tokens": 0}, {"stop": ["x"] * 9}, {"seed": "a"}):
        with pytest.raises(OpenAIError) as caught:
            parse(**body)
        assert caught.value.status == 400 and caught.value.code == "bad_request"
    with pytest.raises(OpenAIError) as caught:
        parse(messages=[{"role": "user", "content": "x" * 256_001}])  # the abuse cap
    assert caught.value.code == "too_large"


def test_error_shape_status_and_retry_after() -> None:
    busy = OpenAIError.from_wsinfer(Overloaded("busy", retry_after=0.2))
    assert busy.status == 429
    assert busy.headers() == [("Retry-After", "1"), ("retry-after-ms", "200")]
    down = OpenAIError.from_wsinfer(EngineUnavailable("down", retry_after=5.0))
    assert down.status == 503
    assert down.headers() == [("Retry-After", "5"), ("retry-after-ms", "5000")]
    assert set(down.body()["error"]) == {"message", "type", "param", "code"}
    assert down.body()["error"]["type"] == "server_error"


def test_sse_ids_are_seqs_and_the_stream_ends_with_done() -> None:
    completion = Completion("s", 2, "m", 0)
    delta = sse_for(completion, {"type": "delta", "seq": 4, "text": "hé"}, False).decode()
    assert delta.startswith("id: 4\ndata: ") and delta.endswith("\n\n")
    chunk = json.loads(delta.split("data: ", 1)[1])
    assert chunk["id"] == "chatcmpl-s-2" and chunk["choices"][0]["delta"] == {"content": "hé"}
    paused = sse_for(completion, {"type": "paused", "seq": 4}, False)
    assert paused.startswith(b":")  # a comment: invisible to OpenAI parsers
    usage = {"prompt_tokens": 5, "completion_tokens": 4, "cached_tokens": 2}
    done = {"type": "done", "seq": 4, "finish_reason": "stop", "usage": usage}
    events = sse_for(completion, done, True).decode().split("\n\n")
    assert events[0].startswith("id: 4\n")
    assert json.loads(events[1].removeprefix("data: "))["usage"]["total_tokens"] == 9
    assert events[2] == "data: [DONE]"
    failed = {**done, "finish_reason": "error", "error": {"code": "internal", "message": "boom"}}
    first = sse_for(completion, failed, True).decode().split("\n\n")[0]
    assert json.loads(first.removeprefix("data: "))["error"]["message"] == "boom"


def complete(**body: Any) -> Any:
    data = {"model": "m", "prompt": "hi", **body}
    return parse_completion_request(json.dumps(data).encode(), Limits(), "m", None, None)


def respond(**body: Any) -> Any:
    data = {"model": "m", "input": "hi", **body}
    return parse_response_request(json.dumps(data).encode(), Limits(), "m")


def refusal(parse_with: Any, **body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_with(**body)
    assert caught.value.status == 400
    return caught.value


def test_the_old_model_name_and_the_served_one_are_both_answered() -> None:
    for parse_with in (parse, complete, respond):
        for name in ("m", "wsinfer"):
            parse_with(model=name)
        with pytest.raises(OpenAIError) as caught:
            parse_with(model="gpt-4")
        assert (caught.value.status, caught.value.code) == (404, "model_not_found")


def test_the_penalties_and_typical_p_reach_the_turn_on_every_route() -> None:
    body = {"presence_penalty": 1.5, "frequency_penalty": -0.5}
    for parse_with in (parse, complete, respond):
        params = parse_with(**body).generate.params
        assert (params.presence_penalty, params.frequency_penalty) == (1.5, -0.5)
    for parse_with in (parse, complete):  # an extension, as llama.cpp's server takes it
        assert parse_with(typical_p=0.5).generate.params.typical_p == 0.5
    for parse_with in (parse, complete, respond):
        error = refusal(parse_with, presence_penalty=2.5)
        assert error.param == "presence_penalty" and "[-2.0, 2.0]" in error.message


@pytest.mark.parametrize(
    ("parse_with", "body", "param"),
    [
        (parse, {"max_tokens": 0}, "max_tokens"),
        (parse, {"max_completion_tokens": 5000}, "max_completion_tokens"),
        (parse, {"max_completion_tokens": 4, "min_tokens": 9}, "min_tokens"),
        (parse, {"stop": ["x" * 65]}, "stop"),
        (complete, {"max_tokens": 0}, "max_tokens"),
        (complete, {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        (respond, {"max_output_tokens": 0}, "max_output_tokens"),
        (respond, {"top_p": 0}, "top_p"),
        (respond, {"text": {"format": {"type": "yaml"}}}, "text.format"),
        (parse, {"messages": [{"role": "user", "content": "x" * 256_001}]}, "messages"),
        (respond, {"input": "x" * 256_001}, "input"),
        (complete, {"prompt": "x" * 256_001}, "prompt"),
    ],
)
def test_every_error_names_the_field_as_the_client_spelled_it(
    parse_with: Any, body: dict[str, Any], param: str
) -> None:
    error = refusal(parse_with, **body)
    assert error.param == param, error.message
    assert param in error.message
    assert "max_new_tokens" not in error.message and "response_format" not in error.message


def test_a_tool_message_without_its_call_id_is_refused_as_at_openai() -> None:
    said = {"role": "tool", "content": "sunny"}
    error = refusal(parse, messages=[{"role": "user", "content": "hi"}, said])
    assert error.param == "messages[1].tool_call_id"
    assert "Missing required parameter" in error.message


def test_fields_that_change_nothing_are_accepted_and_named_as_ignored() -> None:
    chat = parse(
        store=True, metadata={"a": "b"}, user="u", service_tier="auto", reasoning_effort="low",
        modalities=["text"], prediction={"type": "content", "content": "x"},
    )  # fmt: skip
    assert chat.ignored == (
        "store", "metadata", "user", "service_tier", "reasoning_effort", "prediction"
    )  # fmt: skip
    assert ignored_headers(chat.ignored) == [
        ("X-Wsinfer-Ignored-Fields", "store, metadata, user, service_tier, reasoning_effort, "
         "prediction"),
    ]  # fmt: skip
    assert parse().ignored == () and ignored_headers(()) == []
    assert parse(user=None).ignored == ()  # null: nothing was asked
    assert complete(user="u", store=False).ignored == ("user", "store")
    response = respond(store=False, reasoning={"effort": "low"}, truncation="auto", user="u")
    assert response.ignored == ("store", "reasoning", "truncation", "user")
    # What would change the output is still refused.
    assert refusal(parse, modalities=["text", "audio"]).code == "unsupported"
    assert refusal(respond, reasoning={"effort": "low", "budget": 3}).param == "reasoning"


def test_a_closed_sessions_cancelled_turn_ends_cancelled_a_stopped_ones_stop() -> None:
    completion = Completion("s", 2, "m", 0)
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 0}
    done: Any = {"type": "done", "session": "s", "turn": 2, "seq": 2, "usage": usage}
    stopped = {**done, "finish_reason": "cancelled"}
    closed = {**done, "finish_reason": "cancelled"}
    mark_closed(closed)
    for message, reason in ((stopped, "stop"), (closed, "cancelled")):
        chunk = sse_for(completion, message, False).decode().split("\n")[1][len("data: ") :]
        assert json.loads(chunk)["choices"][0]["finish_reason"] == reason
        assert completion.whole("x", message)["choices"][0]["finish_reason"] == reason
    length = {**done, "finish_reason": "length"}
    mark_closed(length)  # only a cancelled turn ended with its session
    assert completion.whole("x", length)["choices"][0]["finish_reason"] == "length"
