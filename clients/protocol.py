"""Sans-I/O pieces of the client: request builders and per-turn state.

Nothing here awaits or touches a socket, so the exactly-once logic (dedup by
``seq``) is testable with plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from wsinfer.clients.errors import WsinferError, error_from_wire

Message = dict[str, Any]
ChatMessage = Mapping[str, str]
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_wire(cls, raw: Any) -> Usage:
        if not isinstance(raw, Mapping):
            return cls()
        return cls(
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            cached_tokens=int(raw.get("cached_tokens") or 0),
        )


# --- requests ---------------------------------------------------------------


def generate_request(
    *,
    messages: Sequence[ChatMessage] | None = None,
    prompt: str | None = None,
    params: Mapping[str, Any] | None = None,
    session: str | None = None,
    token: str | None = None,
) -> Message:
    """A ``generate`` message; exactly one of ``messages`` and ``prompt``."""
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= and prompt=")
    if (session is None) != (token is None):
        raise ValueError("session and token go together")
    msg: Message = {"type": "generate"}
    if messages is not None:
        msg["messages"] = [dict(m) for m in messages]
    else:
        msg["prompt"] = prompt
    if params:
        msg["params"] = dict(params)
    if session is not None:
        msg["session"] = session
        msg["token"] = token
    return msg


def control_request(kind: str, session: str, token: str, **extra: Any) -> Message:
    """``stop``, ``pause``, ``resume`` or ``close`` for a session."""
    return {"type": kind, "session": session, "token": token, **extra}


# --- per-turn state ---------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str
    seq: int


@dataclass(frozen=True)
class PausedEvent:
    seq: int


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: str
    usage: Usage
    error: WsinferError | None


TurnEvent = TextDelta | PausedEvent | DoneEvent


@dataclass
class TurnState:
    """What the client knows of one turn: text applied so far and how it ended.

    ``seq`` is the last seq applied; the server's ``seq`` counts tokens, so a
    delta with ``seq <= self.seq`` was already applied (a replay after a
    resume) and is dropped. That is the whole exactly-once rule.
    """

    session: str
    token: str
    turn: int
    seq: int = 0
    parts: list[str] = field(default_factory=list)
    paused: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    error: WsinferError | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def apply(self, msg: Mapping[str, Any]) -> TurnEvent | None:
        """Apply one ``delta``/``paused``/``done``; None when it changes nothing."""
        if self.turn < 0 and "turn" in msg:
            self.turn = int(msg["turn"])  # joined without knowing the turn: adopt it
        if self.done or msg.get("turn", self.turn) != self.turn:
            return None
        kind = msg.get("type")
        if kind == "delta":
            return self._apply_delta(msg)
        if kind == "paused":
            self.paused = True
            return PausedEvent(int(msg.get("seq", self.seq)))
        if kind == "done":
            return self._apply_done(msg)
        return None

    def _apply_delta(self, msg: Mapping[str, Any]) -> TextDelta | None:
        seq = int(msg["seq"])
        if seq <= self.seq:
            return None
        self.seq = seq
        self.paused = False
        text = str(msg.get("text") or "")
        self.parts.append(text)
        return TextDelta(text, seq)

    def _apply_done(self, msg: Mapping[str, Any]) -> DoneEvent:
        self.finish_reason = str(msg.get("finish_reason") or "stop")
        self.usage = Usage.from_wire(msg.get("usage"))
        self.paused = False
        raw_error = msg.get("error")
        if self.finish_reason == "error" or raw_error:
            self.error = error_from_wire(
                raw_error if isinstance(raw_error, Mapping) else {}, self.session
            )
        return DoneEvent(self.finish_reason, self.usage, self.error)
