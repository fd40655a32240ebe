"""Wire protocol v1: every message type, its validation, and both codecs.

Client messages are parsed into typed dataclasses here and nowhere else;
server messages are built here, as the typed maps of ``wsinfer.contract``
(``ServerMessage``: plain dicts, so the send path converts nothing);
``Codec`` turns maps into frames (JSON text or msgpack binary) and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from wsinfer import tools as tool_calling
from wsinfer.contract import (
    CLIENT_MESSAGES,
    MAX_NAME_CHARS,
    ClientMessageType,
    DeltaMessage,
    DoneMessage,
    ErrorCode,
    ErrorMessage,
    FieldKind,
    MessageSpec,
    PausedMessage,
    ServerMessage,
    ServerMessageType,
    SessionMessage,
    Subprotocol,
    TurnStatus,
)
from wsinfer.errors import BadRequest, TooLarge
from wsinfer.sessions.schema import DoneEvent, GenerationParams, ParamsError

JSON_SUBPROTOCOL = Subprotocol.JSON.value
MSGPACK_SUBPROTOCOL = Subprotocol.MSGPACK.value
SUBPROTOCOLS = (JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL)

ROLES = frozenset({"system", "user", "assistant", "tool"})
# The server echoes a client's id: a long one would be sent back in every answer.
MAX_ID_CHARS = MAX_NAME_CHARS
# A message nests as deep as the JSON Schemas it carries (a tool's parameters, a
# response_format): 32 levels hold any schema a person writes; anything deeper is
# hostile, and is refused before anything recurses on it.
MAX_DEPTH = 32
# Integers travel through msgpack and Redis: 64 bits, like every other client.
MIN_INT, MAX_INT = -(2**63), 2**64 - 1
# Parts of a bad message quoted back in an error are cut to this length.
MAX_ECHO_CHARS = 64
# A generate's idempotency key: client-chosen and random, a secret like a token
# (a repeat with it is answered the session's token), so it must be long enough
# not to be guessed; bounded like every other string the server keeps.
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 128


@dataclass(frozen=True)
class Limits:
    # Per generate, all message contents or the prompt: a cap against abuse only,
    # under the 1 MiB frame. A prompt's real limit is the model's context, in
    # tokens, which the engine checks (a ``done`` with error ``too_large``).
    max_prompt_chars: int = 256_000
    max_messages: int = 256


# --- client -> server ----------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    id: str | int | None
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: GenerationParams
    session: str | None = None
    token: str | None = None
    idempotency_key: str | None = None


@dataclass(frozen=True)
class SessionCommand:
    """A control that names a session and proves ownership (stop, pause, close)."""

    type: ClientMessageType
    id: str | int | None
    session: str
    token: str


@dataclass(frozen=True)
class Resume:
    """A control answered ``session`` that attaches its sender to the turn
    (a resume), replaying the turn's messages after ``after``."""

    id: str | int | None
    session: str
    token: str
    after: int = 0
    turn: int | None = None
    type: ClientMessageType = ClientMessageType.RESUME


ClientMessage = Generate | SessionCommand | Resume


def check_value(data: Any) -> None:
    """Refuse what no message may contain, whatever the field: nesting deeper
    than ``MAX_DEPTH``, strings that are not valid Unicode (lone surrogates
    cannot be stored or echoed), integers beyond 64 bits, and types other than
    null, bool, number, string, list and map (msgpack's bin and ext)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise BadRequest(f"message is nested more than {MAX_DEPTH} deep")
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)
        elif isinstance(value, str):
            if not _is_unicode(value):
                raise BadRequest("strings must be valid Unicode (no lone surrogates)")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not MIN_INT <= value <= MAX_INT:
                raise BadRequest("integers must fit in 64 bits")
        elif value is not None and not isinstance(value, (bool, float)):
            raise BadRequest(f"unsupported value of type {type(value).__name__}")


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _echo(value: Any) -> str:
    """A client's value quoted in an error: short, and always encodable."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


def parse_client_message(data: Any, limits: Limits) -> ClientMessage:
    if not isinstance(data, dict):
        raise BadRequest("a message must be a map")
    check_value(data)
    kind = data.get("type")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise BadRequest(f"unknown message type {_echo(kind)}")
    if "id" in data and message_id(data) is None:
        # Acting on it while dropping the id would leave the client waiting for an answer.
        raise BadRequest(f"id must be an integer or a string of at most {MAX_ID_CHARS} chars")
    return parser(data, limits)


def message_id(data: Any) -> str | int | None:
    """The client's ``id``, if it is a usable one (echoed even on errors)."""
    if isinstance(data, dict):
        value = data.get("id")
        # Only what can be echoed back in any codec: the reply must be encodable.
        if isinstance(value, str) and len(value) <= MAX_ID_CHARS and _is_unicode(value):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and MIN_INT <= value <= MAX_INT:
            return value
    return None


