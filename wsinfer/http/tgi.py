"""Hugging Face Text Generation Inference's native API, sans I/O: requests in, JSON and SSE out.

A TGI request (``{"inputs", "parameters"}``) is a raw-text wsinfer session's turn
(the WebSocket ``generate`` with ``prompt``), checked by the OpenAI door's own
helpers and the WebSocket parser (``wsinfer.messages``): the same fields, limits
and refusals, only TGI's names. What this module adds is the translation:
TGI's parameter names and defaults (greedy unless sampling is asked), its stream
events (``{index, token, generated_text, details}``), its whole answer, and its
errors (``{"error", "error_type"}``, a validation error being 422).

The session protocol carries no token ids: every ``token.id`` is ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wsinfer.contract import DeltaMessage, DoneMessage, ServerMessage
from wsinfer.http.openai import (
    OpenAIError,
    as_generate,
    bad_request,
    check_fields,
    failure,
    flag,
    json_object,
    sse,
    sse_comment,
)
from wsinfer.messages import Generate, Limits
from wsinfer.sessions.schema import GenerationParams

# TGI's parameters that are wsinfer's under the same name, checked by its rules.
SAMPLING = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "typical_p",
        "repetition_penalty",
        "seed",
        "stop",
    }
)
FLAGS = frozenset({"details", "do_sample", "return_full_text"})
# Accepted only at the value that turns the feature off: wsinfer cannot honour them.
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "decoder_input_details": (None, False),  # no prompt log-probabilities
    "frequency_penalty": (None, 0, 0.0),
    "truncate": (None,),  # it would cut the prompt, which wsinfer refuses to do
    "watermark": (None, False),
    "grammar": (None,),
    "adapter_id": (None, ""),
    "top_n_tokens": (None, 0),
}
# TGI samples at temperature 1 when it samples; a wsinfer turn's default is 0.7.
SAMPLING_TEMPERATURE = 1.0


class TgiError(Exception):
    """A refused request or a failed turn, as TGI reports it."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        return {"error": self.message, "error_type": self.error_type}

    @classmethod
    def from_openai(cls, exc: OpenAIError) -> TgiError:
        """The OpenAI door's refusal in TGI's names: a bad request is TGI's 422
        ``validation``, a full queue its 429 ``overloaded``; the rest keep their
        status, and the protocol's error code as their type."""
        if exc.status == 400:
            return cls(422, exc.message, "validation", exc.headers())
        if exc.status == 429:
            return cls(429, exc.message, "overloaded", exc.headers())
        return cls(exc.status, exc.message, exc.code or "unknown", exc.headers())


def turn_failure(message: ServerMessage) -> TgiError | None:
    """The error a protocol message ends a turn's answer with, if any: a turn that
    failed by the client's fault (a prompt over the context) is ``validation``, one
    that failed by ours TGI's 424 ``generation``."""
    failed = failure(message)
    if failed is None:
        return None
    if message["type"] != "done":
        return TgiError.from_openai(failed)
    if failed.status < 500:
        return TgiError(422, failed.message, "validation")
    return TgiError(424, failed.message, "generation")


# --- requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class TgiRequest:
    generate: Generate
    stream: bool
    details: bool
    full_text: bool  # return_full_text: the prompt before the generated text
    inputs: str


def parse_tgi_request(
    body: bytes,
    limits: Limits,
    session: str | None,
    token: str | None,
    stream: bool | None = None,
) -> TgiRequest:
    """A TGI body as a ``generate`` with a ``prompt``; ``stream`` is the route's
    (None: the body's ``stream``, as TGI's ``POST /``). Raises ``OpenAIError``."""
    data = json_object(body)
    check_fields(data, {"inputs", "parameters", "stream"}, {}, frozenset())
    inputs = data.get("inputs")
    if not isinstance(inputs, str):
        raise bad_request("inputs must be a string", "inputs")
    raw = data.get("parameters")
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise bad_request("parameters must be an object", "parameters")
    check_fields(raw, set(SAMPLING | FLAGS), OFF_VALUES, frozenset())
    details = flag(raw, "details")
    params = {k: v for k, v in raw.items() if k in SAMPLING and v is not None}
    if not (flag(raw, "do_sample") or _warped(params)):
        params["temperature"] = 0.0  # TGI's default: greedy
    else:
        params.setdefault("temperature", SAMPLING_TEMPERATURE)
    if details:
        params["logprobs"] = True
    generate = {"type": "generate", "prompt": inputs, "params": params}
    turn = as_generate(generate, limits, session, token)
    streamed = flag(data, "stream") if stream is None else stream
    return TgiRequest(turn, streamed, details, flag(raw, "return_full_text"), inputs)


