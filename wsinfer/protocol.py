"""The per-connection session protocol, sans I/O.

Every decision of a connection is made here, with no ``await`` and no Redis:
what ``generate``, ``stop``, ``pause``, ``resume`` and ``close`` do in each
turn state, the capacity refusals, attaching on stop/pause, replay bounds,
the exactly-once rule by ``seq`` and the merging of a lagging reader's deltas.

Like websockets' ``Protocol``, it takes frames in and gives frames out
(``receive``, ``data_to_send``). A request is worked through as a ``Plan``:
it yields the commands of ``commands.py`` for the I/O layer (``handlers.py``)
to execute and is sent back their results as events, so every rule of
docs/protocol.md is tested by playing the I/O layer's part in a few lines.

The exactly-once rule: a connection follows a session at most once, and each
delta is sent only if its ``seq`` is past what this connection already sent
for that turn. A lagging connection gets consecutive deltas merged into one
(the protocol allows a delta to carry several tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from wsinfer.commands import (
    Admit,
    Admitted,
    CloseSession,
    Command,
    Control,
    Controlled,
    Event,
    Lookup,
    ReadTurn,
    Refused,
    StartTurn,
    Subscribe,
    TurnFound,
    TurnRead,
    TurnStarted,
    Unsubscribe,
)
from wsinfer.contract import (
    CLIENT_MESSAGES,
    ClientMessageType,
    ErrorCode,
    FinishReason,
    ServerMessage,
    TurnStatus,
)
from wsinfer.errors import Conflict, NotFound, Overloaded, WsinferError
from wsinfer.messages import (
    ClientMessage,
    Codec,
    Generate,
    Limits,
    Resume,
    SessionCommand,
    delta_message,
    done_message,
    error_message,
    message_id,
    parse_client_message,
    paused_message,
    session_message,
)
from wsinfer.sessions.schema import (
    DeltaEvent,
    DoneEvent,
    PausedEvent,
    TurnError,
    TurnEvent,
    Usage,
)
from wsinfer.sessions.states import CONTROL, Outcome

# However a connection comes to follow a session (generate, resume, stop, pause).
MAX_FOLLOWED_PER_CONNECTION = 64
NO_SUCH_SESSION = "no such session (or wrong token)"

Steps = Generator[Command, Event | None, None]
E = TypeVar("E", bound=Event)


class Plan:
    """One request worked through: the commands it needs, each chosen once the
    previous one's event is known. The I/O layer calls ``start``, then ``send``
    (or ``throw``) until they return None; a refusal raises ``WsinferError``."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps

    def start(self) -> Command | None:
        return self._advance(lambda: next(self._steps))

    def send(self, event: Event | None) -> Command | None:
        return self._advance(lambda: self._steps.send(event))

    def throw(self, error: WsinferError) -> Command | None:
        return self._advance(lambda: self._steps.throw(error))

    @staticmethod
    def _advance(step: Callable[[], Command]) -> Command | None:
        try:
            return step()
        except StopIteration:
            return None


def _expect(event: Event | None, kind: type[E]) -> E:
    """The event a command yields: anything else is a bug of the I/O layer."""
    if not isinstance(event, kind):
        raise TypeError(f"expected {kind.__name__}, got {event!r}")
    return event


def _status_after_refusal(current: str) -> TurnStatus:
    """A refusal names a status, or says the turn is no longer the latest:
    then a later turn has started, which only a done turn allows."""
    try:
        return TurnStatus(current)
    except ValueError:
        return TurnStatus.DONE


@dataclass
class Feed:
    """What this connection has sent of one session's turn."""

    session: str
    turn: int
    last_seq: int
    # Entries of deltas that carried no text yet (held-back tokens): they go out with
    # the next text, so each delta's entries are those of its text's tokens.
    held_logprobs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Outgoing:
    frame: str | bytes
    message: ServerMessage


