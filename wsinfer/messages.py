"""Wire protocol v1: every message type, its validation, and both codecs.

Client messages are parsed into typed dataclasses here and nowhere else;
server messages are built here as plain maps; ``Codec`` turns maps into
frames (JSON text or msgpack binary) and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from wsinfer.errors import BadRequest, TooLarge
from wsinfer.sessions.schema import DoneEvent, GenerationParams, ParamsError, Usage

JSON_SUBPROTOCOL = "wsinfer.v1.json"
MSGPACK_SUBPROTOCOL = "wsinfer.v1.msgpack"
SUBPROTOCOLS = (JSON_SUBPROTOCOL, MSGPACK_SUBPROTOCOL)

ROLES = frozenset({"system", "user", "assistant"})
# The server echoes a client's id: a long one would be sent back in every answer.
MAX_ID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 32_000  # per generate: all message contents or the prompt
    max_messages: int = 256


# --- client -> server ----------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    id: str | int | None
    messages: list[dict[str, str]] | None
    prompt: str | None
    params: GenerationParams
    session: str | None = None
    token: str | None = None


@dataclass(frozen=True)
class SessionCommand:
    """stop, pause, close: they name a session and prove ownership."""

    type: str
    id: str | int | None
    session: str
    token: str


@dataclass(frozen=True)
class Resume:
    id: str | int | None
    session: str
    token: str
    after: int = 0
    turn: int | None = None


ClientMessage = Generate | SessionCommand | Resume


def parse_client_message(data: Any, limits: Limits) -> ClientMessage:
    if not isinstance(data, dict):
        raise BadRequest("a message must be a map")
    kind = data.get("type")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parser is None:
        raise BadRequest(f"unknown message type {kind!r}")
    if "id" in data and message_id(data) is None:
        # Acting on it while dropping the id would leave the client waiting for an answer.
        raise BadRequest(f"id must be an integer or a string of at most {MAX_ID_CHARS} chars")
    return parser(data, limits)


def message_id(data: Any) -> str | int | None:
    """The client's ``id``, if it is a usable one (echoed even on errors)."""
    if isinstance(data, dict):
        value = data.get("id")
        if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_fields(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(str(k) for k in data if k not in allowed)
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}")


def _string(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _parse_messages(raw: Any, limits: Limits) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise TooLarge(f"at most {limits.max_messages} messages per generate")
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            raise BadRequest("each message must be {role, content}")
        if item["role"] not in ROLES or not isinstance(item["content"], str):
            raise BadRequest(f"role must be one of {sorted(ROLES)} and content a string")
        out.append({"role": item["role"], "content": item["content"]})
    return out


def _parse_generate(data: dict[str, Any], limits: Limits) -> Generate:
    _check_fields(data, {"type", "id", "messages", "prompt", "session", "token", "params"})
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
    session = _string(data, "session") if "session" in data else None
    token = _string(data, "token") if "token" in data else None
    return Generate(message_id(data), messages, prompt, params, session, token)


def _parse_command(data: dict[str, Any], _: Limits) -> SessionCommand:
    _check_fields(data, {"type", "id", "session", "token"})
    return SessionCommand(
        data["type"], message_id(data), _string(data, "session"), _string(data, "token")
    )


def _parse_resume(data: dict[str, Any], _: Limits) -> Resume:
    _check_fields(data, {"type", "id", "session", "token", "after", "turn"})
    after, turn = data.get("after", 0), data.get("turn")
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise BadRequest("after must be a non-negative integer")
    if turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or turn < 1):
        raise BadRequest("turn must be a positive integer")
    return Resume(message_id(data), _string(data, "session"), _string(data, "token"), after, turn)


_PARSERS: dict[str, Any] = {
    "generate": _parse_generate,
    "stop": _parse_command,
    "pause": _parse_command,
    "close": _parse_command,
    "resume": _parse_resume,
}


# --- server -> client ----------------------------------------------------------


def with_id(message: dict[str, Any], msg_id: str | int | None) -> dict[str, Any]:
    if msg_id is not None:
        message["id"] = msg_id
    return message


def session_message(
    session: str, token: str, turn: int, msg_id: str | int | None
) -> dict[str, Any]:
    return with_id({"type": "session", "session": session, "token": token, "turn": turn}, msg_id)


def delta_message(session: str, turn: int, seq: int, text: str) -> dict[str, Any]:
    return {"type": "delta", "session": session, "turn": turn, "seq": seq, "text": text}


def paused_message(session: str, turn: int, seq: int) -> dict[str, Any]:
    return {"type": "paused", "session": session, "turn": turn, "seq": seq}


def done_message(session: str, turn: int, event: DoneEvent) -> dict[str, Any]:
    usage: Usage = event.usage
    message: dict[str, Any] = {
        "type": "done",
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
        message["error"] = dict(event.error)
    return message


def error_message(
    code: str,
    text: str,
    *,
    msg_id: str | int | None = None,
    session: str | None = None,
    retry_after: float | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"type": "error", "code": code, "message": text}
    if session is not None:
        message["session"] = session
    if retry_after is not None:
        message["retry_after"] = retry_after
    return with_id(message, msg_id)


# --- codecs --------------------------------------------------------------------------


class Codec(Protocol):
    @property
    def subprotocol(self) -> str: ...

    def encode(self, message: dict[str, Any]) -> str | bytes: ...

    def decode(self, frame: str | bytes) -> Any: ...


@dataclass(frozen=True)
class JsonCodec:
    subprotocol: str = field(default=JSON_SUBPROTOCOL)

    def encode(self, message: dict[str, Any]) -> str:
        return json.dumps(message, ensure_ascii=False, separators=(",", ":"))

    def decode(self, frame: str | bytes) -> Any:
        if isinstance(frame, bytes):
            raise BadRequest("this connection speaks JSON in text frames")
        try:
            return json.loads(frame)
        except ValueError as exc:
            raise BadRequest(f"malformed JSON: {exc}") from exc


@dataclass(frozen=True)
class MsgpackCodec:
    subprotocol: str = field(default=MSGPACK_SUBPROTOCOL)

    def encode(self, message: dict[str, Any]) -> bytes:
        return bytes(msgpack.packb(message, use_bin_type=True))

    def decode(self, frame: str | bytes) -> Any:
        if isinstance(frame, str):
            raise BadRequest("this connection speaks msgpack in binary frames")
        try:
            return msgpack.unpackb(frame, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise BadRequest(f"malformed msgpack: {exc}") from exc


def codec_for(subprotocol: str | None) -> Codec:
    """A client that offers no subprotocol gets JSON."""
    return MsgpackCodec() if subprotocol == MSGPACK_SUBPROTOCOL else JsonCodec()
