"""The client's sans-I/O core: requests, per-turn state, and ``ClientProtocol``.

``ClientProtocol`` owns every decision of the client side of protocol v1: the
table of requests waiting for an answer, routing answers by ``id`` and turn
events by ``session``, and what a fresh connection must carry after a drop
(unanswered generates again, with the same idempotency key; stop, resume and
pause of live turns). Nothing here awaits or touches a socket: the asyncio
client feeds it messages and connection changes and sends what it returns,
so the whole policy is testable with plain dicts. What the server sends is
checked once, on the way in (``parse_server_message``), against the contract's
typed maps; past that, the core reads fields without converting or guessing.
The browser client (browser/wsinfer.js) follows the same rules.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wsinfer.clients.errors import ClientClosed, ConnectionLost, WsinferError, error_from_wire
from wsinfer.contract import (
    CLIENT_MESSAGES,
    CONTROL_ANSWERS,
    IDEMPOTENCY_KEY_HEX,
    ClientMessageType,
    DeltaMessage,
    DoneMessage,
    ErrorCode,
    ErrorMessage,
    ServerMessage,
    ServerMessageType,
    SessionMessage,
    TurnMessage,
    TurnStatus,
    Usage,
)

Message = dict[str, Any]
# {role, content}; an assistant's may carry tool_calls, a tool's its tool_call_id.
ChatMessage = Mapping[str, Any]


def usage_from_wire(raw: Any) -> Usage:
    """A ``done``'s ``usage``, absent counts read as 0."""
    if not isinstance(raw, Mapping):
        return Usage()
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(raw.get("cached_tokens") or 0),
    )


# --- server messages, checked at the edge -------------------------------------

# The fields the client reads, by message type, and the types they must have
# (docs/protocol.md). Optional ones are checked only when present; a session's
# ``status`` is not checked at all: a client may ignore it (``apply_status``
# drops one it does not know).
_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    ServerMessageType.SESSION.value: {"session": str, "token": str, "turn": int},
    ServerMessageType.DELTA.value: {"session": str, "turn": int, "seq": int, "text": str},
    ServerMessageType.PAUSED.value: {"session": str, "turn": int, "seq": int},
    ServerMessageType.DONE.value: {
        "session": str,
        "turn": int,
        "seq": int,
        "finish_reason": str,
        "usage": Mapping,
    },
    ServerMessageType.ERROR.value: {},
}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "id": (str, int),
    "logprobs": list,
    "tool_calls": list,
    "tool_call_parts": list,
    "error": Mapping,
    "code": str,
    "message": str,
}


def parse_server_message(data: Mapping[str, Any]) -> ServerMessage | None:
    """One decoded server message, checked once: the fields the client reads have
    their documented types (``ValueError`` if not), so nothing past this converts
    or guesses. None for a type this client does not know (a newer server's): it
    is ignored."""
    kind = data.get("type")
    required = _REQUIRED.get(kind) if isinstance(kind, str) else None
    if required is None:
        return None
    for name, expected in required.items():
        if not _is_a(data.get(name), expected):
            raise ValueError(f"{kind} message without a valid {name!r}")
    for name, expected in _OPTIONAL.items():
        if name in data and not _is_a(data[name], expected):
            raise ValueError(f"{kind} message with an invalid {name!r}")
    return data  # type: ignore[return-value]  # checked above against the contract


def _is_a(value: Any, expected: type | tuple[type, ...]) -> bool:
    return isinstance(value, expected) and not isinstance(value, bool)


# --- requests ---------------------------------------------------------------


def generate_request(
    *,
    messages: Sequence[ChatMessage] | None = None,
    prompt: str | None = None,
    params: Mapping[str, Any] | None = None,
    session: str | None = None,
    token: str | None = None,
    idempotency_key: str | None = None,
) -> Message:
    """A ``generate`` message; exactly one of ``messages`` and ``prompt``."""
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= and prompt=")
    if (session is None) != (token is None):
        raise ValueError("session and token go together")
    msg: Message = {"type": ClientMessageType.GENERATE.value}
    if messages is not None:
        msg["messages"] = [dict(m) for m in messages]
    else:
        msg["prompt"] = prompt
    if params:
        msg["params"] = dict(params)
    if session is not None:
        msg["session"] = session
        msg["token"] = token
    if idempotency_key is not None:
        msg["idempotency_key"] = idempotency_key
    return msg