class ConnectionProtocol:
    def __init__(self, codec: Codec, limits: Limits | None = None) -> None:
        self.codec = codec
        self.limits = limits or Limits()
        self.feeds: dict[str, Feed] = {}  # session -> feed
        self._outbox: list[ServerMessage] = []
        # Roughly how many bytes the outbox will encode to: the adapter pauses
        # a connection's sources while its client is not reading.
        self.outbox_bytes = 0
        # False: one message per delivered delta, live or replayed, never a run
        # merged, so that a door numbering its events by count (the v2 stream,
        # DJL's lines) numbers them as the log does, whatever the timing.
        self.coalesce = True

    # --- input --------------------------------------------------------------------

    def receive(self, frame: str | bytes) -> ClientMessage | None:
        """Parse one frame; a bad one queues an ``error`` and returns None."""
        data: Any = None
        try:
            data = self.codec.decode(frame)
            return parse_client_message(data, self.limits)
        except WsinferError as exc:
            self.fail(exc, msg_id=message_id(data))
            return None

    # --- requests ---------------------------------------------------------------------

    def plan(self, message: ClientMessage) -> Plan:
        """What ``message`` does, as commands for the I/O layer to execute."""
        if isinstance(message, Generate):
            return Plan(self._generate(message))
        if isinstance(message, Resume):  # a control answered ``session``: it attaches
            return Plan(self._resume(message))
        if not CLIENT_MESSAGES[message.type].controls_turn:  # close
            return Plan(self._close(message))
        return Plan(self._control(message))

    def _generate(self, msg: Generate) -> Steps:
        self._check_follow_limit(msg.session)
        admitted = _expect((yield Admit()), Admitted)
        outcome = yield StartTurn(msg, admitted.alive)
        if isinstance(outcome, Refused):  # the state table: only after a done turn
            raise Conflict(f"cannot start a turn while the session's turn is {outcome.current}")
        started = _expect(outcome, TurnStarted)
        if started.repeat:  # the client lost our answer: it rejoins that turn from the start
            yield from self._rejoin(
                msg.id, started.session, started.token, started.turn, started.status, after=0
            )
            return
        self._queue(
            session_message(started.session, started.token, started.turn, started.status, msg.id)
        )
        self.follow(started.session, started.turn, after=0)
        yield Subscribe(started.session, started.turn, "0-0")

    def _resume(self, msg: Resume) -> Steps:
        self._check_follow_limit(msg.session)
        found = _expect((yield Lookup(msg.session, msg.token)), TurnFound)
        turn = msg.turn if msg.turn is not None else found.turn
        if turn > found.turn:
            raise NotFound(f"session has no turn {turn}")
        # Only the latest turn can be unfinished: an earlier one ended before it started.
        status = found.status if turn == found.turn else TurnStatus.DONE
        yield from self._rejoin(msg.id, msg.session, msg.token, turn, status, msg.after, msg.type)

    def _rejoin(
        self,
        msg_id: str | int | None,
        session: str,
        token: str,
        turn: int,
        status: TurnStatus,
        after: int,
        kind: ClientMessageType = ClientMessageType.RESUME,
    ) -> Steps:
        """Answer ``session`` with the turn's status and attach, after applying
        ``kind`` where its row says so: a resume continues a paused turn, since
        whoever rejoins it wants its answer."""
        resumed_at: int | None = None
        reaction = CONTROL[(kind, status)].outcome
        if reaction is Outcome.REFUSE:
            raise Conflict(f"cannot {kind.value} a turn that is {status.value}")
        if reaction is Outcome.APPLY:
            outcome = yield Control(session, token, turn, kind)
            if isinstance(outcome, Controlled):
                status, resumed_at = outcome.status, outcome.seq
            else:  # another client moved it first: follow it as it is, where the row allows
                current = _expect(outcome, Refused).current
                _reaction_to_refusal(kind, current)
                status = _status_after_refusal(current)
        self._queue(session_message(session, token, turn, status, msg_id))
        yield from self._attach(session, turn, after, resumed_at)

    def _control(self, msg: SessionCommand) -> Steps:
        """stop and pause: the requester sees the outcome (paused/done) like any follower."""
        found = _expect((yield Lookup(msg.session, msg.token)), TurnFound)
        following = msg.session in self.feeds
        if not following:
            self._check_follow_limit(msg.session)
            yield from self._attach(msg.session, found.turn, after=found.seq)
        reaction = CONTROL[(msg.type, found.status)].outcome
        if reaction is Outcome.REFUSE:
            raise Conflict(f"cannot {msg.type.value} a turn that is {found.status.value}")
        if reaction is Outcome.APPLY:
            outcome = yield Control(msg.session, msg.token, found.turn, msg.type)
            if isinstance(outcome, Refused):  # the turn moved on since the lookup
                reaction = _reaction_to_refusal(msg.type, outcome.current)
        if reaction is Outcome.REPORT_PAUSED and following:  # else the replay said so
            self.notify_paused(msg.session, found.turn, found.seq)

    def _close(self, msg: SessionCommand) -> Steps:
        yield CloseSession(msg.session, msg.token)
        self.unfollow(msg.session)
        yield Unsubscribe(msg.session)

    def _attach(self, session: str, turn: int, after: int, resumed_at: int | None = None) -> Steps:
        """Replay the turn after ``after``, then follow it live from the last
        entry read, so nothing falls between the two; anything sent twice is
        dropped by ``seq``. The read marks the session watched too (one round
        trip), so a running turn is not idle-paused under a client that has
        just come back. ``resumed_at``: this request has just resumed the
        turn, paused at that seq."""
        self.follow(session, turn, after)
        try:
            read = _expect((yield ReadTurn(session, turn, after)), TurnRead)
            if not read.found:
                raise NotFound(NO_SUCH_SESSION)
        except WsinferError:  # do not leave a feed that nothing feeds
            self.unfollow(session)
            yield Unsubscribe(session)
            raise
        self.replay(session, turn, _without_resumed_pause(read.events, resumed_at))
        if session in self.feeds:  # not yet done
            yield Subscribe(session, turn, read.last_id)

    def too_fast(self, message: ClientMessage, wait_s: float) -> None:
        """Refuse a request over the connection's rate (not acted on): retry in
        ``wait_s``, rounded up to the millisecond, since a ``retry_after`` of 0
        would invite an immediate retry, refused again."""
        retry_after = math.ceil(wait_s * 1000) / 1000
        error = Overloaded("too many requests on this connection", retry_after=retry_after)
        self.fail(error, msg_id=message.id, session=getattr(message, "session", None))

    def _check_follow_limit(self, session: str | None) -> None:
        if session not in self.feeds and len(self.feeds) >= MAX_FOLLOWED_PER_CONNECTION:
            raise Overloaded(f"a connection follows at most {MAX_FOLLOWED_PER_CONNECTION} sessions")

    # --- outcomes reported by the adapter ---------------------------------------------

    def fail(
        self, exc: WsinferError, *, msg_id: str | int | None = None, session: str | None = None
    ) -> None:
        self._queue(
            error_message(
                exc.code, exc.message, msg_id=msg_id, session=session, retry_after=exc.retry_after
            )
        )

    def follow(self, session: str, turn: int, after: int) -> None:
        """Start (or restart) this connection's feed of a turn after ``after``."""
        self.feeds[session] = Feed(session, turn, after)

    def unfollow(self, session: str) -> None:
        self.feeds.pop(session, None)

    def lost(self, session: str, reason: str) -> None:
        """The session vanished under a follower (closed elsewhere, expired, or
        its state lost with Redis): end its turn for this connection with an error."""
        feed = self.feeds.pop(session, None)
        if feed is None:
            return
        usage = Usage(completion_tokens=feed.last_seq)
        error = TurnError(ErrorCode.NOT_FOUND, reason)
        event = DoneEvent(feed.last_seq, FinishReason.ERROR.value, usage, error)
        self._queue(done_message(session, feed.turn, event))

    def notify_paused(self, session: str, turn: int, seq: int) -> None:
        self._queue(paused_message(session, turn, seq))

    def replay(self, session: str, turn: int, events: list[TurnEvent]) -> None:
        """Deliver a turn's history: an end the turn went on past (a ``paused``
        later resumed, a ``done`` later continued) is stale."""
        last_index = len(events) - 1
        current = [e for i, e in enumerate(events) if not _is_end(e) or i == last_index]
        self.deliver(session, turn, current)

    def deliver(self, session: str, turn: int, events: list[TurnEvent]) -> None:
        """Events of a turn's stream, in order; duplicates and other turns are dropped."""
        feed = self.feeds.get(session)
        for event in events:
            if feed is None or feed.turn != turn:
                return
            if isinstance(event, DeltaEvent):
                self._deliver_delta(feed, event)
            elif isinstance(event, PausedEvent):
                self._queue(paused_message(session, turn, event.seq))
            elif isinstance(event, DoneEvent):
                feed.last_seq = max(feed.last_seq, event.seq)
                self._queue(done_message(session, turn, event))
                self.unfollow(session)
                feed = None

    def _deliver_delta(self, feed: Feed, event: DeltaEvent) -> None:
        if event.seq <= feed.last_seq:
            return
        feed.last_seq = event.seq
        if event.logprobs:
            feed.held_logprobs.extend(event.logprobs)
        # Tokens whose text is held back (partial UTF-8, a stop string's or a tool
        # call's possible start) carry no text: their logprobs go with the next delta.
        if event.reaches_readers:
            logprobs, feed.held_logprobs = feed.held_logprobs or None, []
            message = delta_message(
                feed.session,
                feed.turn,
                event.seq,
                event.text,
                logprobs,
                event.tool_calls,
                event.tool_call_parts,
            )
            self._queue(message)

    # --- output ---------------------------------------------------------------------

    def _queue(self, message: ServerMessage) -> None:
        self._outbox.append(message)
        self.outbox_bytes += _MESSAGE_OVERHEAD
        if message["type"] == "delta":
            self.outbox_bytes += len(message["text"])
            for call in [*message.get("tool_calls", ()), *message.get("tool_call_parts", ())]:
                self.outbox_bytes += _MESSAGE_OVERHEAD + len(call["function"]["arguments"])
            for entry in message.get("logprobs") or ():
                self.outbox_bytes += _LOGPROB_BYTES * (1 + len(entry["top_logprobs"]))

    def data_to_send(self) -> list[Outgoing]:
        messages = _coalesce(self._outbox) if self.coalesce else self._outbox
        self._outbox = []
        self.outbox_bytes = 0
        return [self._encode(m) for m in messages]

    def _encode(self, message: ServerMessage) -> Outgoing:
        """Encode one message; one that cannot be (a bug) becomes an ``internal``
        error, so a connection is never dropped over an unsendable reply."""
        try:
            return Outgoing(self.codec.encode(message), message)
        except (TypeError, ValueError, OverflowError) as exc:  # UnicodeError is a ValueError
            text = f"unsendable {message.get('type')} reply: {exc!r}"[:200]
            error = error_message(ErrorCode.INTERNAL, text)
            return Outgoing(self.codec.encode(error), error)


