"""Typed messages shared by the frontend and the engine, and their Redis encoding.

Every message that crosses Redis between the two sides is defined here, and
encoded or decoded here only (msgpack in one stream field, ``m``), so the two
sides cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import msgpack

FinishReason = Literal["stop", "length", "cancelled", "error"]

# Bounds that keep one request from hurting everybody else.
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 64
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01


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
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["stop"] = list(self.stop)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GenerationParams:
        raw = dict(raw)
        raw["stop"] = tuple(raw.get("stop") or ())
        return cls(**raw)


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


_PARAM_CHECKS: dict[str, Any] = {
    "max_new_tokens": _int_in(1, MAX_NEW_TOKENS_LIMIT, "max_new_tokens"),
    "temperature": _temperature,
    "top_p": _float_in(0.0, 1.0, "top_p", open_low=True),
    "top_k": _int_in(0, 1_000_000, "top_k"),
    # Dividing logits by a tiny penalty overflows them to inf, and sampling
    # then draws NaN: the floor keeps every logit finite.
    "repetition_penalty": _float_in(MIN_REPETITION_PENALTY, 10.0, "repetition_penalty"),
    "seed": _seed,
    "stop": _stop,
}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


# --- work items: frontend -> engines (requests stream) ----------------------


@dataclass(frozen=True)
class TurnRequest:
    """Ask an engine to run (or continue) turn ``turn`` of session ``session``.

    Duplicates are harmless: the engine's claim only succeeds while the turn is
    queued (or its previous engine's lease has expired).
    """

    session: str
    turn: int


# --- control: frontend -> the engine running a turn --------------------------

ControlAction = Literal["stop", "pause"]


@dataclass(frozen=True)
class Control:
    session: str
    turn: int
    action: ControlAction


# --- turn stream events: engine -> frontends (one stream per turn) -----------


@dataclass(frozen=True)
class DeltaEvent:
    seq: int
    text: str
    tokens: list[int] = field(default_factory=list)
    kind: Literal["delta"] = "delta"


@dataclass(frozen=True)
class PausedEvent:
    seq: int
    kind: Literal["paused"] = "paused"


@dataclass(frozen=True)
class DoneEvent:
    seq: int
    finish_reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    error: dict[str, str] | None = None
    kind: Literal["done"] = "done"


TurnEvent = DeltaEvent | PausedEvent | DoneEvent


def as_str(value: Any) -> str:
    """Redis replies come as bytes (or str with decode_responses): text either way."""
    return value.decode() if isinstance(value, bytes) else str(value)


def encode(message: Any) -> dict[str, bytes]:
    """Encode a schema dataclass as the fields of one Redis stream entry."""
    if type(message) is DeltaEvent:  # one per token: asdict's deep copy was a quarter of
        # an engine's publishing time under fan-out load; the same map, built directly.
        data: Any = {"seq": message.seq, "text": message.text, "tokens": message.tokens}
        data["kind"] = "delta"
    else:
        data = asdict(message)
    return {"m": msgpack.packb(data, use_bin_type=True)}


def _decode_fields(fields: dict[Any, Any]) -> dict[str, Any]:
    raw = fields.get(b"m", fields.get("m"))
    if raw is None:
        raise ValueError("stream entry has no 'm' field")
    data = msgpack.unpackb(raw, raw=False)
    if not isinstance(data, dict):
        raise ValueError("stream entry is not a map")
    return data


def decode_event(fields: dict[Any, Any]) -> TurnEvent:
    data = _decode_fields(fields)
    kind = data.pop("kind")
    if kind == "delta":
        return DeltaEvent(**data)
    if kind == "paused":
        return PausedEvent(**data)
    if kind == "done":
        data["usage"] = Usage(**data.get("usage") or {})
        return DoneEvent(**data)
    raise ValueError(f"unknown turn event kind {kind!r}")


def decode_request(fields: dict[Any, Any]) -> TurnRequest:
    return TurnRequest(**_decode_fields(fields))


def decode_control(fields: dict[Any, Any]) -> Control:
    return Control(**_decode_fields(fields))