def new_idempotency_key() -> str:
    """A generate's key: random, so only a resend of this very request repeats it."""
    return secrets.token_hex(IDEMPOTENCY_KEY_HEX // 2)


def control_request(kind: str, session: str, token: str, **extra: Any) -> Message:
    """``stop``, ``pause``, ``resume`` or ``close`` for a session."""
    return {"type": kind, "session": session, "token": token, **extra}


# --- per-turn state ---------------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str
    seq: int
    # With params.logprobs: the entries of this text's tokens (docs/protocol.md).
    logprobs: tuple[dict[str, Any], ...] = ()
    # With params.tools: the calls the model completed here, in OpenAI's shape; and
    # for a turn held to its calls, the parts of calls drawn here (each call's
    # arguments as they are drawn: docs/protocol.md "Tool calling").
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_parts: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class TurnPaused:
    seq: int


@dataclass(frozen=True)
class TurnEnded:
    finish_reason: str
    usage: Usage
    error: WsinferError | None


@dataclass(frozen=True)
class StatusEvent:
    """The server stated the turn's status (a ``session`` answer)."""

    status: TurnStatus


TurnChange = TextDelta | TurnPaused | TurnEnded | StatusEvent

# Whether a turn has had a message of each kind applied (the kinds that follow a turn).
_SEEN: dict[ServerMessageType, Callable[[TurnState], bool]] = {
    ServerMessageType.PAUSED: lambda state: state.paused,
    ServerMessageType.DONE: lambda state: state.done,
}

_STATUS_AFTER = {
    ServerMessageType.DELTA.value: TurnStatus.RUNNING,
    ServerMessageType.PAUSED.value: TurnStatus.PAUSED,
    ServerMessageType.DONE.value: TurnStatus.DONE,
}


@dataclass
class TurnState:
    """What the client knows of one turn: text applied so far and how it ended.

    ``seq`` is the last seq applied; the server's ``seq`` counts tokens, so a
    delta with ``seq <= self.seq`` was already applied (a replay after a
    resume) and is dropped. That is the whole exactly-once rule. ``status`` is
    the server's word (its ``session`` answer, then each event), never guessed.
    """

    session: str
    token: str
    turn: int
    seq: int = 0
    parts: list[str] = field(default_factory=list)
    # With params.logprobs: every token's entry so far, in order.
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # With params.tools: every call the model made so far, in order; and for a turn
    # held to its calls, each call as drawn so far, by index (its parts joined).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    drawn_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    status: TurnStatus | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: WsinferError | None = None
    # Given up on by the client (refused resume, connection lost for good).
    failure: WsinferError | None = None
    # What the caller asked ("stop", "pause") -> its waiter, so that a fresh
    # connection repeats it and answers the same waiter.
    requested: dict[str, Any] = field(default_factory=dict)
    # Whether the current connection follows this turn's session.
    following: bool = False
    # The I/O layer's object for this turn (the asyncio ``Turn``).
    handle: Any = None
    # A ``continue`` not yet answered: the end it went on from (its seq, finish
    # reason and usage), so that a refusal restores it and a replay after a
    # reconnect tells whether the server applied it (``continued_end``).
    continued: tuple[int, str | None, Usage | None] | None = None
    # The seq of the ``done`` applied (past ``seq`` where its last tokens had no text).
    end_seq: int = 0
    # Sent again on a fresh connection: a ``conflict`` then means the first one
    # was applied after all (a continue is applied once).
    continue_repeated: bool = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def finished(self) -> bool:
        """Done on the server, or given up on by the client."""
        return self.done or self.failure is not None

    @property
    def paused(self) -> bool:
        return self.status is TurnStatus.PAUSED

    def answered(self, control: ClientMessageType) -> bool:
        """Whether a message that answers ``control`` (``contract.CONTROL_ANSWERS``)
        has been applied: a stop's ``done``; a pause's ``paused`` or ``done``."""
        return any(_SEEN[answer](self) for answer in CONTROL_ANSWERS[control] if answer in _SEEN)

    @property
    def live(self) -> bool:
        """Whether a fresh connection should re-join it (docs/protocol.md
        "Clients"; the browser client's ``live`` is the same rule, and
        tests/clients/rejoin_cases.json holds both to it).

        A turn last seen paused is left alone, whoever paused it: re-joining
        means ``resume``, which would un-pause it. A stop the caller asked for
        is repeated all the same.
        """
        if self.finished:
            return False
        return ClientMessageType.STOP.value in self.requested or not self.paused

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def reopen(self) -> None:
        """The server says the turn went on past its ``done`` (a continue): its
        text so far stays, and it is followed again until its next ``done``."""
        self.finish_reason = None
        self.usage = None
        self.error = None
        self.requested.clear()

    def start_continue(self) -> None:
        """A ``continue`` goes out: the turn is followed again at once (queued),
        so that a connection that drops before its answer re-joins it."""
        self.continued = (self.end_seq, self.finish_reason, self.usage)
        self.reopen()
        self.status = TurnStatus.QUEUED

    def undo_continue(self) -> None:
        """The ``continue`` was refused: the turn ended as it had."""
        if self.continued is not None:
            self.end_seq, self.finish_reason, self.usage = self.continued
            self.status = TurnStatus.DONE
        self.continue_went_on()

    def continue_went_on(self) -> None:
        """The server applied the ``continue``: nothing of it to restore or repeat."""
        self.continued, self.continue_repeated = None, False

    def continued_end(self, msg: TurnMessage) -> bool:
        """Whether ``msg`` is the very end an unanswered ``continue`` went on from,
        replayed after a reconnect: that continue was lost with its connection."""
        if self.continued is None or msg["type"] != ServerMessageType.DONE.value:
            return False
        seq, reason, _ = self.continued
        return msg["seq"] <= seq and msg["finish_reason"] == reason

    def fail(self, exc: WsinferError) -> bool:
        """Give up on the turn; False if it had already ended."""
        if self.finished:
            return False
        self.failure = exc
        return True

    def apply(self, msg: TurnMessage) -> TurnChange | None:
        """Apply one ``delta``/``paused``/``done``; None when it changes nothing."""
        if self.turn < 0:
            self.turn = msg["turn"]  # joined without knowing the turn: adopt it
        if self.done or msg["turn"] != self.turn:
            return None
        event: TurnChange | None = None
        if msg["type"] == ServerMessageType.DELTA.value:
            event = self._apply_delta(msg)
        elif msg["type"] == ServerMessageType.PAUSED.value:
            event = TurnPaused(msg["seq"])
        elif msg["type"] == ServerMessageType.DONE.value:
            event = self._apply_done(msg)
        if event is not None:
            self.status = _STATUS_AFTER[msg["type"]]
        return event

    def apply_status(self, raw: Any) -> StatusEvent | None:
        """Adopt the status of a ``session`` answer (absent from older servers)."""
        try:
            status = TurnStatus(raw)
        except ValueError:
            return None
        if self.done:
            return None
        self.status = status
        return StatusEvent(status)

    def _apply_delta(self, msg: DeltaMessage) -> TextDelta | None:
        seq, text = msg["seq"], msg["text"]
        if seq <= self.seq:
            return None
        self.seq = seq
        self.parts.append(text)
        entries = tuple(msg.get("logprobs") or ())
        self.logprobs.extend(entries)
        calls = tuple(msg.get("tool_calls") or ())
        self.tool_calls.extend(calls)
        drawn = tuple(msg.get("tool_call_parts") or ())
        for part in drawn:
            self._draw(part)
        return TextDelta(text, seq, entries, calls, drawn)

    def _draw(self, part: dict[str, Any]) -> None:
        """A call's part added to the call as drawn so far."""
        function = part["function"]
        call = self.drawn_calls.setdefault(
            part["index"],
            {"index": part["index"], "id": part["id"], "type": "function",
             "function": {"name": function.get("name", ""), "arguments": ""}},
        )  # fmt: skip
        call["function"]["arguments"] += function["arguments"]

    def _apply_done(self, msg: DoneMessage) -> TurnEnded:
        self.finish_reason = msg["finish_reason"] or "stop"
        self.end_seq = msg["seq"]
        self.usage = usage_from_wire(msg["usage"])
        raw_error = msg.get("error")
        if self.finish_reason == "error" or raw_error:
            self.error = error_from_wire(raw_error or {}, self.session)
        return TurnEnded(self.finish_reason, self.usage, self.error)


# --- the connection-level core ------------------------------------------------


@dataclass
class Pending:
    """A request sent with an ``id``, waiting for its ``session`` or ``error``."""

    kind: str
    message: Message  # as sent: a resend repeats it exactly (same id, same key)
    waiter: Any = None  # the I/O layer's handle, given back in events
    turn: TurnState | None = None


@dataclass(frozen=True)
class GenerateAnswered:
    """A ``generate`` was answered: ``turn`` is new here."""

    waiter: Any
    turn: TurnState


@dataclass(frozen=True)
class RequestFailed:
    """A request failed: the server's ``error`` for it, or the client gave up."""

    kind: str
    waiter: Any
    error: WsinferError


@dataclass(frozen=True)
class TurnUpdated:
    turn: TurnState
    event: TurnChange


@dataclass(frozen=True)
class TurnFailed:
    turn: TurnState
    error: WsinferError


ClientEvent = GenerateAnswered | RequestFailed | TurnUpdated | TurnFailed


class ClientProtocol:
    """Every decision of one client, over any number of connections in turn.

    Requests made while connected go to the outbox (``data_to_send``); made
    while disconnected, they are only recorded, and ``connection_made`` sends
    what they need. The resend rule: a ``generate`` is repeated until it is
    answered, with its id and idempotency key unchanged, so the server answers
    the turn it already started instead of starting a second one; stop,
    resume and pause of live turns are repeated from the turns' state (resume
    from the last seq applied here); ``close`` is not answered, so it is only
    repeated if it could not be sent at all.
    """

    def __init__(self, *, reconnect: bool = True) -> None:
        self.reconnect = reconnect
        self.connected = False
        self.pending: dict[int, Pending] = {}
        self.turns: dict[str, TurnState] = {}  # session -> its latest turn still running
        self.tokens: dict[str, str] = {}  # session -> token, for sessions seen here
        self._outbox: list[Message] = []
        self._deferred: list[Message] = []  # unanswered by design, not sent yet
        self._ids = itertools.count(1)

    # --- requests ------------------------------------------------------------

    def generate(self, waiter: Any, **request: Any) -> Message:
        """Start a turn (``generate_request``'s arguments); ``waiter`` gets ``GenerateAnswered``."""
        session = request.get("session")
        if session is not None and request.get("token") is None:
            request["token"] = self.tokens.get(session)
            if request["token"] is None:
                raise ValueError(f"no token known for session {session!r}; pass token=")
        msg = generate_request(**request, idempotency_key=new_idempotency_key())
        self._track(msg, Pending(ClientMessageType.GENERATE.value, msg, waiter))
        return msg

    def control(self, turn: TurnState, kind: ClientMessageType, waiter: Any = None) -> None:
        """Send a control of the turn (``contract.CLIENT_MESSAGES``), repeated after
        a reconnect. One answered ``session`` (a resume) is the request that follows
        the turn again: the server replays what we lack. Any other is sent with a
        follow, since only a follower sees its answer: after it where the answer
        can be ``paused`` (a resume sent later would un-pause the turn), else
        before it (a follow sent first would un-pause a paused turn needlessly)."""
        spec = CLIENT_MESSAGES[kind]
        if kind is ClientMessageType.CONTINUE:
            if turn.continued is not None or not turn.done:
                return  # one at a time, and only of an ended turn (else: conflict)
            turn.start_continue()
            turn.following = False  # forgotten when it ended: no feed of it here
            self._register(turn)
        if spec.rejoins:
            turn.requested.pop(ClientMessageType.PAUSE.value, None)
            if self.connected:
                turn.following = False  # it restarts the feed even if we follow
                self._follow(turn, waiter, kind)
            return
        turn.requested[kind.value] = waiter
        if not self.connected:
            return
        if ServerMessageType.PAUSED in spec.answers:
            self._follow(turn, None)
            self._control(turn, kind.value, waiter)
        else:
            self._control(turn, kind.value, waiter)
            self._follow(turn, None)

    def attach(self, session: str, token: str, turn: int | None, after: int) -> TurnState:
        """Follow a turn started elsewhere; ``resume`` it with ``resume()``."""
        state = TurnState(session, token, -1 if turn is None else turn, seq=after)
        self._register(state)
        return state

    def close_session(self, session: str, token: str | None = None) -> list[ClientEvent]:
        """``close`` a session; a turn of it still running here fails with ``ClientClosed``."""
        token = token or self.tokens.get(session)
        if token is None:
            raise ValueError(f"no token known for session {session!r}; pass token=")
        events: list[ClientEvent] = []
        turn = self.turns.get(session)
        if turn is not None:
            events += self._fail_turn(turn, ClientClosed(f"session {session} was closed"))
        self.tokens.pop(session, None)
        msg = control_request(ClientMessageType.CLOSE.value, session, token)
        (self._outbox if self.connected else self._deferred).append(msg)
        return events

    def data_to_send(self) -> list[Message]:
        out, self._outbox = self._outbox, []
        return out

    def send_failed(self, messages: Iterable[Message]) -> None:
        """Messages the I/O layer could not send: keep those no resend rule covers."""
        for msg in messages:
            if msg.get("type") == ClientMessageType.CLOSE.value:
                self._deferred.append(msg)

    def wants_connection(self) -> bool:
        """Whether a dropped connection must be restored now (else: at the next request)."""
        generating = any(p.kind == ClientMessageType.GENERATE.value for p in self.pending.values())
        return generating or bool(self._deferred) or any(t.live for t in self.turns.values())

    # --- connection ------------------------------------------------------------

    def connection_made(self) -> list[Message]:
        """What a fresh connection carries first, before any new request."""
        self.connected = True
        for pending in self.pending.values():
            self._outbox.append(pending.message)  # only generates survive a drop
        for turn in [t for t in self.turns.values() if t.live]:
            self._rejoin(turn)
        self._outbox += self._deferred
        self._deferred = []
        return self.data_to_send()

    def connection_lost(self) -> list[ClientEvent]:
        """The connection dropped: keep what a fresh one must repeat."""
        self.connected = False
        self.send_failed(self.data_to_send())
        for turn in self.turns.values():
            turn.following = False
        generate = ClientMessageType.GENERATE.value
        self.pending = {i: p for i, p in self.pending.items() if p.kind == generate}
        if self.reconnect:
            return []
        return self.fail_all(ConnectionLost("the connection dropped and reconnect is off"))

    def fail_all(self, exc: WsinferError, *, everything: bool = False) -> list[ClientEvent]:
        """Give up: live turns (all turns with ``everything``) and every waiting request fail."""
        events: list[ClientEvent] = []
        for turn in list(self.turns.values()):
            if everything or turn.live:
                events += self._fail_turn(turn, exc)
        for pending in self.pending.values():
            events.append(RequestFailed(pending.kind, pending.waiter, exc))
        self.pending.clear()
        if everything:
            self._deferred.clear()
        return events

    # --- receiving -------------------------------------------------------------------

    def receive(self, data: Mapping[str, Any]) -> list[ClientEvent]:
        """One decoded server message in, the events it causes out; ``ValueError``
        for a malformed one (``parse_server_message``), which changes nothing."""
        msg = parse_server_message(data)
        if msg is None:
            return []
        if msg["type"] == ServerMessageType.SESSION.value:
            return self._on_session(msg)
        if msg["type"] == ServerMessageType.ERROR.value:
            return self._on_error(msg)
        return self._on_turn_event(msg)

    def _on_turn_event(self, msg: TurnMessage) -> list[ClientEvent]:
        turn = self.turns.get(msg["session"])
        if turn is None or self._restarting(turn):
            return []
        if turn.continued_end(msg):  # the continue was lost with its connection: again
            turn.continue_repeated = True
            turn.following = False
            self._follow(turn, None, ClientMessageType.CONTINUE)
            return []
        if turn.continued is not None and msg["seq"] > turn.continued[0]:
            turn.continue_went_on()  # it was applied
        event = turn.apply(msg)
        if turn.finished:
            self._forget(turn)
        return [] if event is None else [TurnUpdated(turn, event)]

    def _on_session(self, msg: SessionMessage) -> list[ClientEvent]:
        pending = self.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
        if pending is None:
            return []
        if pending.kind != ClientMessageType.GENERATE.value:
            return self._on_status(pending, msg)  # a resume answered with the turn's status
        turn = TurnState(msg["session"], msg["token"], msg["turn"])
        turn.apply_status(msg.get("status"))
        turn.following = True  # the server attaches the connection that generated
        self._register(turn)
        return [GenerateAnswered(pending.waiter, turn)]

    def _on_status(self, pending: Pending, msg: SessionMessage) -> list[ClientEvent]:
        turn = pending.turn
        if turn is None:
            return []
        if turn.turn < 0:
            turn.turn = msg["turn"]  # joined without knowing the turn: adopt it
        ended = msg.get("status") == TurnStatus.DONE.value
        if pending.kind == ClientMessageType.CONTINUE.value and ended:
            turn.undo_continue()  # not applied: the turn stays as it ended
            self._forget(turn)
            return []
        if pending.kind == ClientMessageType.CONTINUE.value or not ended:
            turn.continue_went_on()
        if turn.done and msg.get("status") != TurnStatus.DONE.value:
            turn.reopen()  # it went on past the done we saw (a continue)
            self._register(turn)
        event = turn.apply_status(msg.get("status"))
        return [] if event is None else [TurnUpdated(turn, event)]

    def _on_error(self, msg: ErrorMessage) -> list[ClientEvent]:
        exc = error_from_wire(msg)
        if "id" in msg:
            pending = self.pending.pop(msg["id"], None)  # type: ignore[arg-type]
            if pending is None:
                return []
            turn = pending.turn
            if pending.kind == ClientMessageType.CONTINUE.value and turn is not None:
                if turn.continue_repeated and exc.code == ErrorCode.CONFLICT.value:
                    # The first one was applied after all: follow what it started.
                    turn.continue_went_on()
                    turn.following = False
                    self._follow(turn, pending.waiter)
                    return []
                turn.undo_continue()  # refused: the turn ended as it had
                self._forget(turn)
                return [RequestFailed(pending.kind, pending.waiter, exc)]
            events: list[ClientEvent] = [RequestFailed(pending.kind, pending.waiter, exc)]
            # A refused resume leaves the turn unreachable; a refused stop or
            # pause is its caller's problem only.
            if _rejoins(pending.kind) and pending.turn is not None:
                events += self._fail_turn(pending.turn, exc)
            return events
        # Without an id it can only concern a session's running turn.
        turn = self.turns.get(str(msg.get("session")))
        return [] if turn is None else self._fail_turn(turn, exc)

    # --- internals ---------------------------------------------------------------------

    def _track(self, msg: Message, pending: Pending | None) -> None:
        msg["id"] = msg_id = next(self._ids)
        if pending is not None:
            self.pending[msg_id] = pending
        if self.connected:
            self._outbox.append(msg)

    def _control(self, turn: TurnState, kind: str, waiter: Any) -> None:
        msg = control_request(kind, turn.session, turn.token)
        self._track(msg, Pending(kind, msg, waiter, turn))

    def _follow(
        self, turn: TurnState, waiter: Any, kind: ClientMessageType = ClientMessageType.RESUME
    ) -> None:
        """``resume`` (or another control answered ``session``) from the last seq
        applied here, unless this connection follows already."""
        if turn.following:
            return
        extra: dict[str, Any] = {"after": turn.seq}
        if turn.turn >= 0:  # unknown for a turn joined with attach(turn=None)
            extra["turn"] = turn.turn
        msg = control_request(kind.value, turn.session, turn.token, **extra)
        self._track(msg, Pending(kind.value, msg, waiter, turn))
        turn.following = True

    def _rejoin(self, turn: TurnState) -> None:
        """Repeat on a fresh connection what the caller asked of a live turn."""
        stop, pause = ClientMessageType.STOP.value, ClientMessageType.PAUSE.value
        if stop in turn.requested:
            self._control(turn, stop, turn.requested[stop])
        self._follow(turn, None)
        if pause in turn.requested and stop not in turn.requested:
            self._control(turn, pause, turn.requested[pause])

    def _fail_turn(self, turn: TurnState, exc: WsinferError) -> list[ClientEvent]:
        failed = turn.fail(exc)
        self._forget(turn)
        return [TurnFailed(turn, exc)] if failed else []

    def _restarting(self, turn: TurnState) -> bool:
        """Whether a ``resume`` of the turn is still unanswered.

        Until its ``session`` answer, the turn's events come from a feed that
        the resume replaces: the connection's earlier feed, or one that a
        ``stop`` attached at the server's current seq. A delta carries no start,
        so applying one of those could skip text (a feed that began past our
        seq), and the replay that follows the answer, merged into one delta
        from our seq, would then repeat what the old feed gave. The replay
        restates all of it: nothing is lost by waiting for it.
        """
        return any(_rejoins(p.kind) and p.turn is turn for p in self.pending.values())

    def _register(self, turn: TurnState) -> None:
        self.turns[turn.session] = turn
        self.tokens[turn.session] = turn.token

    def _forget(self, turn: TurnState) -> None:
        if self.turns.get(turn.session) is turn:
            del self.turns[turn.session]
        for msg_id in [i for i, p in self.pending.items() if p.turn is turn]:
            del self.pending[msg_id]


def _rejoins(kind: str) -> bool:
    """Whether a request of ``kind`` is answered ``session`` and attaches (a resume)."""
    spec = CLIENT_MESSAGES.get(ClientMessageType(kind)) if kind in _KINDS else None
    return spec is not None and spec.rejoins


_KINDS = frozenset(kind.value for kind in ClientMessageType)