def _is_end(event: TurnEvent) -> bool:
    """An event that ends a run of the turn's deltas: a later one can follow it
    only once the turn has been resumed (or continued)."""
    return isinstance(event, (PausedEvent, DoneEvent))


def _without_resumed_pause(events: list[TurnEvent], resumed_at: int | None) -> list[TurnEvent]:
    """A turn's history without the end (a pause; a done, for a continue) that
    this request has just moved the turn on from.

    That end was the stream's last event when the control was applied; one
    that follows it is newer (another pause since) and stays. An end at the
    same seq right after another is taken for the newer one: at worst a stale
    ``paused`` is sent, never a current one lost.
    """
    if resumed_at is None or not events:
        return events

    def resumed_pause(event: TurnEvent | None) -> bool:
        return event is not None and _is_end(event) and event.seq == resumed_at

    before = events[-2] if len(events) > 1 else None
    if resumed_pause(events[-1]) and not resumed_pause(before):
        return events[:-1]
    return events


def _reaction_to_refusal(action: ClientMessageType, current: str) -> Outcome:
    """The store refused a control the lookup allowed: the turn changed in
    between. Paused or done meanwhile reads as for that status; else (and where
    the store's own check refused it, such as a row's ``finished``) conflict."""
    rule = CONTROL.get((action, _status_after_refusal(current)))
    reaction = rule.outcome if rule is not None else Outcome.APPLY
    if rule is not None and rule.finished is not None and current == _named_status(current):
        # The status allowed it: how the turn ended did not.
        raise Conflict(f"cannot {action.value} a turn that did not end by {rule.finished.value}")
    if reaction in (Outcome.APPLY, Outcome.REFUSE):
        raise Conflict(f"cannot {action.value} a turn that is {current}")
    return reaction


