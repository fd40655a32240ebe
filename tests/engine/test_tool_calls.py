"""Tool calling in the engine: tools told to the model, a required call held to its
tools' schemas while sampling, and calls split out of what is published.

A random-weight model writes gibberish; with a tool_choice that requires a call,
every turn that ends by itself must be calls of the allowed tools whose arguments
validate, whatever the seed. The real SmolLM2 test checks a real answer.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import jsonschema
import pytest

from tests.engine.conftest import run_all, text_of
from tests.engine.test_core import request
from wsinfer.engine.core import EngineCore
from wsinfer.engine.lifecycle import RequestOutput
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.process import _delta, _final_event
from wsinfer.engine.prompts import knows_tools, render_chat
from wsinfer.engine.requests import SequenceStatus, ToolCalls
from wsinfer.engine.tool_calls import held_to_its_calls, split_calls
from wsinfer.sessions.schema import (
    DeltaEvent,
    DoneEvent,
    GenerationParams,
    ParamsError,
    Usage,
    decode_event,
    encode,
)
from wsinfer.tools import CLOSE, OPEN, ToolCallParser, tool_names

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "description": "Now, in UTC"}},
]
ARGS = {"get_weather": WEATHER_ARGS, "get_time": {"type": "object", "properties": {}}}


def params(**kw: Any) -> GenerationParams:
    raw = {"max_new_tokens": 120, "temperature": 1.0, "tools": TOOLS}
    return GenerationParams.parse({**raw, **kw})


def calls_of(text: str, p: GenerationParams) -> tuple[str, list[dict[str, Any]]]:
    parser = ToolCallParser(tool_names(p.tools), "c")
    parsed = parser.feed(text)
    parsed.add(parser.finish())
    return parsed.content, parsed.calls


# --- telling the model ---------------------------------------------------------------


def test_a_template_without_tools_is_told_of_them_in_a_system_message(tiny: LoadedModel) -> None:
    tokenizer = tiny.tokenizer
    assert not knows_tools(tokenizer)  # SmolLM2's template ignores tools
    p = params()
    messages = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "sunny"}]
    text = tokenizer.decode(render_chat(tokenizer, messages, p.tools))
    assert "# Tools" in text and '"name": "get_weather"' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert "# Tools" not in tokenizer.decode(render_chat(tokenizer, messages))


def test_a_template_that_knows_tools_renders_them_itself(tiny: LoadedModel) -> None:
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    assert knows_tools(tokenizer)
    messages = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "sunny"}]
    text = tokenizer.decode(render_chat(tokenizer, messages, params().tools))
    assert text.startswith("TOOLS get_weather get_time")
    assert "[tool] sunny" in text and "# Tools" not in text


def test_a_template_that_refuses_tools_is_told_of_them_as_one_that_ignores_them(
    tiny: LoadedModel,
) -> None:
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    assert not knows_tools(tokenizer)
    text = tokenizer.decode(
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], params().tools)
    )
    assert text.startswith("[system] # Tools")


# --- a required call, enforced ----------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", True),
        ("required", False),
        ({"type": "function", "function": {"name": "get_weather"}}, True),
    ],
)
def test_a_required_call_is_always_calls_of_the_tools_with_valid_arguments(
    tiny: LoadedModel, choice: Any, parallel: bool
) -> None:
    p = params(tool_choice=choice, parallel_tool_calls=parallel)
    core = EngineCore(tiny)
    ids = tiny.tokenizer.encode("What is the weather in Paris?")
    for seed in range(8):
        core.add(request(f"r{seed}", ids, held_to_its_calls(dataclasses.replace(p, seed=seed))))
    ended = 0
    for rid, outs in run_all(core).items():
        if outs[-1].finish_reason == "length":
            continue  # cut short: a prefix of calls, which the grammar allows
        ended += 1
        content, calls = calls_of(text_of(outs), p)
        assert content.strip() == "" and calls, (rid, text_of(outs))
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            name = call["function"]["name"]
            assert name in (["get_weather"] if isinstance(choice, dict) else ARGS)
            jsonschema.validate(json.loads(call["function"]["arguments"]), ARGS[name])
    assert ended >= 2  # not all cut short: the check above ran


def test_a_required_call_excludes_a_response_format_and_min_tokens() -> None:
    with pytest.raises(ParamsError, match="excludes a response_format"):
        params(tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ParamsError, match="min_tokens"):
        params(tool_choice="required", min_tokens=2)
    free = params(tool_choice="auto", response_format={"type": "json_object"})
    assert free.tool_format is None  # the model is free to answer in JSON instead
    assert GenerationParams.from_dict(free.to_dict()) == free
    assert "tools" not in GenerationParams().to_dict()  # a rolling upgrade
    assert "parallel_tool_calls" not in GenerationParams().to_dict()


def test_a_single_free_call_ends_the_turn_at_its_closing_tag() -> None:
    p = params(parallel_tool_calls=False)
    assert held_to_its_calls(p).stop == (CLOSE,)
    assert held_to_its_calls(params()).stop == ()
    assert held_to_its_calls(params(tool_choice="required")).response_format is not None


# --- what is published -----------------------------------------------------------------


def turn_with_tools() -> ToolCallParser:
    return ToolCallParser(["get_time"], "call_s_1")


def output(text: str, n: int, tokens: list[int], finished: bool = False) -> RequestOutput:
    reason = "stop" if finished else None
    status = SequenceStatus.FINISHED if finished else SequenceStatus.RUNNING
    return RequestOutput("s:1", tokens, text, n, status, reason, usage=Usage(10, n))


def test_published_deltas_carry_content_and_calls_and_the_model_text() -> None:
    turn = turn_with_tools()
    first = _delta(split_calls(turn, output("Let me check. <tool", 3, [1, 2, 3])), [1, 2, 3], None)
    assert (first.text, first.raw, first.tool_calls) == (
        "Let me check. ",
        "Let me check. <tool",
        None,
    )
    body = '_call>\n{"name": "get_time", "arguments": {}}\n' + CLOSE
    second = _delta(split_calls(turn, output(body, 5, [4, 5])), [4, 5], None)
    assert second.text == "" and second.raw == body and second.tool_calls is not None
    assert second.tool_calls[0]["id"] == "call_s_1_0"
    assert first.model_text + second.model_text == "Let me check. " + OPEN + body[len("_call>") :]
    for event in (first, second):  # raw and calls cross Redis
        assert decode_event(encode(event)) == event
    plain = DeltaEvent(6, "x", [6])
    assert b"raw" not in encode(plain)["m"] and b"tool_calls" not in encode(plain)["m"]
    done = _final_event(split_calls(turn, output("", 6, [0], finished=True)))
    assert isinstance(done, DoneEvent) and done.finish_reason == "tool_calls"


def test_what_may_begin_a_call_is_released_by_the_turns_last_token_only() -> None:
    turn = turn_with_tools()
    assert _delta(split_calls(turn, output("a <", 1, [1])), [1], None).text == "a "
    last = _delta(split_calls(turn, output("", 2, [2], finished=True)), [2], None)
    assert last.text == "<"  # the end-of-sequence token's delta releases it
    stopped = turn_with_tools()
    _delta(split_calls(stopped, output("a <", 1, [1])), [1], None)
    # A stop has no token of its own, so no delta: the held text is not the turn's.
    cancelled = _final_event(RequestOutput("s:1", [], "", 1, SequenceStatus.FINISHED, "cancelled"))
    assert isinstance(cancelled, DoneEvent) and cancelled.finish_reason == "cancelled"


def test_the_core_splits_the_calls_of_a_turn_that_asks_as_the_model_wrote_them(
    tiny: LoadedModel,
) -> None:
    p = params(tool_choice="required")
    core = EngineCore(tiny)
    ids = tiny.tokenizer.encode("What is the weather in Paris?")
    for seed in range(4):
        ask = ToolCalls(f"call_s_{seed}")
        core.add(request(f"r{seed}", ids, dataclasses.replace(p, seed=seed), tool_calls=ask))
    ended = 0
    for rid, outs in run_all(core).items():
        wrote = "".join(o.text if o.raw is None else o.raw for o in outs)
        # Held to its calls, the turn hands each call's arguments out as drawn.
        parser = ToolCallParser(tool_names(p.tools), f"call_s_{rid[1:]}", streams=True)
        parsed = parser.feed(wrote)
        parsed.add(parser.finish())  # a turn cut short by length included
        if outs[-1].finish_reason != "length":
            assert outs[-1].finish_reason == "tool_calls"  # a required call was made
            ended += 1
        assert text_of(outs) == parsed.content
        calls = [c for o in outs for c in o.tool_calls or []]
        assert calls == parsed.calls
        drawn: dict[int, str] = {}
        for part in (part for o in outs for part in o.tool_call_parts or []):
            drawn[part["index"]] = drawn.get(part["index"], "") + part["function"]["arguments"]
        assert {i: drawn[i] for i in range(len(calls))} == {
            c["index"]: c["function"]["arguments"] for c in calls
        }
        assert len(drawn) - len(calls) in (0, 1)  # the call cut short, as far as it went
    assert ended >= 1  # not all cut short: the reason was checked


# --- the real model ---------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_calls_the_weather_tool_for_the_city_asked_about(smol: LoadedModel) -> None:
    p = params(tool_choice="required", temperature=0, max_new_tokens=60)
    messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    ids = render_chat(smol.tokenizer, messages, p.tools)
    core = EngineCore(smol)
    core.add(request("r", ids, held_to_its_calls(p)))
    outs = run_all(core)["r"]
    _, calls = calls_of(text_of(outs), p)
    assert calls[0]["function"]["name"] == "get_weather", text_of(outs)
    assert json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"


@pytest.mark.parametrize("released", [False, True])
def test_a_continued_turn_does_not_hand_out_again_what_its_end_let_out_as_text(
    released: bool,
) -> None:
    """A free turn cut by length inside what began as a call let that text out as
    text when it ended; continued, its parser starts from there (``released``), so
    the call's rest is text too, not a call that repeats it. A turn rebuilt after a
    takeover (not released) still holds what may begin a call."""
    from wsinfer.engine.requests import EngineRequest
    from wsinfer.engine.tool_calls import call_parser
    from wsinfer.tool_formats import HERMES

    text = f'{OPEN}\n{{"name": "get_time", "arguments": {{}}}}\n{CLOSE}'
    cut = text.index('"get_time"')
    ask = ToolCalls("call_s_1", text[:cut])
    rebuilt = EngineRequest("s:1", [1], params(), released=released, tool_calls=ask)
    parser = call_parser(rebuilt, HERMES)
    assert parser is not None
    rest = parser.feed(text[cut:])
    rest.add(parser.finish())
    if released:
        assert (rest.content, rest.calls) == (text[cut:], [])
    else:
        assert rest.content == "" and [c["function"]["name"] for c in rest.calls] == ["get_time"]