def _check_fields(data: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(_echo(k) for k in data if k not in allowed)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown[:8])}")


def _string(data: dict[str, Any], name: str, max_chars: int | None = None) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    if max_chars is not None and len(value) > max_chars:
        raise BadRequest(f"{name} must be at most {max_chars} characters")
    return value


def _parse_messages(raw: Any, limits: Limits) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise TooLarge(f"at most {limits.max_messages} messages per generate")
    return [_parse_message(item, i) for i, item in enumerate(raw)]


def _parse_message(item: Any, index: int) -> dict[str, Any]:
    """``{role, content}``; an assistant's may carry ``tool_calls`` (its content then
    optional), a tool's result its ``tool_call_id``. Calls are kept structured
    (``tools.checked_calls``): the engine writes them as its model does, through the
    model's chat template or in its format (wsinfer/tool_formats.py)."""
    if not isinstance(item, dict) or "role" not in item:
        raise BadRequest("each message must be {role, content}")
    role = item["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(f"role must be one of {sorted(ROLES)}")
    extra = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}.get(role, set())
    if set(item) - {"role", "content"} - extra:
        raise BadRequest(
            "each message must be {role, content} (tool_calls: assistant only, "
            "tool_call_id: tool only)"
        )
    content = item.get("content")
    calls = None
    if item.get("tool_calls") not in (None, []):  # an empty list is no calls, as OpenAI reads it
        if content is not None and not isinstance(content, str):
            raise BadRequest("content must be a string (or null with tool_calls)")
        try:
            calls = tool_calling.checked_calls(item["tool_calls"], f"messages[{index}]")
        except tool_calling.ToolsError as exc:
            raise BadRequest(str(exc)) from exc
    elif not isinstance(content, str):
        raise BadRequest("content must be a string")
    call_id = item.get("tool_call_id")
    if call_id is not None and (not isinstance(call_id, str) or len(call_id) > MAX_ID_CHARS):
        raise BadRequest(f"tool_call_id must be a string of at most {MAX_ID_CHARS} characters")
    message: dict[str, Any] = {"role": role, "content": content or ""}
    if calls:
        message["tool_calls"] = calls
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _parse_generate(data: dict[str, Any], limits: Limits) -> Generate:
    _check_fields(data, CLIENT_MESSAGES[ClientMessageType.GENERATE].field_names())
    if ("messages" in data) == ("prompt" in data):
        raise BadRequest("generate takes exactly one of messages or prompt")
    messages = _parse_messages(data["messages"], limits) if "messages" in data else None
    prompt = _string(data, "prompt") if "prompt" in data else None
    size = len(prompt) if prompt else sum(len(m["content"]) for m in messages or [])
    if size > limits.max_prompt_chars:
        raise TooLarge(f"prompt is {size} characters; the limit is {limits.max_prompt_chars}")
    if ("session" in data) != ("token" in data):
        raise BadRequest("session and token go together")
    try:
        params = GenerationParams.parse(data.get("params"))
    except ParamsError as exc:
        raise BadRequest(str(exc)) from exc
    if prompt is not None and params.tools is not None:
        raise BadRequest("tools need messages: a raw-text prompt has no chat template to tell them")
    session = _string(data, "session", MAX_ID_CHARS) if "session" in data else None
    token = _string(data, "token", MAX_ID_CHARS) if "token" in data else None
    key = _idempotency_key(data)
    return Generate(message_id(data), messages, prompt, params, session, token, key)


def _idempotency_key(data: dict[str, Any]) -> str | None:
    if "idempotency_key" not in data:
        return None
    key = _string(data, "idempotency_key", MAX_KEY_CHARS)
    if len(key) < MIN_KEY_CHARS:
        raise BadRequest(f"idempotency_key must be {MIN_KEY_CHARS} to {MAX_KEY_CHARS} characters")
    return key


def _parse_declared(data: dict[str, Any], spec: MessageSpec) -> dict[str, Any]:
    """A control's fields as its declaration types them: only those, each checked."""
    _check_fields(data, spec.field_names())
    values: dict[str, Any] = {}
    for declared in spec.fields:
        if declared.name in data or declared.required:
            values[declared.name] = _READERS[declared.kind](data, declared.name)
    return values


def _name(data: dict[str, Any], name: str) -> str:
    return _string(data, name, MAX_ID_CHARS)


def _count(data: dict[str, Any], name: str) -> int:
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer")
    return value


def _ordinal(data: dict[str, Any], name: str) -> int | None:
    value = data[name]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise BadRequest(f"{name} must be a positive integer")
    return value


_READERS: dict[FieldKind, Any] = {
    FieldKind.NAME: _name,
    FieldKind.COUNT: _count,
    FieldKind.ORDINAL: _ordinal,
}


