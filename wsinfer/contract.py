"""The wire contract's vocabulary: every message type, error code, finish
reason, turn status, close code and subprotocol of docs/protocol.md, named once.

A leaf module (standard library only), so that the server, the engine, the
Python client and the generated browser table all import the same names, and
a test can hold docs/protocol.md to them. A new message type or code starts
here and in the doc.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypedDict


class Subprotocol(str, Enum):
    """The WebSocket subprotocols (``Sec-WebSocket-Protocol``): one per encoding."""

    JSON = "wsinfer.v1.json"
    MSGPACK = "wsinfer.v1.msgpack"


class ClientMessageType(str, Enum):
    GENERATE = "generate"
    STOP = "stop"
    PAUSE = "pause"
    RESUME = "resume"
    CONTINUE = "continue"
    CLOSE = "close"


class ServerMessageType(str, Enum):
    SESSION = "session"
    DELTA = "delta"
    PAUSED = "paused"
    DONE = "done"
    ERROR = "error"


class FieldKind(str, Enum):
    """What a client message's field holds, as its parser checks it."""

    NAME = "name"  # a non-empty string of at most MAX_NAME_CHARS (a session, a token)
    COUNT = "count"  # an integer >= 0 (a seq)
    ORDINAL = "ordinal"  # an integer >= 1 (a turn)
    # generate's own, whose checks span fields (wsinfer/messages.py)
    MESSAGES = "messages"
    TEXT = "text"
    PARAMS = "params"
    KEY = "key"  # an idempotency key


@dataclass(frozen=True)
class Field:
    name: str
    kind: FieldKind
    required: bool = False


@dataclass(frozen=True)
class MessageSpec:
    """One client message, declared once: its fields (beside ``type`` and ``id``),
    what answers it to its sender, and whether it acts on a session's latest turn.

    The server's parser (``wsinfer/messages.py``), the plan it is worked through
    (``wsinfer/protocol.py``), the HTTP door's session routes, the clients'
    request builders and the generated ``contract.js`` all read it; what a turn
    control does in each turn status is its rows in ``sessions/states.py``.
    """

    type: ClientMessageType
    fields: tuple[Field, ...]
    # What answers it: a stop ends in the turn's ``done``; a pause in ``paused``, or
    # ``done`` if the turn ended first; a resume is answered ``session`` (then the
    # turn's messages); nothing answers a close.
    answers: tuple[ServerMessageType, ...] = ()
    # A control of a turn: it has rows in the state table, and the HTTP door
    # serves it as ``POST /v1/sessions/{session}/<type>``.
    controls_turn: bool = False

    @property
    def rejoins(self) -> bool:
        """A control answered ``session``, then the turn's messages (a resume):
        its sender follows the turn from then on."""
        return self.controls_turn and self.answers == (ServerMessageType.SESSION,)

    def field_names(self) -> frozenset[str]:
        return frozenset({"type", "id", *(f.name for f in self.fields)})


_SESSION_FIELDS = (Field("session", FieldKind.NAME, True), Field("token", FieldKind.NAME, True))
# Which of a turn's messages to replay (the seq already received), and which turn.
_REPLAY_FIELDS = (Field("after", FieldKind.COUNT), Field("turn", FieldKind.ORDINAL))
_M, _A = ClientMessageType, ServerMessageType

