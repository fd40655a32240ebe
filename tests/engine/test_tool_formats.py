"""Tool calls in the model's own format (wsinfer/tool_formats.py): chosen by the chat
template, read back out of the text however it is cut, written for the templates
that cannot, and enforced in that format when a call is required."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest

from tests.engine.test_tool_calls import ARGS, params, request, run_all, text_of
from wsinfer.engine.core import EngineCore
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.prompts import render_chat
from wsinfer.engine.tool_calls import held_to_its_calls
from wsinfer.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat, format_for_template

# Just enough of each family's template to be told apart (their markers).
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if tools %}Environment: ipython{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"
)
MISTRAL_TEMPLATE = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]"
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})]
NAMES = ["get_weather", "get_time"]


def test_the_template_says_which_format() -> None:
    assert format_for_template(LLAMA_TEMPLATE) is LLAMA3_JSON
    assert format_for_template(MISTRAL_TEMPLATE) is MISTRAL
    assert format_for_template("{{ messages }} <tool_call>") is HERMES
    assert format_for_template(None) is HERMES


def _read(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[tuple[str, Any]]]:
    parser = fmt.parser(NAMES, "c")
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, calls = content + out.content, calls + out.calls
    out = parser.finish()
    content, calls = content + out.content, calls + out.calls
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_calls_written_in_a_format_read_back_whole_however_the_text_is_cut(
    fmt: ToolFormat,
) -> None:
    text = fmt.calls_text(CALLS)
    for cut in range(len(text) + 1):
        for second in (cut, (cut + len(text)) // 2):
            pieces = [text[:cut], text[cut:second], text[second:]]
            content, calls = _read(fmt, pieces)
            assert (content.strip(), calls) == ("", CALLS), (fmt.name, cut, second)


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_a_reply_that_is_not_calls_is_content_as_written(fmt: ToolFormat) -> None:
    for text in (
        "The weather is fine.",
        '{"answer": 42}',  # JSON, but not a call
        fmt.calls_text([("delete_everything", {})]),  # not one of the tools
        fmt.calls_text(CALLS[:1])[:-3],  # cut inside: the model ended it unfinished
    ):
        for cut in range(len(text) + 1):
            assert _read(fmt, [text[:cut], text[cut:]]) == (text, []), (text, cut)


def test_mistrals_lead_may_be_in_the_text_or_left_out_as_a_control_token() -> None:
    bare = MISTRAL.calls_text(CALLS).removeprefix("[TOOL_CALLS]")
    assert _read(MISTRAL, [bare]) == ("", CALLS)
    assert _read(LLAMA3_JSON, [LLAMA3_JSON.calls_text(CALLS[:1])]) == ("", CALLS[:1])


def _with_template(model: LoadedModel, template: str) -> LoadedModel:
    tokenizer = copy.deepcopy(model.tokenizer)
    tokenizer.chat_template = template
    return dataclasses.replace(model, tokenizer=tokenizer)


def test_an_assistants_calls_reach_the_template_that_writes_them_structured(
    tiny: LoadedModel,
) -> None:
    llama = _with_template(tiny, LLAMA_TEMPLATE)
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "noon", "tool_call_id": "c"},
    ]
    text = llama.tokenizer.decode(render_chat(llama.tokenizer, messages, params().tools))
    assert '{"name": "get_time", "parameters": {"tz": "UTC"}}' in text
    # A template that knows no tools (the tiny model's): written in Hermes' text.
    plain = tiny.tokenizer.decode(render_chat(tiny.tokenizer, messages, params().tools))
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in plain


@pytest.mark.parametrize("template", [LLAMA_TEMPLATE, MISTRAL_TEMPLATE], ids=["llama", "mistral"])
def test_a_required_call_is_drawn_in_the_models_format(tiny: LoadedModel, template: str) -> None:
    model = _with_template(tiny, template)
    fmt = format_for_template(template)
    p = params(tool_choice="required", parallel_tool_calls=False)
    core = EngineCore(model)
    ids = model.tokenizer.encode("What is the weather in Paris?")
    for seed in range(8):
        core.add(
            request(f"r{seed}", ids, held_to_its_calls(dataclasses.replace(p, seed=seed), fmt))
        )
    ended = 0
    for rid, outs in run_all(core).items():
        if outs[-1].finish_reason == "length":
            continue  # cut short: a prefix of calls, which the grammar allows
        ended += 1
        content, calls = _read(fmt, [text_of(outs)])
        assert content.strip() == "" and calls, (rid, text_of(outs))
        assert len(calls) == 1 and calls[0][0] in ARGS
    assert ended >= 2
