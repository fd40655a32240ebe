"""What the connection protocol asks of the I/O layer, and what it hears back.

``protocol.py`` decides; ``handlers.py`` executes. A request's plan yields a
*command* (look a session up, start a turn, read a turn's history...) and is
sent the *event* its execution produced, or thrown the ``WsinferError`` it
failed with. Plain values only: no Redis, no sockets, so a test can play the
I/O layer's part with a few lines of Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsinfer.contract import ClientMessageType, TurnStatus
from wsinfer.messages import Generate
from wsinfer.sessions.schema import TurnEvent

# --- commands (protocol -> I/O) ---------------------------------------------------------


@dataclass(frozen=True)
class Admit:
    """May a new turn be queued now (an engine alive, the queue not full)?"""


@dataclass(frozen=True)
class StartTurn:
    """Start the turn a ``generate`` asks for (a new session when it names none)."""

    request: Generate
    alive: frozenset[str]  # the engines alive, from ``Admitted``


@dataclass(frozen=True)
class Lookup:
    """The session's latest turn, with its status; proves the token."""

    session: str
    token: str


@dataclass(frozen=True)
class Control:
    """Apply a client's stop, pause or resume to a turn, atomically in the store."""

    session: str
    token: str
    turn: int
    action: ClientMessageType


@dataclass(frozen=True)
class ReadTurn:
    """Every event of a turn so far, for a replay of what follows ``after``;
    the session is marked watched at the same time (not at the next touch
    tick), so a running turn is not idle-paused under a client that has just
    come back, and its keys are kept alive."""

    session: str
    turn: int
    after: int


@dataclass(frozen=True)
class Subscribe:
    """Feed the turn's live events to this connection from stream position ``position``."""

    session: str
    turn: int
    position: str


@dataclass(frozen=True)
class Unsubscribe:
    session: str


@dataclass(frozen=True)
class CloseSession:
    session: str
    token: str


Command = Admit | StartTurn | Lookup | Control | ReadTurn | Subscribe | Unsubscribe | CloseSession

# --- events (I/O -> protocol) -----------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    alive: frozenset[str]


@dataclass(frozen=True)
class TurnStarted:
    """``repeat``: nothing was started; an earlier generate with the same
    idempotency key had started this turn."""

    session: str
    token: str
    turn: int
    status: TurnStatus
    repeat: bool = False


@dataclass(frozen=True)
class TurnFound:
    turn: int
    status: TurnStatus
    seq: int


@dataclass(frozen=True)
class Controlled:
    status: TurnStatus  # the turn's status once the action was applied
    seq: int  # its seq then


@dataclass(frozen=True)
class Refused:
    """The store's state table refused the action: the turn is ``current``
    (a status, or why not, e.g. that it is no longer the latest turn)."""

    current: str


@dataclass(frozen=True)
class TurnRead:
    events: list[TurnEvent]
    last_id: str  # the stream position to follow live from
    found: bool = True  # False: the session no longer exists


Event = Admitted | TurnStarted | TurnFound | Controlled | Refused | TurnRead