# docs/protocol.md, "Messages": every message a client sends.
CLIENT_MESSAGES: dict[ClientMessageType, MessageSpec] = {
    _M.GENERATE: MessageSpec(
        _M.GENERATE,
        (
            Field("messages", FieldKind.MESSAGES),
            Field("prompt", FieldKind.TEXT),
            Field("params", FieldKind.PARAMS),
            Field("session", FieldKind.NAME),
            Field("token", FieldKind.NAME),
            Field("idempotency_key", FieldKind.KEY),
        ),
        answers=(_A.SESSION,),
    ),
    _M.STOP: MessageSpec(_M.STOP, _SESSION_FIELDS, answers=(_A.DONE,), controls_turn=True),
    _M.PAUSE: MessageSpec(
        _M.PAUSE, _SESSION_FIELDS, answers=(_A.PAUSED, _A.DONE), controls_turn=True
    ),
    _M.RESUME: MessageSpec(
        _M.RESUME, _SESSION_FIELDS + _REPLAY_FIELDS, answers=(_A.SESSION,), controls_turn=True
    ),
    # Extend a turn cut by length: answered as a resume is, then the same turn goes on.
    _M.CONTINUE: MessageSpec(
        _M.CONTINUE, _SESSION_FIELDS + _REPLAY_FIELDS, answers=(_A.SESSION,), controls_turn=True
    ),
    _M.CLOSE: MessageSpec(_M.CLOSE, _SESSION_FIELDS),
}

# What answers each control of a turn to the client that sent it, which follows the
# turn as any follower does (from the declarations above).
CONTROL_ANSWERS: dict[ClientMessageType, tuple[ServerMessageType, ...]] = {
    kind: spec.answers for kind, spec in CLIENT_MESSAGES.items() if spec.controls_turn
}
# A session or token the server keeps, or an id it echoes: bounded.
MAX_NAME_CHARS = 256


class ErrorCode(str, Enum):
    """Codes of ``error`` messages and of ``done.error``, chosen where the
    error happens and carried across processes as they are."""

    # Whose fault each is, and whether a retry may help: ERROR_CLASSES below.
    BAD_REQUEST = "bad_request"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    INTERNAL = "internal"


class ErrorFault(str, Enum):
    """Whose fault an error is: the request's (change it), or the service's."""

    REQUEST = "request"
    SERVICE = "service"


@dataclass(frozen=True)
class ErrorClass:
    fault: ErrorFault
    # Whether the same request, sent again later unchanged, may succeed.
    retryable: bool


# The one classification of the error codes (docs/protocol.md "Error codes"):
# the server's exceptions (wsinfer/errors.py), the Python client's
# (clients/errors.py) and the browser client's (contract.js) all derive theirs
# from it, and a class that sits in another family fails at import.
ERROR_CLASSES: dict[ErrorCode, ErrorClass] = {
    ErrorCode.BAD_REQUEST: ErrorClass(ErrorFault.REQUEST, retryable=False),
    ErrorCode.UNAUTHORIZED: ErrorClass(ErrorFault.REQUEST, retryable=False),
    ErrorCode.NOT_FOUND: ErrorClass(ErrorFault.REQUEST, retryable=False),
    ErrorCode.CONFLICT: ErrorClass(ErrorFault.REQUEST, retryable=False),
    ErrorCode.TOO_LARGE: ErrorClass(ErrorFault.REQUEST, retryable=False),
    ErrorCode.OVERLOADED: ErrorClass(ErrorFault.SERVICE, retryable=True),
    ErrorCode.ENGINE_UNAVAILABLE: ErrorClass(ErrorFault.SERVICE, retryable=True),
    ErrorCode.INTERNAL: ErrorClass(ErrorFault.SERVICE, retryable=True),
}


def error_class(code: str) -> ErrorClass | None:
    """The class of a code the server sends (an ``ErrorCode`` or its value);
    None for any other (the clients' own codes, a newer server's)."""
    try:
        return ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        return None


def check_error_family(name: str, code: str, family: ErrorFault) -> None:
    """Both exception trees' check, when a class for ``code`` is defined in
    ``family``: TypeError where ERROR_CLASSES puts the code in the other one."""
    kind = error_class(code)
    if kind is not None and kind.fault is not family:
        raise TypeError(f"{name}: {ErrorCode(code).value} is the {kind.fault.value}'s fault")


class ClientErrorCode(str, Enum):
    """Codes the clients raise themselves, never sent by the server: the same
    situation gets the same code in Python and in the browser."""

    # The connection dropped and could not be restored (reconnect off, or it
    # gave up after its attempts); the turn may still be running server-side.
    CONNECTION_LOST = "connection_lost"
    # The caller closed the client or the session while a call was waiting.
    CLIENT_CLOSED = "client_closed"


