"""The per-connection session protocol, sans I/O.

Frames in, typed requests and frames out; no ``await`` anywhere, so every rule
of the wire protocol is testable without a socket. The server adapter
(``server.py``) moves frames and runs the requests against Redis; it tells this
object what happened (``accepted``, ``fail``, ``follow``, ``deliver``) and
sends whatever ``data_to_send`` returns.

What lives here is the exactly-once rule: a connection follows a session at
most once, and each delta is sent only if its ``seq`` is past what this
connection already sent for that turn. A lagging connection gets consecutive
deltas merged into one (the protocol allows a delta to carry several tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wsinfer.errors import WsinferError
from wsinfer.messages import (
    ClientMessage,
    Codec,
    Limits,
    delta_message,
    done_message,
    error_message,
    message_id,
    parse_client_message,
    paused_message,
    session_message,
)
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, PausedEvent, TurnEvent, Usage


@dataclass
class Feed:
    """What this connection has sent of one session's turn."""

    session: str
    turn: int
    last_seq: int


@dataclass(frozen=True)
class Outgoing:
    frame: str | bytes
    message: dict[str, Any]


class ConnectionProtocol:
    def __init__(self, codec: Codec, limits: Limits | None = None) -> None:
        self.codec = codec
        self.limits = limits or Limits()
        self.feeds: dict[str, Feed] = {}  # session -> feed
        self._outbox: list[dict[str, Any]] = []
        # Roughly how many bytes the outbox will encode to: the adapter pauses
        # a connection's sources while its client is not reading.
        self.outbox_bytes = 0

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

    # --- outcomes reported by the adapter ---------------------------------------------

    def accepted(self, msg_id: str | int | None, session: str, token: str, turn: int) -> None:
        self._queue(session_message(session, token, turn, msg_id))
        self.follow(session, turn, after=0)

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
        error = {"code": "not_found", "message": reason}
        event = DoneEvent(feed.last_seq, "error", usage, error)
        self._queue(done_message(session, feed.turn, event))

    def notify_paused(self, session: str, turn: int, seq: int) -> None:
        self._queue(paused_message(session, turn, seq))

    def replay(self, session: str, turn: int, events: list[TurnEvent]) -> None:
        """Deliver a turn's history: a ``paused`` that was later resumed is stale."""
        last_index = len(events) - 1
        current = [
            e for i, e in enumerate(events) if not isinstance(e, PausedEvent) or i == last_index
        ]
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
        if event.text:  # tokens still held back (partial UTF-8, stop prefix) carry no text
            self._queue(delta_message(feed.session, feed.turn, event.seq, event.text))

    # --- output ---------------------------------------------------------------------

    def _queue(self, message: dict[str, Any]) -> None:
        self._outbox.append(message)
        self.outbox_bytes += _MESSAGE_OVERHEAD + len(message.get("text", ""))

    def data_to_send(self) -> list[Outgoing]:
        messages, self._outbox = _coalesce(self._outbox), []
        self.outbox_bytes = 0
        return [self._encode(m) for m in messages]

    def _encode(self, message: dict[str, Any]) -> Outgoing:
        """Encode one message; one that cannot be (a bug) becomes an ``internal``
        error, so a connection is never dropped over an unsendable reply."""
        try:
            return Outgoing(self.codec.encode(message), message)
        except (TypeError, ValueError, OverflowError) as exc:  # UnicodeError is a ValueError
            text = f"unsendable {message.get('type')} reply: {exc!r}"[:200]
            error = error_message("internal", text)
            return Outgoing(self.codec.encode(error), error)


# Bytes a message costs beyond its text (keys, ids, framing), for the budget.
_MESSAGE_OVERHEAD = 96


def _coalesce(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge runs of deltas of the same turn: one frame, the latest seq, all text.

    Texts are joined once per run (not pairwise), so a long replay stays linear.
    """
    out: list[dict[str, Any]] = []
    texts: list[str] = []  # the texts of the run of deltas that ends ``out``
    for message in messages:
        prev = out[-1] if out else None
        if (
            prev is not None
            and message["type"] == "delta"
            and prev["type"] == "delta"
            and prev["session"] == message["session"]
            and prev["turn"] == message["turn"]
        ):
            texts.append(message["text"])
            out[-1] = {**prev, "seq": message["seq"]}
            continue
        if texts and len(texts) > 1:
            out[-1]["text"] = "".join(texts)
        texts = [message["text"]] if message["type"] == "delta" else []
        out.append(message)
    if len(texts) > 1:
        out[-1]["text"] = "".join(texts)
    return out