def _warped(params: dict[str, Any]) -> bool:
    """Whether TGI samples although ``do_sample`` is false: a temperature, top-k,
    top-p or typical-p that changes the distribution (TGI's ``has_warpers``)."""
    return (
        params.get("temperature", 1.0) != 1.0
        or params.get("top_k", 0) != 0
        or params.get("top_p", 1.0) != 1.0
        or params.get("typical_p", 1.0) != 1.0
    )


# --- answers --------------------------------------------------------------------------


def finish_reason(reason: str, stops: tuple[str, ...]) -> str:
    """TGI's name for a turn's end. wsinfer's ``stop`` is an end-of-sequence token or
    a stop string, not told apart: with stop strings asked it reads ``stop_sequence``.
    A turn a client stopped (``cancelled``) ended its text there: ``eos_token``."""
    if reason == "length":
        return "length"
    if reason == "stop" and stops:
        return "stop_sequence"
    return "eos_token"


@dataclass
class TgiTurn:
    """What every answer of one turn shares: how to end it, and its text so far.

    ``before`` is the text a resumed stream's client already had (the deltas up to
    where it resumes), so that the last event's ``generated_text`` is the whole."""

    details: bool
    prefix: str  # the prompt, with return_full_text
    params: GenerationParams
    before: str = ""
    _text: list[str] = field(default_factory=list)

    @property
    def seed(self) -> int | None:
        """The seed a sampled turn draws with, as the request gave it (wsinfer does not
        report one it chose); None for a greedy turn, as TGI's."""
        return None if self.params.greedy else self.params.seed

    def token_event(self, message: DeltaMessage) -> dict[str, Any]:
        """One delta as a TGI stream event: ``index`` is its ``seq`` (the tokens
        generated once it is applied), ``logprob`` the sum over its tokens (exactly
        the token's when, as for a reader that keeps up, a delta is one token)."""
        self._text.append(message["text"])
        entries = message.get("logprobs")
        logprob = sum(e["logprob"] for e in entries) if entries else None
        token = {"id": None, "text": message["text"], "logprob": logprob, "special": False}
        return _event(message["seq"], token, None, None)

    def last_event(self, done: DoneMessage) -> dict[str, Any]:
        """The closing event: the ``done`` brings no token, so an empty special one
        carries the whole ``generated_text`` and the ``details``."""
        token = {"id": None, "text": "", "logprob": None, "special": True}
        details = None
        if self.details:
            usage = done["usage"]
            details = {
                "finish_reason": finish_reason(done["finish_reason"], self.params.stop),
                "generated_tokens": usage["completion_tokens"],
                "input_length": usage["prompt_tokens"],
                "seed": self.seed,
            }
        return _event(done["seq"], token, self.generated_text(), details)

    def generated_text(self, text: str | None = None) -> str:
        return self.prefix + self.before + ("".join(self._text) if text is None else text)

    def sse_for(self, message: ServerMessage) -> bytes:
        """The SSE bytes of one outgoing protocol message; b"" for none. Each event's
        ``id`` is its ``seq``, what ``Last-Event-ID`` sends back to resume."""
        failed = turn_failure(message)
        if failed is not None:
            return sse(failed.body())
        if message["type"] == "delta":
            return sse(self.token_event(message), message["seq"])
        if message["type"] == "paused":
            return sse_comment(f"paused at seq {message['seq']}")
        if message["type"] == "done":
            return sse(self.last_event(message), message["seq"])
        return b""

    def whole(self, text: str, done: DoneMessage, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streaming answer: the text, and with ``details`` every token's
        text and log-probability (no prompt tokens: ``prefill`` is empty)."""
        answer: dict[str, Any] = {"generated_text": self.generated_text(text)}
        if self.details:
            usage = done["usage"]
            answer["details"] = {
                "finish_reason": finish_reason(done["finish_reason"], self.params.stop),
                "generated_tokens": usage["completion_tokens"],
                "seed": self.seed,
                "prefill": [],
                "tokens": [_token(e) for e in entries],
                "top_tokens": None,
                "best_of_sequences": None,
            }
        return answer


def _event(
    index: int, token: dict[str, Any], text: str | None, details: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "index": index,
        "token": token,
        "top_tokens": None,
        "generated_text": text,
        "details": details,
    }


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    return {"id": None, "text": entry["token"], "logprob": entry["logprob"], "special": False}