class FinishReason(str, Enum):
    STOP = "stop"  # end-of-sequence or a stop string
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"  # a turn with tools ended by itself after calling


# The same values as a type, for fields that hold the plain string (the turn record,
# the Python client's state): a misspelt reason is a type error. A test holds the
# two to the same values; nowhere else declares them.
FinishReasonName = Literal["stop", "length", "cancelled", "error", "tool_calls"]


@dataclass(frozen=True)
class Usage:
    """A turn's token counts: a ``done``'s ``usage``, as the engine records it
    in the turn record and as the clients read it (one type on both sides)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class TurnStatus(str, Enum):
    """A turn's status: the states of ``sessions/states.py``'s table, and what a
    ``session`` answer and ``status`` fields carry (``new`` never reaches clients)."""

    NEW = "new"  # no turn yet: the session does not exist
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    DONE = "done"


# The statuses and error codes as types too, for the maps below (held to the enums
# by a test, like FinishReasonName). A client is told of a turn's status only once
# the turn exists: ``SessionMessage`` carries a ``WireStatusName``, never ``new``.
WireStatusName = Literal["queued", "running", "paused", "done"]
TurnStatusName = Literal["new", WireStatusName]
ErrorCodeName = Literal[
    "bad_request",
    "unauthorized",
    "not_found",
    "conflict",
    "too_large",
    "overloaded",
    "engine_unavailable",
    "internal",
]


# --- server -> client messages ----------------------------------------------------
# Typed maps, not classes: the server builds them (wsinfer/messages.py) and encodes
# them as they are, one per frame, with nothing converted on the way; the Python
# client checks what it receives against them. Every ``type`` and every closed field
# is a Literal, so a misspelt type, status, finish reason or code is a type error
# (also in a comparison: mypy's strict equality). Optional fields sit in a
# ``total=False`` base, which works on every Python the package supports.


class _Answer(TypedDict, total=False):
    id: str | int  # the request's ``id``, echoed when it had one


class SessionMessage(_Answer):
    type: Literal["session"]
    session: str
    token: str
    turn: int
    status: WireStatusName


class _DeltaExtras(TypedDict, total=False):
    logprobs: list[dict[str, Any]]  # with params.logprobs: one entry per token of ``text``
    tool_calls: list[dict[str, Any]]  # with params.tools: the calls this delta completes
    # A turn held to its calls: the parts of calls drawn here (OpenAI's streamed shape).
    tool_call_parts: list[dict[str, Any]]


class DeltaMessage(_DeltaExtras):
    type: Literal["delta"]
    session: str
    turn: int
    seq: int
    text: str


class PausedMessage(TypedDict):
    type: Literal["paused"]
    session: str
    turn: int
    seq: int


class UsageFields(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class ErrorFields(TypedDict):
    """A ``done``'s ``error``: why the turn ended with ``finish_reason: error``."""

    code: ErrorCodeName
    message: str


class _DoneExtras(TypedDict, total=False):
    error: ErrorFields


class DoneMessage(_DoneExtras):
    type: Literal["done"]
    session: str
    turn: int
    seq: int
    finish_reason: FinishReasonName
    usage: UsageFields


class _ErrorExtras(_Answer, total=False):
    session: str
    retry_after: float


class ErrorMessage(_ErrorExtras):
    type: Literal["error"]
    code: ErrorCodeName
    message: str


ServerMessage = SessionMessage | DeltaMessage | PausedMessage | DoneMessage | ErrorMessage
# What follows a turn (sent to its followers), as against answers to requests.
TurnMessage = DeltaMessage | PausedMessage | DoneMessage


class CloseCode:
    """WebSocket close codes with a meaning of ours (IANA's registry)."""

    # Drain: the client should reconnect, through the load balancer, and resume.
    SERVICE_RESTART = 1012


# A generate's idempotency key, as both clients make it: random, this many hex
# characters (the server takes 16 to 128 characters).
IDEMPOTENCY_KEY_HEX = 32
