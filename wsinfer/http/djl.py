"""DJL Serving's streaming predictions (``/predictions/{name}``, ``/invocations``), sans I/O.

A request ``{"inputs": str | [str, ...], "parameters": {...}}`` is one
raw-text session's turn per input (the WebSocket ``generate`` with
``prompt``), each checked by the OpenAI door's helpers and the WebSocket parser
(``wsinfer.messages``): the same rules and limits. What this module adds is
DJL's parameter names and defaults (Hugging Face's: greedy unless
``do_sample``), its stream (JSON lines, one per iteration, ``{"output_tokens":
[the text each input got]}``) and its errors (``{"code", "type", "message"}``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from wsinfer.http.choices import _choice
from wsinfer.http.counted import DoorError
from wsinfer.http.openai import (
    MAX_CHOICES,
    as_generate,
    bad_request,
    check_fields,
    flag,
    json_object,
)
from wsinfer.messages import Generate, Limits

# DJL's names for wsinfer's parameters (manual_seed: the seed of the draws).
SAMPLING = {
    "max_new_tokens": "max_new_tokens",
    "repetition_penalty": "repetition_penalty",
    "top_p": "top_p",
    "top_k": "top_k",
    "typical_p": "typical_p",
    "temperature": "temperature",
    "manual_seed": "seed",
}
SAMPLING_TEMPERATURE = 1.0  # a sampled turn's, when none is given (Hugging Face's)
MAX_INPUTS = MAX_CHOICES  # a batch is a session per input, as n choices are
# DJL's exception names, by status.
TYPES = {
    400: "BadRequestException",
    401: "UnauthorizedException",
    404: "NotFoundException",  # a session (a model is ModelNotFoundException)
    409: "ConflictException",
    429: "ServiceUnavailableException",
    503: "ServiceUnavailableException",
}


class DjlError(DoorError):
    """A refused request or a failed turn, as DJL Serving reports it."""

    def body(self) -> dict[str, Any]:
        kind = TYPES.get(self.status, "InternalServerException")
        if self.code == "model_not_found":
            kind = "ModelNotFoundException"
        return {"code": self.status, "type": kind, "message": self.message}


def not_found(name: str) -> DjlError:
    return DjlError(404, f"Model not found: {name[:64]}", "model_not_found")


@dataclass(frozen=True)
class DjlRequest:
    generates: list[Generate]  # one per input, in order


def parse_djl_request(
    body: bytes, limits: Limits, session: str | None, token: str | None
) -> DjlRequest:
    """A DJL body as one ``generate`` per input; a seed is offset by the input's
    index, so that a batch's inputs draw as that many separate requests would.
    Raises ``OpenAIError`` or ``DjlError``."""
    data = json_object(body)
    check_fields(data, {"inputs", "parameters"}, {}, frozenset())
    inputs = data.get("inputs")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise bad_request("inputs must be a string or a non-empty list of strings", "inputs")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs in one request", "inputs")
    if len(inputs) > 1 and (session or token):
        raise bad_request("a batch starts a session per input: it cannot continue one", "inputs")
    params = _params(data.get("parameters"))
    generates = []
    for index, prompt in enumerate(inputs):
        generate = {"type": "generate", "prompt": prompt, "params": dict(params)}
        generates.append(_choice(as_generate(generate, limits, session, token), index))
    return DjlRequest(generates)


def _params(raw: Any) -> dict[str, Any]:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise bad_request("parameters must be an object", "parameters")
    check_fields(raw, {*SAMPLING, "do_sample"}, {}, frozenset())
    params = {SAMPLING[k]: v for k, v in raw.items() if k in SAMPLING and v is not None}
    if flag(raw, "do_sample"):
        params.setdefault("temperature", SAMPLING_TEMPERATURE)
    else:
        params["temperature"] = 0.0  # Hugging Face's generate: greedy unless sampling
    return params


def line(texts: list[str]) -> bytes:
    """One iteration: the text each input got in it ("" for one that has ended)."""
    return json.dumps({"output_tokens": texts}, ensure_ascii=False).encode() + b"\n"


def error_line(error: DoorError) -> bytes:
    return json.dumps(error.body(), ensure_ascii=False).encode() + b"\n"
