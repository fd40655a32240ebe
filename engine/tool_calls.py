"""A turn's tool calls, as the output processor handles them: the params that hold
sampling to the calls, and each output's text split into content and completed
calls (in the format the model's chat template teaches, ``wsinfer/tool_formats.py``).
"""

from __future__ import annotations

import dataclasses

from wsinfer.sessions.schema import GenerationParams
from wsinfer.tool_formats import HERMES, CallParser, ToolFormat
from wsinfer.tools import tool_names

from .requests import EngineRequest, RequestOutput


def held_to_its_calls(params: GenerationParams, fmt: ToolFormat = HERMES) -> GenerationParams:
    """A turn's params as the core runs them: a choice that requires a call is a
    grammar; a single call, unless required, ends the turn at its closing tag (in a
    format that has one: the others end with the model's end token)."""
    forced = params.tool_format
    if forced is not None:
        return dataclasses.replace(params, response_format=forced)
    if not params.parallel_tool_calls and fmt.stop is not None:
        return dataclasses.replace(params, stop=(*params.stop, fmt.stop))
    return params


def with_tools(request: EngineRequest, fmt: ToolFormat) -> EngineRequest:
    """``request`` as the core runs it: held to its calls, where it asked for them split."""
    if request.tool_calls is None:
        return request
    return dataclasses.replace(request, params=held_to_its_calls(request.params, fmt))


def call_parser(request: EngineRequest, fmt: ToolFormat) -> CallParser | None:
    """The parser of a request that asked for its calls, past the text already out."""
    ask = request.tool_calls
    if ask is None:
        return None
    # Held to its calls by a grammar, a turn's calls cannot turn out to be text: their
    # arguments are handed out as drawn.
    streams = request.params.tool_format is not None
    parser = fmt.parser(tool_names(request.params.tools), ask.call_id_prefix, streams)
    parser.feed(ask.published)
    if request.released:  # it ended once (by length), and what it held then went out
        parser.finish()
    return parser


def split_calls(parser: CallParser, out: RequestOutput) -> RequestOutput:
    """``out``, the next output of ``parser``'s turn, with its text split into content,
    completed calls and the parts of calls drawn (in place). What may begin a call
    stays held until a later output, or the turn's last one that has text or a token
    (a stopped turn's last output has neither, and so no delta of its own to carry it)."""
    if out.new_token_ids or out.text:
        parsed = parser.feed(out.text)
        if out.finished:
            parsed.add(parser.finish())
        if parsed.content != out.text:
            out.raw = out.text
        out.text, out.tool_calls = parsed.content, parsed.calls or None
        out.tool_call_parts = parsed.parts or None
    # It ended by itself after calling: OpenAI's reason.
    if out.finished and (out.finish_reason or "stop") == "stop" and parser.count:
        out.finish_reason = "tool_calls"
    return out