def _named_status(current: str) -> str | None:
    """``current`` if a refusal named a status (not why else, e.g. a later turn)."""
    return current if current in _STATUSES else None


_STATUSES = frozenset(status.value for status in TurnStatus)


# Bytes a message costs beyond its text (keys, ids, framing), for the budget.
_MESSAGE_OVERHEAD = 96
# About what one logprobs entry (or one of its top_logprobs) takes as JSON.
_LOGPROB_BYTES = 64


def _coalesce(messages: list[ServerMessage]) -> list[ServerMessage]:
    """Merge runs of deltas of the same turn: one frame, the latest seq, all text (and
    all logprobs entries, in order).

    Texts are joined once per run (not pairwise), so a long replay stays linear.
    """
    out: list[ServerMessage] = []
    texts: list[str] = []  # the texts of the run of deltas that ends ``out``
    entries: list[dict[str, Any]] = []  # and their logprobs entries
    for message in messages:
        if message["type"] != "delta":
            _close_run(out, texts, entries)
            texts, entries = [], []
            out.append(message)
            continue
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev["type"] == "delta"
            and prev["session"] == message["session"]
            and prev["turn"] == message["turn"]
            and not _has_calls(prev)  # a call, or a part of one, stays where it came
            and not _has_calls(message)
        ):
            texts.append(message["text"])
            entries.extend(message.get("logprobs") or ())
            merged = prev.copy()  # ours to change: the run's text is joined into it
            merged["seq"] = message["seq"]
            out[-1] = merged
            continue
        _close_run(out, texts, entries)
        texts = [message["text"]]
        entries = list(message.get("logprobs") or ())
        out.append(message)
    _close_run(out, texts, entries)
    return out


def _has_calls(message: ServerMessage) -> bool:
    return "tool_calls" in message or "tool_call_parts" in message


def _close_run(out: list[ServerMessage], texts: list[str], entries: list[dict[str, Any]]) -> None:
    """Give the merged delta ending ``out`` its run's text and entries."""
    last = out[-1] if out else None
    if len(texts) > 1 and last is not None and last["type"] == "delta":
        last["text"] = "".join(texts)
        if entries:
            last["logprobs"] = entries
