"""The OpenAI chat-completions dialect, sans I/O: requests in, JSON and SSE bytes out.

A request body is translated into the WebSocket protocol's ``generate`` map and
validated by the same parser (``wsinfer.messages``), so both doors accept and
refuse exactly the same turns; only the names and the error shapes differ.
Errors leave as ``OpenAIError``: an HTTP status plus OpenAI's
``{"error": {"message", "type", "param", "code"}}`` body.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, cast

from wsinfer.access import shorten
from wsinfer.contract import (
    DeltaMessage,
    DoneMessage,
    ErrorCode,
    ErrorMessage,
    ServerMessage,
    UsageFields,
)
from wsinfer.errors import BadRequest, WsinferError
from wsinfer.messages import MAX_DEPTH, Generate, Limits, check_value, parse_client_message
from wsinfer.sessions.schema import GenerationParams, ParamsError
from wsinfer.tools import CallStream

OBJECT_CHUNK = "chat.completion.chunk"
# The headers that name an answer's session(s), token(s) and turn(s).
SESSION_HEADER = "X-Wsinfer-Session"
TOKEN_HEADER = "X-Wsinfer-Token"
TURN_HEADER = "X-Wsinfer-Turn"
# The request's fields that were accepted and ignored (they change nothing we produce).
IGNORED_HEADER = "X-Wsinfer-Ignored-Fields"
# The model id clients were given before the served model's own name: still answered.
LEGACY_MODEL_NAME = "wsinfer"

# Protocol error code -> HTTP status; the OpenAI SDKs pick their exception by status.
STATUS_BY_CODE = {
    "bad_request": 400,
    "too_large": 400,  # too much content is OpenAI's 400 (context too long), not 413
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "conflict": 409,
    "overloaded": 429,
    "internal": 500,
    "engine_unavailable": 503,
}

# Accepted and ignored: they change nothing about the tokens we produce (storage,
# billing and abuse tracking; a reasoning effort, which no template here is given;
# a prediction, which OpenAI uses only to answer sooner, never otherwise).
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "reasoning_effort",
        "prediction",
    }
)
# Accepted only at the value that means "feature off".
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "modalities": (None, ["text"]),  # text is all we write
    "functions": (None, []),  # the deprecated form of tools
    "function_call": (None, "none"),
}
# OpenAI name -> wsinfer params name; top_k, repetition_penalty, ignore_eos and
# min_tokens are extensions (as in vLLM, whose benchmark clients send ignore_eos).
PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "typical_p": "typical_p",  # an extension, as llama.cpp's server takes it
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
    "logprobs": "logprobs",
    "top_logprobs": "top_logprobs",
    "response_format": "response_format",  # checked by wsinfer/response_format.py
    "tools": "tools",  # these three by wsinfer/tools.py
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
}
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


class OpenAIError(Exception):
    """A refused request, as OpenAI reports it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        # Messages and params quote client input (a 300 kB field name): cut short.
        message, param = _cut(message, 500), None if param is None else _cut(param, 100)
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.extra = headers or []

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def headers(self) -> list[tuple[str, str]]:
        if self.retry_after is None and self.status not in (429, 503):
            return list(self.extra)
        # Retry-After takes whole seconds; never tell a client to retry at once. The
        # OpenAI SDKs read retry-after-ms first: the exact wait, so that clients told
        # different times within a second do not all come back on the second.
        after = self.retry_after or 1.0
        exact = [("retry-after-ms", str(math.ceil(after * 1000)))]
        return [("Retry-After", str(max(1, math.ceil(after)))), *exact, *self.extra]

    @classmethod
    def from_wsinfer(cls, exc: WsinferError) -> OpenAIError:
        status = STATUS_BY_CODE.get(exc.code, 500)
        code = "invalid_api_key" if exc.code == ErrorCode.UNAUTHORIZED else exc.code.value
        return cls(status, exc.message, code=code, retry_after=exc.retry_after)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bad_request(message: str, param: str | None = None, code: str = "bad_request") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


# n: the most choices one request may ask for (each is a session and a batch row).
MAX_CHOICES = 8


@dataclass(frozen=True)
class ChatRequest:
    generate: Generate
    stream: bool
    include_usage: bool
    n: int = 1
    ignored: tuple[str, ...] = ()  # the fields accepted and ignored, in the body's order


def parse_chat_request(
    body: bytes, limits: Limits, model: str, session: str | None, token: str | None
) -> ChatRequest:
    """Validate a ``POST /v1/chat/completions`` body as a ``generate`` of ``session``."""
    data = json_object(body)
    _check_fields(data)
    check_model(data, model)
    stream = flag(data, "stream")
    include_usage = stream_options(data.get("stream_options"), stream)
    generate: dict[str, Any] = {
        "type": "generate",
        "messages": _messages(data.get("messages")),
        "params": params_of(data),
    }
    chat = as_generate(generate, limits, session, token, client_names(data))
    return ChatRequest(chat, stream, include_usage, choices(data), ignored_fields(data, IGNORED))


