"""Tool calling, sans I/O: tools and choices checked, calls rendered into the
conversation, and the model's calls read back out of its text however it arrives.

The parser is checked against an independent reference (a regular expression over
the whole text) on thousands of random texts, each fed in random pieces: the
content and calls it hands out never depend on where the text was cut, and it
never hands out text that a later piece turns into a call.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from wsinfer.tools import (
    CLOSE,
    OPEN,
    ToolCallParser,
    ToolsError,
    assistant_text,
    call_format,
    canonical_choice,
    canonical_tools,
    check_choice,
    check_grammar,
    grammar_for,
    openai_choice,
    template_messages,
    tool_names,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tools_json(*tools: dict[str, Any]) -> str:
    text = canonical_tools(list(tools))
    assert text is not None
    return text


# --- checking -----------------------------------------------------------------------


def test_tools_are_kept_canonical_with_their_defaults() -> None:
    text = tools_json(WEATHER, TIME)
    tools = json.loads(text)
    assert tools[0]["function"]["strict"] is False
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert canonical_tools(json.loads(text)) == text  # checking twice changes nothing
    assert canonical_tools([]) is None and canonical_tools(None) is None
    assert tool_names(text) == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ("get_weather", "must be a list"),
        ([{"type": "retrieval"}], '"type": "function"'),
        ([{"type": "function", "function": {"name": "a b"}}], "name must be"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "strict"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], "unknown fields"),
        ([TIME, TIME], "unique"),
        ([TIME] * 65, "at most 64"),
        ([{"type": "function", "function": {"name": "f", "description": "x" * 40_000}}], "longer"),
    ],
)
def test_bad_tools_are_refused_with_a_reason(tools: Any, message: str) -> None:
    with pytest.raises(ToolsError, match=re.escape(message)):
        canonical_tools(tools)


def test_choices_are_checked_against_the_tools() -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    assert canonical_choice("required") == "required"
    assert canonical_choice(named) == "function:get_time"
    assert openai_choice("function:get_time") == named
    tools = tools_json(WEATHER, TIME)
    check_choice(tools, "function:get_time")
    check_choice(None, "auto")
    with pytest.raises(ToolsError, match="needs tools"):
        check_choice(None, "required")
    with pytest.raises(ToolsError, match="not one of the tools"):
        check_choice(tools, "function:get_date")
    for bad in ("always", {"type": "function"}, {"type": "function", "function": {"name": 1}}):
        with pytest.raises(ToolsError, match="tool_choice must be"):
            canonical_choice(bad)


def test_a_required_call_is_a_grammar_and_a_free_one_is_not() -> None:
    tools = tools_json(WEATHER, TIME)
    assert call_format(tools, "auto", True) is None and call_format(tools, None, True) is None
    forced = call_format(tools, "function:get_weather", False)
    assert forced is not None and "get_time" not in forced
    check_grammar(forced)
    assert grammar_for(forced).startswith("start: call\n")
    many = call_format(tools, "required", True)
    assert many is not None and 'start: call ("\\n" call)*' in grammar_for(many)


# --- the conversation ----------------------------------------------------------------


def test_an_assistants_calls_become_the_text_the_model_writes() -> None:
    calls = [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]  # fmt: skip
    text = assistant_text("Let me look.", calls, "messages[1]")
    assert text == (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    # Read back, the same calls (a conversation resent renders what the model wrote).
    parser = ToolCallParser(["get_weather", "get_time"], "call_s_1")
    parsed = parser.feed(text)
    parsed.add(parser.finish())
    assert parsed.content == "Let me look.\n\n"
    assert [c["function"]["name"] for c in parsed.calls] == ["get_weather", "get_time"]
    assert json.loads(parsed.calls[0]["function"]["arguments"]) == {"city": "Paris"}
    with pytest.raises(ToolsError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        assistant_text(None, [{"type": "function", "function": {"name": "f", "arguments": "["}}],
                       "messages[1]")  # fmt: skip


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    tools = tools_json(WEATHER)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "<tool_call>...</tool_call>"},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ]
    out = template_messages(messages, tools, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in out[0]["content"] and "strict" not in out[0]["content"]
    assert out[3]["content"] == (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"
    )
    assert template_messages(messages, tools, native=True) == messages
    alone = template_messages([{"role": "user", "content": "hi"}], tools, native=False)
    assert alone[0]["role"] == "system" and alone[0]["content"].startswith("# Tools")


# --- reading calls back -----------------------------------------------------------------

NAMES = ["get_weather", "get_time"]
FRAGMENTS = [
    "Hello", " ", "\n", "<", "<tool", "_call", ">", "</", "tool_call>", OPEN, CLOSE, "</tool_ca",
    OPEN + "\n", "\n" + CLOSE, '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "get_time", "arguments": {}}', '{"name": "get_date", "arguments": {}}',
    '{"name": "get_time", "arguments": "{}"}', '{"name": "get_time"}', "{", "}", "not json",
]  # fmt: skip


def reference(text: str, names: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    """The whole text split by a regular expression: what any cut must give."""
    content: list[str] = []
    calls: list[tuple[str, Any]] = []
    pos = 0
    pattern = re.compile(
        re.escape(OPEN) + "(.*?)" + re.escape(CLOSE) + "|" + re.escape(OPEN) + "(.*)$", re.S
    )
    for match in pattern.finditer(text):
        content.append(text[pos : match.start()])
        body = match.group(1)
        if body is None:  # cut short: maybe inside the closing tag
            body = re.sub(
                "(" + "|".join(re.escape(CLOSE[:i]) for i in range(len(CLOSE) - 1, 0, -1)) + ")$",
                "",
                match.group(2),
            )
        call = _reference_call(body, names)
        if call is None:
            content.append(match.group(0))
        else:
            calls.append(call)
        pos = match.end()
    content.append(text[pos:])
    return "".join(content), calls


def _reference_call(body: str, names: list[str]) -> tuple[str, Any] | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or sorted(data) != ["arguments", "name"]:
        return None
    arguments = data["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if data["name"] not in names or not isinstance(arguments, dict):
        return None
    return data["name"], arguments


def test_any_cut_of_any_text_gives_the_calls_and_content_of_the_whole() -> None:
    rng = random.Random(20261128)
    for _ in range(3000):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        parser = ToolCallParser(NAMES, "call_s_3")
        content, calls = "", []
        for piece in pieces:
            out = parser.feed(piece)
            content += out.content
            calls += out.calls
            # What is held is only what may still begin a call, or is inside one.
            held = parser.text[parser.done :]
            assert held.startswith(OPEN) or OPEN.startswith(held), (text, pieces)
        final = parser.finish()
        content += final.content
        calls += final.calls
        want_content, want_calls = reference(text, NAMES)
        assert content == want_content, (text, pieces)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert got == want_calls, (text, pieces)
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert [c["id"] for c in calls] == [f"call_s_3_{i}" for i in range(len(calls))]


def test_text_that_may_begin_a_call_is_held_and_released_when_it_does_not() -> None:
    parser = ToolCallParser(NAMES, "c")
    assert parser.feed("It is <tool").content == "It is "
    assert parser.feed("s> here").content == "<tools> here"
    assert parser.feed(OPEN + '\n{"name": "get_time", ').content == ""
    out = parser.feed('"arguments": {}}\n' + CLOSE + " done")
    assert out.content == " done" and out.calls[0]["function"] == {
        "name": "get_time", "arguments": "{}"
    }  # fmt: skip
    # A rebuilt parser, fed what was published in one piece, is where this one is.
    again = ToolCallParser(NAMES, "c")
    again.feed(parser.text)
    assert (again.done, again.count) == (parser.done, parser.count)


def test_a_call_the_turn_ended_inside_counts_if_its_body_is_whole() -> None:
    parser = ToolCallParser(NAMES, "c")
    parser.feed(OPEN + '\n{"name": "get_time", "arguments": {}}\n')
    out = parser.finish()
    assert out.content == "" and len(out.calls) == 1
    cut = ToolCallParser(NAMES, "c")
    cut.feed(OPEN + '\n{"name": "get_time", "argu')
    assert cut.finish().content == OPEN + '\n{"name": "get_time", "argu'
    inside = ToolCallParser(NAMES, "c")  # max_new_tokens ran out inside the closing tag
    inside.feed(OPEN + '\n{"name": "get_time", "arguments": {}}\n</tool_ca')
    assert len(inside.finish().calls) == 1
