"""OpenAI's Responses API dialect, sans I/O: ids, requests, response objects, events.

A response is one turn of a wsinfer session, with the turn's state, token log
and guarantees; ``previous_response_id`` adds the next turn to the session
(its KV cache kept where the engine still has it). Nothing is kept beyond
what Redis holds for the session, so any frontend answers for any response:

- **Ids.** ``resp_{session}_{turn}_{token}``: the turn, and the session's
  token that proves the right to it, as ``X-Wsinfer-Token`` does. A response
  id is a secret, like the token it carries; the frontend never logs it.
  ``msg_{session}_{turn}`` names the response's one output message.
- **Sequence numbers** are the turn's ``seq``, shifted: the four opening
  events are 0 to 3, a text delta whose WebSocket ``seq`` is ``s`` is
  ``3 + s``, and the four closing events follow the ``done``'s ``seq`` ``S``
  as ``3 + S + 1`` to ``3 + S + 4``. A stream resumed ``starting_after=N`` on
  any frontend is the turn resumed ``after = N - 3``: nothing lost, nothing
  repeated, whichever way the deltas were merged for each reader.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from wsinfer.access import shorten
from wsinfer.contract import DoneMessage, ErrorCode, UsageFields
from wsinfer.http.openai import (
    IGNORED,
    OpenAIError,
    as_generate,
    bad_request,
    check_fields,
    check_model,
    flag,
    ignored_fields,
    json_object,
)
from wsinfer.messages import Generate, Limits
from wsinfer.response_format import responses_format
from wsinfer.sessions.schema import GenerationParams
from wsinfer.tools import CallStream, tool_list

PREFIX = "resp_"
HEAD = 3  # the opening events are numbered 0..HEAD; a delta at seq s is HEAD + s
MAX_ID_PART = 256  # a session id or token longer than this is none we issued

_KNOWN = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
    "stream", "background", "previous_response_id", "metadata", "include", "top_logprobs",
    "text", "tools", "tool_choice", "parallel_tool_calls", "presence_penalty",
    "frequency_penalty",
}  # fmt: skip
# What ``include`` may ask for: the output text's log-probabilities.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# ``reasoning``: its effort and summary are for reasoning models, which none served here
# is (no template is told of them; a summary of no reasoning is none).
_IGNORED = IGNORED | {"truncation", "stream_options", "reasoning"}
# What the client's names for our params are, in its errors.
_NAMES = {
    "max_new_tokens": "max_output_tokens",
    "response_format": "text.format",
    "prompt": "input",
}
# Accepted only at the value that means "feature off".
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "max_tool_calls": (None,),
    "conversation": (None,),
    "prompt": (None,),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
# A turn's status (sessions.states) as a response's, while it has not ended.
_LIVE_STATUS = {"queued": "queued", "running": "in_progress", "paused": "in_progress"}


def not_found() -> OpenAIError:
    # The id is not quoted: it holds the session's token.
    return OpenAIError(404, "No response found with that id", code="not_found")


@dataclass(frozen=True)
class ResponseId:
    session: str
    turn: int
    token: str

    def __str__(self) -> str:
        return f"{PREFIX}{self.session}_{self.turn}_{self.token}"

    @property
    def item_id(self) -> str:
        return f"msg_{self.session}_{self.turn}"

    @property
    def previous(self) -> ResponseId | None:
        return ResponseId(self.session, self.turn - 1, self.token) if self.turn > 1 else None

    @classmethod
    def parse(cls, text: str) -> ResponseId:
        """A response id we issued, or 404 (an id we could not have issued names nothing)."""
        parts = text.removeprefix(PREFIX).split("_", 2) if text.startswith(PREFIX) else []
        if len(parts) != 3:
            raise not_found()
        session, turn, token = parts
        good_turn = turn.isascii() and turn.isdigit() and len(turn) <= 18 and int(turn) > 0
        if not (session.isascii() and session.isalnum() and good_turn and token):
            raise not_found()
        if len(session) > MAX_ID_PART or len(token) > MAX_ID_PART:
            raise not_found()
        return cls(session, int(turn), token)


@dataclass(frozen=True)
class ResponseRequest:
    generate: Generate
    stream: bool
    background: bool
    previous: ResponseId | None
    instructions: str | None
    metadata: dict[str, str]
    ignored: tuple[str, ...] = ()  # the fields accepted and ignored, in the body's order


def parse_response_request(body: bytes, limits: Limits, model: str) -> ResponseRequest:
    """Validate a ``POST /v1/responses`` body as a ``generate`` (of the previous
    response's session, with ``previous_response_id``)."""
    return response_request(json_object(body), limits, model)


def response_request(data: dict[str, Any], limits: Limits, model: str) -> ResponseRequest:
    """A create's fields (a body, or a WebSocket ``response.create`` without its
    envelope), checked alike on both doors."""
    check_fields(data, _KNOWN, _OFF_VALUES, _IGNORED)
    _reasoning(data.get("reasoning"))
    check_model(data, model)
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _input(data.get("input"))
    previous = _previous(data.get("previous_response_id"))
    generate = as_generate(
        {"type": "generate", "messages": messages, "params": _params(data)},
        limits,
        previous.session if previous else None,
        previous.token if previous else None,
        _NAMES,
    )
    return ResponseRequest(
        generate,
        flag(data, "stream"),
        flag(data, "background"),
        previous,
        instructions,
        _metadata(data.get("metadata")),
        ignored_fields(data, _IGNORED - {"metadata"}),  # metadata is echoed: not ignored
    )


def _reasoning(raw: Any) -> None:
    """``reasoning``: OpenAI's shape, ``{effort?, summary?}`` (ignored: see _IGNORED)."""
    if raw is None:
        return
    keys = {"effort", "summary", "generate_summary"}
    if not isinstance(raw, dict) or set(raw) - keys:
        raise bad_request("reasoning takes only effort and summary", "reasoning")
    if not all(value is None or isinstance(value, str) for value in raw.values()):
        raise bad_request("reasoning's effort and summary are strings", "reasoning")


def _params(data: dict[str, Any]) -> dict[str, Any]:
    names = {
        "max_output_tokens": "max_new_tokens",
        "temperature": "temperature",
        "top_p": "top_p",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
    }
    params = {ours: data[theirs] for theirs, ours in names.items() if data.get(theirs) is not None}
    top = data.get("top_logprobs")
    if _include(data.get("include")) or top:
        params["logprobs"] = True  # checked, with top_logprobs, by the protocol's rules
    if top is not None:
        params["top_logprobs"] = top
    fmt = _text_format(data.get("text"))
    if fmt is not None:
        params["response_format"] = fmt
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        params["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}  # the chat shape
    if choice is not None:
        params["tool_choice"] = choice
    if data.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = data["parallel_tool_calls"]
    return params


def _chat_tool(raw: Any, index: int) -> dict[str, Any]:
    """A Responses function tool (flat: ``{type, name, parameters, ...}``) in the chat
    shape, checked with the WebSocket's params (wsinfer/tools.py). Only functions:
    wsinfer runs no tool of its own (web or file search, a computer)."""
    param = f"tools[{index}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise bad_request(f"{param}: only function tools are supported", param, "unsupported")
    function = {k: v for k, v in raw.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def responses_tools(params: GenerationParams) -> tuple[list[dict[str, Any]], Any]:
    """A turn's tools and tool choice as a response object shows them (flat)."""
    tools = [{"type": "function", **t["function"]} for t in tool_list(params.tools)]
    choice: Any = params.tool_choice or "auto"
    if choice.startswith("function:"):
        choice = {"type": "function", "name": choice[len("function:") :]}
    return tools, choice


def _text_format(raw: Any) -> dict[str, Any] | None:
    """``text.format`` in the chat completions' ``response_format`` shape (checked, as
    the WebSocket's, by wsinfer/response_format.py)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or any(key != "format" for key in raw):
        raise bad_request("text may only hold format", "text")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt


def _include(raw: Any) -> bool:
    """Whether ``include`` asks for the output's log-probabilities (nothing else is kept)."""
    if raw is None or raw == []:
        return False
    if not isinstance(raw, list) or any(item != INCLUDE_LOGPROBS for item in raw):
        message = f"include may only hold {INCLUDE_LOGPROBS!r} here"
        raise bad_request(message, "include", "unsupported")
    return True


def _previous(raw: Any) -> ResponseId | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise bad_request("previous_response_id must be a string", "previous_response_id")
    try:
        return ResponseId.parse(raw)
    except OpenAIError:
        message = "No previous response found with that id"
        raise OpenAIError(404, message, code="not_found", param="previous_response_id") from None


def _metadata(raw: Any) -> dict[str, str]:
    """Echoed in the answers to this request (wsinfer keeps no metadata)."""
    if raw is None:
        return {}
    if (
        not isinstance(raw, dict)
        or len(raw) > 16
        or not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in raw.items())
    ):
        raise bad_request("metadata takes at most 16 string pairs", "metadata")
    return dict(raw)


def _input(raw: Any) -> list[dict[str, Any]]:
    """The input's messages, as the WebSocket's: a ``function_call`` item is a call
    of the assistant message before it (or of one of its own), a
    ``function_call_output`` a ``tool`` message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of messages", "input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(raw):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            call = _call(item, index)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_call_output(item, index))
        else:
            messages.append(_item(item, index))
    return messages


def _call(item: dict[str, Any], index: int) -> dict[str, Any]:
    call_id = _call_id(item, {"name", "arguments"}, f"input[{index}]")
    function = {"name": item.get("name"), "arguments": item.get("arguments")}
    return {"id": call_id, "type": "function", "function": function}  # checked as the chat's


def _call_output(item: dict[str, Any], index: int) -> dict[str, Any]:
    call_id = _call_id(item, {"output"}, f"input[{index}]")
    output = _text(item.get("output"), f"input[{index}].output")
    return {"role": "tool", "content": output, "tool_call_id": call_id}


def _call_id(item: dict[str, Any], own: set[str], param: str) -> str:
    """The ``call_id`` of a call item or of its output, whose other fields are ``own``
    (and ``type``, ``id``, ``status``, which every item may carry)."""
    unknown = sorted(str(k) for k in item if k not in {"type", "call_id", "id", "status", *own})
    if unknown:
        raise bad_request(f"unknown fields in {param}: {', '.join(unknown)}", param)
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{param}.call_id must be a string", f"{param}.call_id")
    return call_id


def _item(item: Any, index: int) -> dict[str, Any]:
    param = f"input[{index}]"
    allowed = {"type", "role", "content", "id", "status"}
    if (
        not isinstance(item, dict)
        or item.get("type", "message") != "message"
        or set(item) - allowed
    ):
        message = f"{param} must be a message {{role, content}}, a function_call or its output"
        raise bad_request(message, param, "unsupported")
    raw_role = item.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise bad_request(f"{param}.role must be one of {sorted(_ROLES)}", f"{param}.role")
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _text(content: Any, param: str) -> str:
    """A string, or text parts joined (images, files and audio are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = [p for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
        texts = [p.get("text") for p in parts]
        if len(parts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


# --- response objects -------------------------------------------------------------------


def live_status(turn_status: str) -> str:
    return _LIVE_STATUS.get(turn_status, "in_progress")


def outcome(done: DoneMessage) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """A ``done``'s finish reason as a response's ``status``, ``incomplete_details``
    and ``error``. A turn a client stopped is ``cancelled``, as OpenAI's are."""
    reason = done["finish_reason"]
    if reason in ("stop", "tool_calls"):  # OpenAI's response that called is completed
        return "completed", None, None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason == "cancelled":
        return "cancelled", None, None
    error = done.get("error")
    too_large = error is not None and error["code"] == ErrorCode.TOO_LARGE.value
    code = "invalid_prompt" if too_large else "server_error"
    text = str(error["message"]) if error else "the turn failed"
    return "failed", None, {"code": code, "message": text}


def response_usage(usage: UsageFields) -> dict[str, Any]:
    prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "input_tokens": prompt,
        # cache_write_tokens: a field the SDK's types require; wsinfer counts no writes.
        "input_tokens_details": {"cached_tokens": usage["cached_tokens"], "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


@dataclass(frozen=True)
class ResponseView:
    """What every answer about one response shares (a resumed stream reuses it)."""

    rid: ResponseId
    model: str
    created_at: int
    params: GenerationParams
    instructions: str | None = None
    background: bool | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def body(
        self,
        status: str,
        text: str | None,
        done: DoneMessage | None = None,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The response object: ``text`` None before the output message exists;
        ``logprobs`` its tokens' entries (for a response that asked); ``calls`` the
        function calls the model made, output items after the message."""
        incomplete = error = usage = None
        if done is not None:
            status, incomplete, error = outcome(done)
            usage = response_usage(done["usage"])
        previous = self.rid.previous
        output = [] if text is None else [self.item(status, text, logprobs)]
        output += [self.call_item(call) for call in calls or ()]
        tools, tool_choice = responses_tools(self.params)
        return {
            "id": str(self.rid),
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.instructions,
            "max_output_tokens": self.params.max_new_tokens,
            "metadata": self.metadata,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.params.parallel_tool_calls,
            "previous_response_id": None if previous is None else str(previous),
            "temperature": self.params.temperature,
            "text": {"format": responses_format(self.params.response_format)},
            "tool_choice": tool_choice,
            "tools": tools,
            "top_logprobs": self.params.top_logprobs,
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage,
        }

    def item(
        self, status: str, text: str | None, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The output message; an item is only ever in progress, completed or incomplete."""
        item_status = status if status in ("in_progress", "completed") else "incomplete"
        if status == "queued":
            item_status = "in_progress"
        content = [] if text is None else [_part(text, logprobs)]
        return {
            "id": self.rid.item_id,
            "type": "message",
            "role": "assistant",
            "status": item_status,
            "content": content,
        }

    def call_item_id(self, index: int) -> str:
        return f"fc_{self.rid.session}_{self.rid.turn}_{index}"

    def call_item(self, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        """A call as a ``function_call`` output item (``call_id``: the call's id, which
        its ``function_call_output`` names)."""
        function = call["function"]
        arguments = function["arguments"] if status == "completed" else ""
        return {
            "id": self.call_item_id(call["index"]),
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": function["name"],
            "arguments": arguments,
        }


def _part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def payload(kind: str, number: int, **fields: Any) -> dict[str, Any]:
    """One Responses stream event, whichever door carries it."""
    return {"type": kind, "sequence_number": number, **fields}


def sse_event(data: dict[str, Any]) -> bytes:
    """An event as OpenAI's SSE stream sends it (``event:`` named), ``id`` its number."""
    kind, number = data["type"], data["sequence_number"]
    text = json.dumps(data, ensure_ascii=False)
    return f"id: {number}\nevent: {kind}\ndata: {text}\n\n".encode()


def sse_events(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse_event(data) for data in events)


def event(kind: str, number: int, **fields: Any) -> bytes:
    """One SSE event, ``id`` its sequence number."""
    return sse_event(payload(kind, number, **fields))


@dataclass
class Output:
    """What a turn's deltas (or the first ones) hold: text, logprobs entries, calls,
    and the calls whose events were streamed as they were drawn (``shown_part``)."""

    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    streamed: set[int] = field(default_factory=set)


def shown_part(text: str, parts: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The part of a call a delta's one event shows (a stream's events are numbered by
    the turn's ``seq``, one number a delta): none beside text, else its first call's
    part that starts the call or has arguments. A delta is a token, and no token holds
    text and a call's arguments, or two calls' (the name of a call comes between), so
    nothing is left out; were one to, the call's closing events carry it whole."""
    if text:
        return None
    return next((part for part in parts or () if CallStream.shows(part)), None)


def streamed_calls(deltas: list[tuple[str, list[dict[str, Any]] | None]]) -> set[int]:
    """The calls whose start a stream's events showed, of ``(text, parts)`` deltas."""
    shown = (shown_part(text, parts) for text, parts in deltas)
    return {part["index"] for part in shown if part is not None and "type" in part}


class ResponseEvents:
    """The events of one response for a reader that has those up to ``after``
    (-1: none): numbered from the turn's ``seq`` (see the module's docstring).

    The one builder of both doors: ``*_events`` give the events as objects (a
    WebSocket sends each as a frame), ``opening``/``delta``/``closing`` the same
    as SSE bytes."""

    def __init__(self, view: ResponseView, after: int) -> None:
        self.view = view
        self.after = after
        self.text: list[str] = []  # the text streamed to this reader
        self.logprobs: list[dict[str, Any]] = []  # and its tokens' entries
        self.calls: list[dict[str, Any]] = []  # and the calls the model made
        self.streamed: set[int] = set()  # and the calls whose start it was shown
        # What the reader had before this stream (a resume's): read once needed.
        self.before: Output | None = Output() if self.seq_after == 0 else None
        self.last = after  # the last sequence number this reader has

    @property
    def seq_after(self) -> int:
        """The ``after`` of the turn's resume that gives this reader its deltas."""
        return max(0, self.after - HEAD)

    def opening(self, status: str) -> bytes:
        return sse_events(self.opening_events(status))

    def delta(
        self,
        seq: int,
        text: str,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
        parts: list[dict[str, Any]] | None = None,
    ) -> bytes:
        return sse_events(self.delta_events(seq, text, logprobs, calls, parts))

    def closing(self, done: DoneMessage, before: Output) -> bytes:
        return sse_events(self.closing_events(done, before))

    def opening_events(self, status: str) -> list[dict[str, Any]]:
        view, where = self.view, {"output_index": 0}
        item = {"item_id": view.rid.item_id, **where, "content_index": 0}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"response": view.body(status, None)}),
            ("response.in_progress", {"response": view.body("in_progress", None)}),
            ("response.output_item.added", {**where, "item": view.item("in_progress", None)}),
            ("response.content_part.added", {**item, "part": _part("")}),
        ]
        return self._numbered(0, events)

    def delta_events(
        self,
        seq: int,
        text: str,
        logprobs: list[dict[str, Any]] | None = None,
        calls: list[dict[str, Any]] | None = None,
        parts: list[dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """A delta's one event: its text, or the part of a call drawn (``shown_part``):
        the call's output item added, then its arguments' deltas. A call drawn whole
        comes as an output item after the message, with the closing events; a delta
        with nothing to show has no event (``before``: needed with parts)."""
        number = HEAD + seq
        if number <= self.after:  # the resume's replay starts after it: never the case
            return []
        self.text.append(text)
        self.logprobs += logprobs or ()
        self.calls += calls or ()
        if text:
            self.last = number
            item = {"item_id": self.view.rid.item_id, "output_index": 0, "content_index": 0}
            fields = {**item, "delta": text, "logprobs": logprobs or []}
            return [payload("response.output_text.delta", number, **fields)]
        part = shown_part(text, parts)
        if part is None:
            return []
        index, piece = part["index"], part["function"]["arguments"]
        started = "type" in part
        if started:
            self.streamed.add(index)
        elif index not in self.streamed | self._before().streamed:
            return []
        self.last = number
        where = {"output_index": 1 + index}
        if started:
            call = {"index": index, "id": part["id"], "function": part["function"]}
            item = {**self.view.call_item(call, "in_progress"), "arguments": piece}
            return [payload("response.output_item.added", number, **where, item=item)]
        item_id = self.view.call_item_id(index)
        fields = {"item_id": item_id, **where, "delta": piece}
        return [payload("response.function_call_arguments.delta", number, **fields)]

    def _before(self) -> Output:
        assert self.before is not None, "a resumed stream with parts reads its before first"
        return self.before

    def closing_events(self, done: DoneMessage, before: Output) -> list[dict[str, Any]]:
        """The events after the ``done``: the message's three, four per function call
        (added, its arguments' delta and done, done), the response's last. ``before``:
        what this reader had before its stream started (the resume's ``after``)."""
        view, text = self.view, before.text + "".join(self.text)
        lps, calls = before.logprobs + self.logprobs, before.calls + self.calls
        streamed = before.streamed | self.streamed
        status = outcome(done)[0]
        item = {"item_id": view.rid.item_id, "output_index": 0, "content_index": 0}
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.output_text.done", {**item, "text": text, "logprobs": lps}),
            ("response.content_part.done", {**item, "part": _part(text, lps)}),
            (
                "response.output_item.done",
                {"output_index": 0, "item": view.item(status, text, lps)},
            ),
        ]
        for index, call in enumerate(calls, 1):
            whole = view.call_item(call)
            at = {"item_id": whole["id"], "output_index": index}
            if call["index"] not in streamed:  # drawn whole: added, and its arguments
                events += [
                    (
                        "response.output_item.added",
                        {"output_index": index, "item": view.call_item(call, "in_progress")},
                    ),
                    ("response.function_call_arguments.delta", {**at, "delta": whole["arguments"]}),
                ]
            events += [
                ("response.function_call_arguments.done", {**at, "arguments": whole["arguments"]}),
                ("response.output_item.done", {"output_index": index, "item": whole}),
            ]
        final = view.body(status, text, done, lps, calls)
        events.append((f"response.{status}", {"response": final}))
        return self._numbered(HEAD + done["seq"] + 1, events)

    def error_event(self, code: str, message: str) -> dict[str, Any]:
        """A follow that failed (a refusal): OpenAI's stream ``error``, which ends it."""
        return payload("error", self.last + 1, code=code, message=message, param=None)

    def _numbered(
        self, first: int, events: list[tuple[str, dict[str, Any]]]
    ) -> list[dict[str, Any]]:
        out = []
        for number, (kind, fields) in enumerate(events, first):
            if number > self.after:
                out.append(payload(kind, number, **fields))
                self.last = number
        return out


_RESPONSE_IN_PATH = re.compile(r"(/v1/responses/)[^/?#]+")
_SECRET_IN_QUERY = re.compile(r"([?&](?:token|session_token)=)[^&#]*")


def loggable(target: str) -> str:
    """A request target fit for a log line: a response id carries its session's
    token, and ``?token=``/``?session_token=`` are secrets too."""
    target = _RESPONSE_IN_PATH.sub(r"\1resp_[redacted]", target)
    return shorten(_SECRET_IN_QUERY.sub(r"\1[redacted]", target))