def client_names(data: dict[str, Any]) -> dict[str, str]:
    """Our params' names as this request spelled them (for its errors): the token
    limit is ``max_tokens`` or ``max_completion_tokens``, whichever it sent."""
    limit = "max_completion_tokens" if data.get("max_completion_tokens") is not None else None
    return {"max_new_tokens": limit or "max_tokens", "prompt": "messages"}


def ignored_fields(data: dict[str, Any], ignored: frozenset[str]) -> tuple[str, ...]:
    """The ``ignored`` fields the body holds (with a value), in its order."""
    return tuple(name for name in data if name in ignored and data[name] is not None)


def ignored_headers(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """``X-Wsinfer-Ignored-Fields`` naming them (none without any)."""
    return [(IGNORED_HEADER, ", ".join(names))] if names else []


def choices(data: dict[str, Any]) -> int:
    """``n``: how many choices, each a session of its own (1 to ``MAX_CHOICES``)."""
    n = data.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be an integer in [1, {MAX_CHOICES}]", "n")
    return n


def check_model(data: dict[str, Any], model: str) -> None:
    """``model`` names the one model served, or is left out (as vLLM and
    llama.cpp allow: there is no other to mean)."""
    if data.get("model") is None:
        return
    if not isinstance(data["model"], str):
        raise bad_request("model must be a string, the name of the model served", "model")
    if data["model"] not in (model, LEGACY_MODEL_NAME):
        raise OpenAIError(
            404, f"The model {shorten(data['model'], 64)!r} does not exist; "
            f"this server serves {model!r}",
            code="model_not_found", param="model",
        )  # fmt: skip


def as_generate(
    generate: dict[str, Any],
    limits: Limits,
    session: str | None,
    token: str | None,
    names: dict[str, str] | None = None,
) -> Generate:
    """A ``generate`` map checked by the WebSocket door's own parser; a refused param
    is named as the client spelled it (``names``: ours -> theirs, where they differ)."""
    if session is not None or token is not None:
        generate.update(session=session, token=token)
    try:
        GenerationParams.parse(generate.get("params"))
    except ParamsError as exc:
        raise params_error(str(exc), names or {}) from exc
    try:
        parsed = parse_client_message(generate, limits)
    except WsinferError as exc:
        raise in_client_names(OpenAIError.from_wsinfer(exc), names or {}) from exc
    assert isinstance(parsed, Generate)
    return parsed


def params_error(message: str, names: dict[str, str]) -> OpenAIError:
    """A refused param's 400, in the client's names: ``param`` is the first one named."""
    return in_client_names(bad_request(message), names)


def in_client_names(error: OpenAIError, names: dict[str, str]) -> OpenAIError:
    """``error`` with our fields' names (``names``: ours -> the client's) replaced, and,
    where it names none, ``param`` the first field its message names."""
    message = error.message
    for ours, theirs in names.items():
        message = re.sub(rf"\b{re.escape(ours)}\b", theirs, message)
    fields = [*GenerationParams.__dataclass_fields__, "prompt"]
    spelled = [names.get(name, name) for name in fields]
    found = [(m.start(), name) for name in spelled if (m := _word(name).search(message))]
    param = error.param or (min(found)[1] if found else None)
    return OpenAIError(
        error.status, message, code=error.code, param=param, retry_after=error.retry_after
    )


def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w])")


def json_object(body: bytes) -> dict[str, Any]:
    """The body as the WebSocket door reads a frame: the same depth, Unicode and
    integer rules, so nothing it holds can fail later (say, in an error's echo)."""
    try:
        data = json.loads(body)
        check_value(data)
    except RecursionError as exc:
        raise bad_request(f"the body is nested more than {MAX_DEPTH} deep") from exc
    except BadRequest as exc:
        raise bad_request(exc.message) from exc
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {shorten(str(exc), 200)}") from exc
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    return data


def _check_fields(data: dict[str, Any]) -> None:
    known = {"model", "messages", "stream", "stream_options", "max_tokens", "n"}
    known |= {"max_completion_tokens"} | set(PARAMS)
    check_fields(data, known, OFF_VALUES, IGNORED)


def check_fields(
    data: dict[str, Any],
    known: set[str],
    off_values: dict[str, tuple[Any, ...]],
    ignored: frozenset[str],
) -> None:
    """Every field known, ignored, or at the value that turns its feature off."""
    for name in data:
        if name in off_values:
            if data[name] not in off_values[name]:
                value = shorten(repr(data[name]), 64)
                raise bad_request(f"{name}={value} is not supported", name, "unsupported")
        elif name not in known and name not in ignored:
            quoted = shorten(name, 64)
            raise bad_request(f"Unrecognized request argument supplied: {quoted}", quoted)


def flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean", name)
    return bool(value)


def stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request("stream_options takes only include_usage", "stream_options")
    return flag(options, "include_usage")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    return [_message(item, i) for i, item in enumerate(raw)]


def _message(item: Any, index: int) -> dict[str, Any]:
    """A message as the WebSocket door takes it: its role mapped, its content parts
    joined; an assistant's ``tool_calls`` and a tool's ``tool_call_id`` go with it."""
    param = f"messages[{index}]"
    allowed = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
    if not isinstance(item, dict) or set(item) - allowed:
        raise bad_request(f"{param} must be {{role, content}} (name allowed)", param)
    raw_role = item.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise bad_request(f"{param}.role must be one of {sorted(_ROLES)}", f"{param}.role")
    message: dict[str, Any] = {"role": role}
    if item.get("tool_calls"):  # the content may then be null; [] is no calls
        message["tool_calls"] = item["tool_calls"]
        if item.get("content") is not None:
            message["content"] = _content(item["content"], f"{param}.content")
    else:
        message["content"] = _content(item.get("content"), f"{param}.content")
    if item.get("tool_call_id") is not None:
        message["tool_call_id"] = item["tool_call_id"]
    elif role == "tool":  # OpenAI's rule (the WebSocket protocol does without the id)
        missing = f"{param}.tool_call_id"
        raise bad_request(f"Missing required parameter: '{missing}'.", missing)
    return message


def _content(content: Any, param: str) -> str:
    """A string, or text parts joined (images and audio are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def params_of(data: dict[str, Any]) -> dict[str, Any]:
    params = {PARAMS[k]: v for k, v in data.items() if k in PARAMS and v is not None}
    limit = data.get("max_completion_tokens")
    if limit is None:
        limit = data.get("max_tokens")
    elif data.get("max_tokens") not in (None, limit):
        raise bad_request("max_tokens and max_completion_tokens disagree", "max_tokens")
    if limit is not None:
        params["max_new_tokens"] = limit
    return params


# --- responses --------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """Names shared by every chunk of one turn (a resumed stream reuses them)."""

    session: str
    turn: int
    model: str
    created: int
    # With n > 1 each choice is a turn of its own session: its index, and the id of
    # the whole completion (its first choice's).
    index: int = 0
    shared_id: str | None = None

    @property
    def id(self) -> str:
        return f"chatcmpl-{self.session}-{self.turn}"

    def opening(self) -> dict[str, Any] | None:
        """The stream's first chunk, before any text: the assistant's role."""
        return self.chunk({"role": "assistant", "content": ""})

    def chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        reason = None if finish_reason is None else openai_finish_reason(finish_reason)
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": reason,
        }
        return self._envelope(OBJECT_CHUNK, choices=[choice])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk's ``usage`` (already in OpenAI's shape)."""
        return self._envelope(OBJECT_CHUNK, choices=[], usage=usage)

    def whole(
        self,
        text: str,
        done: DoneMessage,
        logprobs: list[dict[str, Any]] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:  # OpenAI's calls carry no index in a whole message
            message["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in tool_calls
            ]
            message["content"] = text or None
        choice = {
            "index": self.index,
            "message": message,
            "logprobs": chat_logprobs(logprobs),
            "finish_reason": openai_finish_reason(finish_reason_of(done)),
        }
        return self._envelope(
            "chat.completion", choices=[choice], usage=openai_usage(done["usage"])
        )

    def _envelope(self, kind: str, **fields: Any) -> dict[str, Any]:
        head = {"id": self.shared_id or self.id, "object": kind, "created": self.created}
        head["model"] = self.model
        return {**head, "system_fingerprint": None, **fields}


def turn_headers(completions: list[Completion]) -> list[tuple[str, str]]:
    """The session and turn of each choice (one, unless ``n`` > 1), in choice order."""
    sessions = ", ".join(c.session for c in completions)
    return [(SESSION_HEADER, sessions), (TURN_HEADER, ", ".join(str(c.turn) for c in completions))]


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs``: the deltas' entries (already in OpenAI's shape)."""
    return None if entries is None else {"content": entries, "refusal": None}


def openai_finish_reason(reason: str) -> str:
    """A turn's finish reason as OpenAI clients know them: a turn a client stopped
    (wsinfer's ``cancelled``) ended its text there, which OpenAI calls ``stop``; one
    whose session was deleted under it (``CLOSED``) is ``cancelled``, as the
    protocol's followers of a closed session are told."""
    return {"cancelled": "stop", CLOSED: "cancelled"}.get(reason, reason)


# The reason of a turn that ended because its session was closed (DELETE), which the
# protocol's ``done`` tells apart from a stop only by the session being gone: the HTTP
# peer marks such a done (``mark_closed``) when it reads it.
CLOSED = "closed"


def mark_closed(done: DoneMessage) -> None:
    cast(dict[str, Any], done)[CLOSED] = True


def finish_reason_of(done: DoneMessage) -> str:
    """A done's finish reason, ``CLOSED`` for a cancelled one the peer marked closed."""
    closed = cast(dict[str, Any], done).get(CLOSED) and done["finish_reason"] == "cancelled"
    return CLOSED if closed else done["finish_reason"]


def openai_usage(usage: UsageFields) -> dict[str, Any]:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
    }