def _parse_control(data: dict[str, Any], _: Limits) -> SessionCommand | Resume:
    kind = ClientMessageType(data["type"])
    spec = CLIENT_MESSAGES[kind]
    values = _parse_declared(data, spec)
    if spec.rejoins:
        return Resume(message_id(data), type=kind, **values)
    return SessionCommand(kind, message_id(data), **values)


_PARSERS: dict[str, Any] = {
    kind.value: _parse_generate if kind is ClientMessageType.GENERATE else _parse_control
    for kind in CLIENT_MESSAGES
}


# --- server -> client ----------------------------------------------------------


def session_message(
    session: str, token: str, turn: int, status: TurnStatus, msg_id: str | int | None
) -> SessionMessage:
    if status is TurnStatus.NEW:  # a session answer names a turn, so it exists
        raise ValueError("a session message needs a turn that exists")
    message: SessionMessage = {
        "type": ServerMessageType.SESSION.value,
        "session": session,
        "token": token,
        "turn": turn,
        "status": status.value,
    }
    if msg_id is not None:
        message["id"] = msg_id
    return message


def delta_message(
    session: str,
    turn: int,
    seq: int,
    text: str,
    logprobs: list[dict[str, Any]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    tool_call_parts: list[dict[str, Any]] | None = None,
) -> DeltaMessage:
    message: DeltaMessage = {
        "type": ServerMessageType.DELTA.value,
        "session": session,
        "turn": turn,
        "seq": seq,
        "text": text,
    }
    if logprobs:
        message["logprobs"] = logprobs
    if tool_calls:
        message["tool_calls"] = tool_calls
    if tool_call_parts:
        message["tool_call_parts"] = tool_call_parts
    return message


def paused_message(session: str, turn: int, seq: int) -> PausedMessage:
    return {"type": ServerMessageType.PAUSED.value, "session": session, "turn": turn, "seq": seq}


def done_message(session: str, turn: int, event: DoneEvent) -> DoneMessage:
    usage = event.usage
    message: DoneMessage = {
        "type": ServerMessageType.DONE.value,
        "session": session,
        "turn": turn,
        "seq": event.seq,
        "finish_reason": event.finish_reason,
        "usage": {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        },
    }
    if event.error:
        message["error"] = event.error.to_dict()
    return message


def error_message(
    code: ErrorCode,
    text: str,
    *,
    msg_id: str | int | None = None,
    session: str | None = None,
    retry_after: float | None = None,
) -> ErrorMessage:
    message: ErrorMessage = {
        "type": ServerMessageType.ERROR.value,
        "code": code.value,
        "message": text,
    }
    if session is not None:
        message["session"] = session
    if retry_after is not None:
        message["retry_after"] = retry_after
    if msg_id is not None:
        message["id"] = msg_id
    return message


# --- codecs --------------------------------------------------------------------------


class Codec(Protocol):
    @property
    def subprotocol(self) -> str: ...

    def encode(self, message: ServerMessage) -> str | bytes: ...

    def decode(self, frame: str | bytes) -> Any: ...


# Built once: ``json.dumps`` with non-default options builds an encoder per call,
# a measurable share of the relay's CPU at one call per delta.
_JSON_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class JsonCodec:
    subprotocol: str = field(default=JSON_SUBPROTOCOL)

    def encode(self, message: ServerMessage) -> str:
        return _JSON_ENCODER.encode(message)

    def decode(self, frame: str | bytes) -> Any:
        if isinstance(frame, bytes):
            raise BadRequest("this connection speaks JSON in text frames")
        try:
            return json.loads(frame)
        except RecursionError as exc:
            raise BadRequest(f"message is nested more than {MAX_DEPTH} deep") from exc
        except ValueError as exc:
            raise BadRequest(f"malformed JSON: {_cut(str(exc))}") from exc


@dataclass(frozen=True)
class MsgpackCodec:
    subprotocol: str = field(default=MSGPACK_SUBPROTOCOL)

    def encode(self, message: ServerMessage) -> bytes:
        return bytes(msgpack.packb(message, use_bin_type=True))

    def decode(self, frame: str | bytes) -> Any:
        if isinstance(frame, str):
            raise BadRequest("this connection speaks msgpack in binary frames")
        try:
            return msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise BadRequest(f"malformed msgpack: {_cut(str(exc))}") from exc


def _cut(text: str) -> str:
    """A library's error text quoted back: short, and free of lone surrogates."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 200 else text[:197] + "..."


def codec_for(subprotocol: str | None) -> Codec:
    """A client that offers no subprotocol gets JSON."""
    return MsgpackCodec() if subprotocol == MSGPACK_SUBPROTOCOL else JsonCodec()
