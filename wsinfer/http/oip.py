"""The Open Inference Protocol v2 (KServe, MLServer, Seldon Core 2) over REST, sans I/O.

An inference request's one string input is a wsinfer turn: a ``prompt`` (or
``text_input``) is a raw-text session's prompt, ``messages`` a chat's. The
strings come as MLServer's ``StringCodec`` and ``tritonclient`` send them: a
``BYTES`` tensor, its ``data`` a JSON list, or raw bytes after the JSON header
(the binary tensor extension: ``Inference-Header-Content-Length``, and each
element a little-endian 4-byte length and its bytes). The request's
``parameters`` are the turn's sampling parameters, checked by the OpenAI door's
helpers and the WebSocket parser (``wsinfer.messages``): the same rules and
limits. What this module adds is the tensors, the responses and the errors
(the protocol's ``{"error": message}``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from wsinfer.contract import DeltaMessage, DoneMessage
from wsinfer.http.counted import DoorError
from wsinfer.http.openai import (
    OpenAIError,
    as_generate,
    bad_request,
    check_fields,
    json_object,
)
from wsinfer.messages import Generate, Limits

PROMPT_INPUTS = frozenset({"prompt", "text_input"})
CHAT_INPUT = "messages"
OUTPUT = "text_output"
# The request's parameters that are a turn's, by the v2 names MLServer's LLM
# runtimes read (max_tokens) and by wsinfer's.
SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_tokens",
}
# Set by the clients themselves, and answered as they allow: outputs come back as
# JSON data (which tritonclient reads as well as binary); content_type and headers
# are MLServer's request metadata.
IGNORED = frozenset({"binary_data_output", "content_type", "headers"})
TENSOR_FIELDS = {"name", "shape", "datatype", "parameters", "data"}
BINARY_SIZE = "binary_data_size"
# TensorRT-LLM's generate fields, accepted where they ask for nothing.
FLAT_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "bad_words": (None, "", []),
    "stop_words": (None, "", []),
}


class OipError(DoorError):
    """A refused request or a failed turn, as the v2 protocol reports it."""

    def body(self) -> dict[str, Any]:
        return {"error": self.message}


def not_found(name: str) -> OipError:
    return OipError(404, f"Model {name[:64]!r} not found", "model_not_found")


@dataclass(frozen=True)
class OipRequest:
    generate: Generate
    id: str | None
    shape: list[int]  # the input's, given back to the output
    flat: bool = False  # Triton's generate extension: no tensors, text_output a field


def parse_infer_request(
    body: bytes,
    header_length: str | None,
    limits: Limits,
    session: str | None,
    token: str | None,
) -> OipRequest:
    """An inference request as a ``generate``. Raises ``OpenAIError`` (a field the
    shared checks refuse) or ``OipError``."""
    head, binary = _split(body, header_length)
    data = json_object(head)
    if "inputs" not in data and "text_input" in data and not binary:
        return _flat_request(data, limits, session, token)
    check_fields(data, {"id", "parameters", "inputs", "outputs"}, {}, frozenset())
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("id must be a string", "id")
    _check_outputs(data.get("outputs"))
    tensor = _one_input(data.get("inputs"))
    strings = _strings(tensor, binary)
    generate: dict[str, Any] = {"type": "generate", "params": _params(data.get("parameters"))}
    if tensor["name"] == CHAT_INPUT:
        generate["messages"] = [_message(s, i) for i, s in enumerate(strings)]
    elif len(strings) != 1:
        raise bad_request(f"{tensor['name']} takes one string, not {len(strings)}", "inputs")
    else:
        generate["prompt"] = strings[0]
    turn = as_generate(generate, limits, session, token)
    return OipRequest(turn, request_id, tensor["shape"])


def _flat_request(
    data: dict[str, Any], limits: Limits, session: str | None, token: str | None
) -> OipRequest:
    """Triton's generate extension: ``{"text_input": str, "parameters"?}`` with the
    parameters at the top level too (as TensorRT-LLM's clients send them)."""
    top = {k: v for k, v in data.items() if k not in ("id", "text_input", "parameters")}
    check_fields(top, set(SAMPLING), FLAT_OFF_VALUES, IGNORED | {"stream"})
    request_id = data.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise bad_request("id must be a string", "id")
    prompt = data["text_input"]
    if not isinstance(prompt, str):
        raise bad_request("text_input must be a string", "text_input")
    nested = _params(data.get("parameters"))
    params = {**nested, **_params({k: v for k, v in top.items() if k in SAMPLING})}
    generate = {"type": "generate", "prompt": prompt, "params": params}
    return OipRequest(as_generate(generate, limits, session, token), request_id, [1], flat=True)


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary data after it (the binary tensor extension)."""
    if header_length is None:
        return body, b""
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(body):
        raise OipError(400, "Inference-Header-Content-Length must be the JSON header's length")
    cut = int(header_length)
    return body[:cut], body[cut:]


def _check_outputs(outputs: Any) -> None:
    if outputs is None:
        return
    if not isinstance(outputs, list):
        raise bad_request("outputs must be a list", "outputs")
    for output in outputs:
        if not isinstance(output, dict) or output.get("name") != OUTPUT:
            raise OipError(400, f"the one output is {OUTPUT!r}")
        check_fields(output, {"name", "parameters"}, {}, frozenset())
        parameters = output.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request("an output's parameters must be an object", "outputs")


def _one_input(inputs: Any) -> dict[str, Any]:
    names = sorted({*PROMPT_INPUTS, CHAT_INPUT})
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise OipError(400, f"inputs must be a list of one tensor, named one of {names}")
    tensor = inputs[0]
    check_fields(tensor, TENSOR_FIELDS, {}, frozenset())
    if tensor.get("name") not in names:
        raise OipError(400, f"the input must be named one of {names}")
    if tensor.get("datatype") != "BYTES":
        raise OipError(400, f"{tensor['name']} must be a BYTES tensor")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1024 for d in shape
    ):
        raise OipError(400, "shape must be a list of non-negative integers")
    parameters = tensor.get("parameters")
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise OipError(400, "an input's parameters must be an object")
    check_fields(parameters, {"content_type", BINARY_SIZE}, {}, frozenset())
    if parameters.get("content_type") not in (None, "str"):
        raise OipError(400, "an input's content_type must be 'str'")
    return tensor


def _strings(tensor: dict[str, Any], binary: bytes) -> list[str]:
    """The tensor's elements: its JSON ``data``, or its bytes after the header."""
    size = (tensor.get("parameters") or {}).get(BINARY_SIZE)
    if size is not None:
        if "data" in tensor:
            raise OipError(400, f"a tensor with {BINARY_SIZE} has no data")
        if isinstance(size, bool) or not isinstance(size, int) or size != len(binary):
            raise OipError(400, f"{BINARY_SIZE} must be the length of the binary data")
        strings = _unpack(binary)
    else:
        if binary:
            raise OipError(400, f"binary data after the header, but no input has {BINARY_SIZE}")
        data = tensor.get("data")
        if isinstance(data, list) and len(data) == 1 and isinstance(data[0], list):
            data = data[0]  # a batch of one, nested
        if not isinstance(data, list) or not all(isinstance(s, str) for s in data):
            raise OipError(400, f"{tensor['name']}'s data must be a list of strings")
        strings = data
    if math.prod(tensor["shape"]) != len(strings) or not strings:
        raise OipError(400, f"the shape {tensor['shape']} does not hold {len(strings)} strings")
    return strings


def _unpack(binary: bytes) -> list[str]:
    """A binary ``BYTES`` tensor: each element its 4-byte little-endian length, then it."""
    strings, at = [], 0
    while at < len(binary):
        if at + 4 > len(binary):
            raise OipError(400, "the binary data ends inside an element's length")
        (length,) = struct.unpack_from("<I", binary, at)
        element = binary[at + 4 : at + 4 + length]
        if len(element) != length:
            raise OipError(400, "the binary data ends inside an element")
        try:
            strings.append(element.decode())
        except UnicodeDecodeError as exc:
            raise OipError(400, "an element is not UTF-8 text") from exc
        at += 4 + length
    return strings


def _message(text: str, index: int) -> dict[str, Any]:
    """One chat message, a JSON object string (its fields checked by the WebSocket
    parser, as any ``messages``)."""
    try:
        return json_object(text.encode())
    except OpenAIError as exc:
        raise OipError(400, f"messages[{index}]: {exc.message}") from exc


def _params(raw: Any) -> dict[str, Any]:
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise bad_request("parameters must be an object", "parameters")
    check_fields(raw, set(SAMPLING), {}, IGNORED)
    asked = {k: v for k, v in raw.items() if k in SAMPLING and v is not None}
    both = {"max_tokens", "max_new_tokens"} <= set(asked)
    if both and asked["max_tokens"] != asked["max_new_tokens"]:
        raise bad_request("max_tokens and max_new_tokens disagree", "max_tokens")
    return {SAMPLING[k]: v for k, v in asked.items()}


# --- answers --------------------------------------------------------------------------


@dataclass(frozen=True)
class OipTurn:
    """What every response of one turn shares."""

    model: str
    session: str
    turn: int
    request_id: str | None
    shape: list[int]
    flat: bool = False

    def response(self, text: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """An inference response whose one output is ``text``, a one-string BYTES tensor
        shaped as the input was (``[1]`` or ``[1, 1]``); for the generate extension's
        request, its flat answer (``text_output`` and the parameters as fields)."""
        names = {"wsinfer_session": self.session, "wsinfer_turn": self.turn}
        if self.flat:
            head = {"model_name": self.model, OUTPUT: text}
            return {**head, **names, **parameters}
        output = {
            "name": OUTPUT,
            "shape": [1] * max(1, len(self.shape)),
            "datatype": "BYTES",
            "parameters": {"content_type": "str"},
            "data": [text],
        }
        return {
            "model_name": self.model,
            "id": self.request_id or f"{self.session}-{self.turn}",
            "parameters": {**names, **parameters},
            "outputs": [output],
        }

    def event(self, message: DeltaMessage) -> dict[str, Any]:
        """A stream's event: a delta's text, and its ``seq`` (where any other door's
        resume takes it up)."""
        return self.response(message["text"], {"wsinfer_seq": message["seq"]})

    def last(self, text: str, done: DoneMessage) -> dict[str, Any]:
        """The whole answer (``text``), or a stream's closing event (``""``)."""
        usage = done["usage"]
        ending = {
            "wsinfer_seq": done["seq"],
            "finish_reason": done["finish_reason"],
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
        }
        return self.response(text, ending)
