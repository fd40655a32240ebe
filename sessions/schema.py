"""The turn record: everything the frontend and the engine exchange through Redis.

Every message that crosses Redis between the two sides is defined here, and
encoded or decoded here only (msgpack in one stream field, ``m``; the Lua
scripts receive events already encoded), so the two sides cannot drift apart:
the settings both sides must agree on, a turn's input, the work items, the
turn stream's events, the errors they carry, and the session's meta hash.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Literal, TypeVar

import msgpack

from wsinfer import response_format
from wsinfer import tools as tool_calling
from wsinfer.contract import ErrorCode, ErrorFields, FinishReasonName, Usage
from wsinfer.sessions import keys

# Settings every process that writes session keys shares. A session records
# its TTL when it is created, and every later write (a turn, a publish, a
# touch) renews its keys with that TTL, whatever process makes it.
DEFAULT_SESSION_TTL_S = 3600
# How long a closed session's last stream stays, so followers see its end.
CLOSE_LINGER_S = 30
# An engine whose last heartbeat is older than this is not routed to.
ENGINE_FRESH_S = 5.0

# Bounds that keep one request from hurting everybody else.
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 64
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


class ParamsError(ValueError):
    """A generation parameter is missing, unknown or out of range."""


@dataclass(frozen=True)
class GenerationParams:
    """Sampling parameters of one turn (protocol ``params``)."""

    max_new_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    # OpenAI's penalties on the tokens this turn has generated: a token's logit loses
    # presence_penalty once it has appeared and frequency_penalty per appearance.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Locally typical sampling (transformers' TypicalLogitsWarper): only the most
    # typical tokens, covering this much probability, race; 1 is off.
    typical_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The end-of-sequence token does not end the turn (it is sampled and passed on as
    # any token): every turn runs to max_new_tokens, as benchmark clients want.
    ignore_eos: bool = False
    # No end-of-sequence token is drawn before this many tokens (its logits are
    # masked); stop strings still end the turn. vLLM's min_tokens.
    min_tokens: int = 0
    # Report each drawn token's log-probability under the model (before temperature,
    # penalties and top-k/top-p), and the top_logprobs most likely tokens beside it.
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured output: the checked response_format as canonical JSON (None: free
    # text). Clients send OpenAI's object; wsinfer/response_format.py checks it.
    response_format: str | None = None
    # Tool calling (wsinfer/tools.py): the checked tools as canonical JSON, the
    # choice (none, auto, required or function:NAME; None is auto), and whether a
    # turn may make several calls.
    tools: str | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_tokens(self) -> bool:
        """A draw needs the counts of the turn's generated tokens (OpenAI's penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def calls_tools(self) -> bool:
        """The model is told of tools and its calls are read from its text."""
        return self.tools is not None and self.tool_choice != "none"

    @classmethod
    def parse(cls, raw: Any) -> GenerationParams:
        """Validate client-supplied params; unknown keys are an error."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ParamsError("params must be an object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise ParamsError(f"unknown params: {', '.join(unknown)}")
        values = {name: _PARAM_CHECKS[name](raw[name]) for name in raw}
        params = cls(**values)
        if params.min_tokens > params.max_new_tokens:
            raise ParamsError("min_tokens must not be above max_new_tokens")
        if params.top_logprobs and not params.logprobs:
            raise ParamsError("top_logprobs needs logprobs: true")
        if params.response_format is not None and params.min_tokens:
            # A finished document allows only the end of the sequence, which min_tokens
            # forbids: no token would be left to draw.
            raise ParamsError("min_tokens cannot be combined with a response_format")
        params._check_tools()
        return params

    def _check_tools(self) -> None:
        _as_params_error(tool_calling.check_choice)(self.tools, self.tool_choice)
        forced = self.tool_format
        if forced is None:
            return
        if self.response_format is not None:
            raise ParamsError("a tool_choice that requires a call excludes a response_format")
        if self.min_tokens:
            raise ParamsError(
                "min_tokens cannot be combined with a tool_choice that requires a call"
            )
        _as_params_error(tool_calling.check_grammar)(forced)

    @property
    def tool_format(self) -> str | None:
        """The grammar format of a tool_choice that requires a call (None: free)."""
        return tool_calling.call_format(self.tools, self.tool_choice, self.parallel_tool_calls)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        defaults = {f.name: f.default for f in fields(self)}
        for name in _LEFT_OUT_AT_DEFAULT:
            if out[name] == defaults[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationParams:
        raw = dict(raw)
        raw["stop"] = tuple(raw.get("stop") or ())
        return cls(**raw)


# Fields added after the first release, left out of a turn record at their default:
# an engine from before them reads every turn that does not use them as ever (a
# rolling upgrade).
_LEFT_OUT_AT_DEFAULT = (
    "presence_penalty",
    "frequency_penalty",
    "typical_p",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)


def _int_in(lo: int, hi: int, name: str) -> Any:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ParamsError(f"{name} must be an integer in [{lo}, {hi}]")
        return value

    return check


def _float_in(lo: float, hi: float, name: str, *, open_low: bool = False) -> Any:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{name} must be a number")
        number = float(value)
        too_low = number <= lo if open_low else number < lo
        if not math.isfinite(number) or too_low or number > hi:
            bracket = "(" if open_low else "["
            raise ParamsError(f"{name} must be in {bracket}{lo}, {hi}]")
        return number

    return check


def _flag(name: str) -> Any:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{name} must be true or false")
        return value

    return check


def _temperature(value: Any) -> float:
    """0 (greedy) or [MIN_TEMPERATURE, 5]: below that, logits / temperature overflow."""
    number = float(_float_in(0.0, 5.0, "temperature")(value))
    if 0.0 < number < MIN_TEMPERATURE:
        raise ParamsError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 5.0]")
    return number


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    return int(_int_in(0, 2**63 - 1, "seed")(value))


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise ParamsError(f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
    for item in value:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_STRING_CHARS:
            raise ParamsError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} chars")
    return tuple(value)


T = TypeVar("T")


def _as_params_error(check: Callable[..., T]) -> Callable[..., T]:
    """``check`` with its refusal (a malformed format or tool) as a ``ParamsError``."""

    def checked(*args: Any) -> T:
        try:
            return check(*args)
        except (response_format.ResponseFormatError, tool_calling.ToolsError) as exc:
            raise ParamsError(str(exc)) from exc

    return checked


def _tool_choice(value: Any) -> str | None:
    return None if value is None else tool_calling.canonical_choice(value)


_PARAM_CHECKS: dict[str, Any] = {
    "max_new_tokens": _int_in(1, MAX_NEW_TOKENS_LIMIT, "max_new_tokens"),
    "temperature": _temperature,
    "top_p": _float_in(0.0, 1.0, "top_p", open_low=True),
    "top_k": _int_in(0, 1_000_000, "top_k"),
    # Dividing logits by a tiny penalty overflows them to inf, and sampling
    # then draws NaN: the floor keeps every logit finite.
    "repetition_penalty": _float_in(MIN_REPETITION_PENALTY, 10.0, "repetition_penalty"),
    "presence_penalty": _float_in(-2.0, 2.0, "presence_penalty"),
    "frequency_penalty": _float_in(-2.0, 2.0, "frequency_penalty"),
    "typical_p": _float_in(0.0, 1.0, "typical_p", open_low=True),
    "seed": _seed,
    "stop": _stop,
    "ignore_eos": _flag("ignore_eos"),
    "min_tokens": _int_in(0, MAX_NEW_TOKENS_LIMIT, "min_tokens"),
    "logprobs": _flag("logprobs"),
    "top_logprobs": _int_in(0, MAX_TOP_LOGPROBS, "top_logprobs"),
    "response_format": _as_params_error(response_format.canonical),
    "tools": _as_params_error(tool_calling.canonical_tools),
    "tool_choice": _as_params_error(_tool_choice),
    "parallel_tool_calls": _flag("parallel_tool_calls"),
}


@dataclass(frozen=True)
class TurnInput:
    """What a client asked for in one ``generate``: the engine renders it."""

    mode: str  # "chat" (messages) or "text" (prompt)
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: GenerationParams

    def pack(self) -> bytes:
        data = {
            "mode": self.mode,
            "messages": self.messages,
            "prompt": self.prompt,
            "params": self.params.to_dict(),
        }
        return bytes(msgpack.packb(data, use_bin_type=True))

    @classmethod
    def unpack(cls, raw: bytes) -> TurnInput:
        data = msgpack.unpackb(raw, raw=False)
        data["params"] = GenerationParams.from_dict(data["params"])
        return cls(**data)


class Control(str, Enum):
    """A turn's ``control`` flag (a meta-hash field): what a client asked of the
    engine running the turn, which acts on it between steps. The ``CONTROL``
    script writes it from its ``control:<value>`` effect; a requeue clears it."""

    NONE = ""
    STOP = "stop"
    PAUSE = "pause"

    @classmethod
    def of(cls, value: str) -> Control:
        """The flag ``value`` names; one this version does not know asks nothing."""
        try:
            return cls(value)
        except ValueError:
            return cls.NONE


@dataclass(frozen=True)
class SessionMeta:
    """A session's meta hash (``keys.meta``), typed.

    The attribute names are the hash's field names, the ones the Lua scripts
    read and write (a test holds the scripts to this list). Fields this
    version does not know (written by a newer one) are ignored, and so are
    the per-turn fields ``idem:<key hash>`` (the turn an idempotency key
    started) and ``created:<turn>`` (when a turn started), read by name.
    """

    token: str = ""  # sha256 of the owner's token
    mode: str = ""  # chat | text, fixed by the first turn
    created: float = 0.0
    ttl: int = DEFAULT_SESSION_TTL_S  # seconds the keys live after each write
    turn: int = 0  # the latest turn; the status below is its status
    status: str = ""
    seq: int = 0  # the last event's seq in the latest turn's stream
    control: str = ""  # a Control: stop | pause, asked of the engine running the turn
    finish: str = ""  # the latest turn's finish_reason, once it has a done ('' before)
    engine: str = ""  # the engine running the turn ('' when none)
    epoch: int = 0  # bumped by every claim: fences an engine taken over
    claimed_at: float = 0.0
    pub: int = 0  # publishes since the claim (retries are idempotent)
    seen_at: float = 0.0  # last time a client watched the session (idle pause)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    kv_engine: str = ""  # the engine holding the session's KV cache
    kv_len: int = 0
    # Redis time (s) a publish last pushed back the keys' expiry: a running
    # turn renews it every ttl/16 s, not on every delta (sessions/scripts.py).
    renewed_at: int = 0
    # The latest turn's queued episode ('turn:epoch') a frontend following it first
    # saw, and when: a turn queued too long unclaimed gets its work item again.
    queued_mark: str = ""
    queued_seen: float = 0.0

    @classmethod
    def from_hash(cls, raw: dict[Any, Any]) -> SessionMeta:
        known = cls.__dataclass_fields__
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = as_str(key)
            if name in known:
                values[name] = _META_TYPES[str(known[name].type)](as_str(value))
        return cls(**values)

    def counters(self) -> str:
        """What a pre-encoded cancel or pause event was computed from; the
        scripts refuse to write it (``moved``) if the hash says otherwise."""
        return f"{self.turn}:{self.seq}:{self.prompt_tokens}:{self.cached_tokens}"

    def cancelled(self) -> DoneEvent:
        """The ``done`` that ends this turn without an engine (a stop, a close)."""
        usage = Usage(self.prompt_tokens, self.seq, self.cached_tokens)
        return DoneEvent(self.seq, "cancelled", usage)


# The hash holds text; an empty number is a field some script cleared.
_META_TYPES: dict[str, Any] = {
    "str": str,
    "int": lambda text: int(float(text or 0)),
    "float": lambda text: float(text or 0),
}


@dataclass(frozen=True)
class TurnError:
    """Why a turn ended with ``finish_reason: error``: the code is chosen where
    the error happens (the engine core, the engine process) and travels as is."""

    code: ErrorCode
    message: str

    def to_dict(self) -> ErrorFields:
        return {"code": self.code.value, "message": self.message}


# --- work items: frontend -> engines (requests stream) ----------------------


@dataclass(frozen=True)
class TurnRequest:
    """Ask an engine to run (or continue) turn ``turn`` of session ``session``.

    Duplicates are harmless: the engine's claim only succeeds while the turn is
    queued (or its previous engine's lease has expired).
    """

    session: str
    turn: int


# --- turn stream events: engine -> frontends (one stream per turn) -----------


@dataclass(frozen=True)
class DeltaEvent:
    seq: int
    text: str
    tokens: list[int] = field(default_factory=list)
    kind: Literal["delta"] = "delta"
    # With params.logprobs: one entry per content token of ``tokens`` (an end-of-sequence
    # token is none), in OpenAI's chat shape: {"token", "logprob", "bytes", "top_logprobs"}.
    logprobs: list[dict[str, Any]] | None = None
    # A turn with tools: ``text`` is its content (calls taken out), ``raw`` what the
    # model wrote where that differs (the conversation's next prompt renders it),
    # ``tool_calls`` the calls completed here, in OpenAI's shape, and
    # ``tool_call_parts`` the parts of calls drawn here (a turn held to its calls:
    # docs/protocol.md "Tool calling").
    raw: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_parts: list[dict[str, Any]] | None = None

    @property
    def model_text(self) -> str:
        return self.text if self.raw is None else self.raw

    @property
    def reaches_readers(self) -> bool:
        """Whether a reader is sent this delta: it has text, calls or parts of calls
        (the rest, tokens whose text is held back, only move ``seq`` on). The doors
        that count their events count these."""
        return bool(self.text or self.tool_calls or self.tool_call_parts)


@dataclass(frozen=True)
class PausedEvent:
    seq: int
    kind: Literal["paused"] = "paused"


@dataclass(frozen=True)
class DoneEvent:
    seq: int
    finish_reason: FinishReasonName
    usage: Usage = field(default_factory=Usage)
    error: TurnError | None = None
    kind: Literal["done"] = "done"


TurnEvent = DeltaEvent | PausedEvent | DoneEvent


def as_str(value: Any) -> str:
    """Redis replies come as bytes (or str with decode_responses): text either way."""
    return value.decode() if isinstance(value, bytes) else str(value)


def engine_group_lag(groups: list[dict[Any, Any]]) -> int | None:
    """From an XINFO GROUPS reply: the entries the engines' consumer group has
    not read yet (turns no engine has taken), or None if it has no such group."""
    for group in groups:
        if as_str(group["name"]) == keys.ENGINE_GROUP:
            return int(group.get("lag") or 0)
    return None


def encode(message: Any) -> dict[Any, Any]:
    """Encode a schema dataclass as the fields of one Redis stream entry
    (typed as redis-py's field maps are: any key, any value)."""
    return {"m": pack(message)}


def pack(message: Any) -> bytes:
    """The msgpack payload of a stream entry (what the Lua scripts write)."""
    if type(message) is DeltaEvent:  # one per token: asdict's deep copy was a quarter of
        # an engine's publishing time under fan-out load; the same map, built directly.
        data: Any = {"seq": message.seq, "text": message.text, "tokens": message.tokens}
        data["kind"] = "delta"
        if message.logprobs is not None:
            data["logprobs"] = message.logprobs
        if message.raw is not None:
            data["raw"] = message.raw
        if message.tool_calls is not None:
            data["tool_calls"] = message.tool_calls
        if message.tool_call_parts is not None:
            data["tool_call_parts"] = message.tool_call_parts
    else:
        data = asdict(message)
        if isinstance(message, DoneEvent) and message.error is not None:
            data["error"] = message.error.to_dict()
    return bytes(msgpack.packb(data, use_bin_type=True))


def _decode_fields(fields: dict[Any, Any] | None) -> dict[str, Any]:
    return _unpack_map(entry_payload(fields))


def _unpack_map(raw: bytes | None) -> dict[str, Any]:
    if raw is None:
        raise ValueError("stream entry has no 'm' field")
    data = msgpack.unpackb(raw, raw=False)
    if not isinstance(data, dict):
        raise ValueError("stream entry is not a map")
    return data


def entry_payload(fields: dict[Any, Any] | list[Any] | None) -> bytes | None:
    """A stream entry's packed ``m`` field, from its fields as redis-py parses
    them (a dict) or as Redis sends them (``[b"m", payload]``: the fan-in's hot
    path reads replies without redis-py's per-entry dict)."""
    if isinstance(fields, dict):
        return fields.get(b"m", fields.get("m"))
    if fields and len(fields) == 2 and fields[0] in (b"m", "m"):
        return fields[1]  # type: ignore[no-any-return]
    return None


def decode_event(fields: dict[Any, Any] | None) -> TurnEvent:
    return decode_event_payload(entry_payload(fields))


_DELTA_FIELDS = frozenset(DeltaEvent.__dataclass_fields__) - {"kind"}


def decode_event_payload(raw: bytes | None) -> TurnEvent:
    """An event from its packed ``m`` field."""
    data = _unpack_map(raw)
    kind = data.pop("kind")
    if kind == "delta":
        if not data.keys() <= _DELTA_FIELDS:  # a later engine's: what this one knows
            data = {k: v for k, v in data.items() if k in _DELTA_FIELDS}
        return DeltaEvent(**data)
    if kind == "paused":
        return PausedEvent(**data)
    if kind == "done":
        data["usage"] = Usage(**data.get("usage") or {})
        error = data.get("error")
        if error is not None:
            data["error"] = TurnError(ErrorCode(error["code"]), str(error["message"]))
        return DoneEvent(**data)
    raise ValueError(f"unknown turn event kind {kind!r}")


def decode_request(fields: dict[Any, Any]) -> TurnRequest:
    return TurnRequest(**_decode_fields(fields))