def turn_error(done: DoneMessage) -> OpenAIError:
    """A turn that ended with ``finish_reason: error``, by the code the engine chose:
    a prompt longer than the model's context is the client's (400 ``too_large``,
    as OpenAI's and vLLM's 400), not ours (a 500, which the OpenAI SDK retries)."""
    error = done.get("error")
    code = str(error["code"]) if error else "internal"
    message = str(error["message"]) if error else "the turn failed"
    param = "messages" if code == ErrorCode.TOO_LARGE else None
    return OpenAIError(STATUS_BY_CODE.get(code, 500), message, code=code, param=param)


def sse(data: dict[str, Any] | str, event_id: int | None = None) -> bytes:
    """One Server-Sent Event; ``id`` is what ``Last-Event-ID`` sends back on reconnect."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


def sse_comment(text: str) -> bytes:
    """An SSE comment: one line, with no blank line after it. A blank line ends an
    event, and once a stream has carried an ``id`` the official OpenAI SDK reads a blank
    line that ends no data as an event of empty data, which it fails to parse (a stream
    waiting 15 s for a token, or paused, broke). Every SSE reader skips a comment line
    between events."""
    return f": {text}\n".encode()


SSE_KEEPALIVE = sse_comment("keep-alive")


def sse_for(completion: Completion, message: ServerMessage, include_usage: bool) -> bytes:
    """The SSE bytes for one outgoing protocol message of a turn; b"" for none.

    A delta's event id is its ``seq``, so ``Last-Event-ID`` is exactly the
    WebSocket ``resume``'s ``after``. A pause is a comment: the stream stays
    open and goes on when the turn is resumed. The end is ``data: [DONE]``.
    """
    if message["type"] == "delta":
        return sse(delta_chunk(completion, message), message["seq"])
    if message["type"] == "paused":
        return sse_comment(f"paused at seq {message['seq']}")
    if message["type"] == "error":
        error = OpenAIError.from_wsinfer(_as_wsinfer(message))
        return sse(error.body()) + SSE_DONE
    if message["type"] != "done":
        return b""
    if message["finish_reason"] == "error":
        return sse(turn_error(message).body()) + SSE_DONE
    out = sse(completion.chunk({}, finish_reason_of(message)), message["seq"])
    if include_usage:
        out += sse(completion.usage_chunk(openai_usage(message["usage"])))
    return out + SSE_DONE


def delta_chunk(completion: Completion, message: DeltaMessage) -> dict[str, Any]:
    """The chunk of a protocol ``delta``: its text, calls and log-probabilities."""
    delta: dict[str, Any] = {"content": message["text"]}
    calls = delta_tool_calls(message)
    if calls:
        delta = {"content": message["text"] or None, "tool_calls": calls}
    return completion.chunk(delta, logprobs=message.get("logprobs"))


def delta_tool_calls(message: DeltaMessage) -> list[dict[str, Any]]:
    """A delta's ``delta.tool_calls`` as OpenAI streams them: the parts of calls drawn
    (a call's first with its ``id``, ``type`` and name; later ones its arguments' next
    piece), then each call completed here that came in no part, whole."""
    parts = message.get("tool_call_parts", [])
    out = [_chat_part(p) for p in parts if CallStream.shows(p)]
    drawn = {p["index"] for p in parts}
    return out + [c for c in message.get("tool_calls", ()) if c["index"] not in drawn]


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    if "type" in part:
        return part
    return {"index": part["index"], "function": {"arguments": part["function"]["arguments"]}}


def failure(message: ServerMessage) -> OpenAIError | None:
    """The error a protocol message ends a stream with (a refusal, a failed turn)."""
    if message["type"] == "error":
        return OpenAIError.from_wsinfer(_as_wsinfer(message))
    if message["type"] == "done" and message["finish_reason"] == "error":
        return turn_error(message)
    return None


def combined_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of n choices (OpenAI's shape): the prompt once, every completion."""
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    total = first["prompt_tokens"] + completion
    return {**first, "completion_tokens": completion, "total_tokens": total}


def _as_wsinfer(message: ErrorMessage) -> WsinferError:
    error = WsinferError(str(message["message"]), retry_after=message.get("retry_after"))
    error.code = ErrorCode(message["code"])
    return error
