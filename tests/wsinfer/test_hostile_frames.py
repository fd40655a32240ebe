"""Frames a hostile client sends, without sockets: each gets one well-formed
``error`` that can itself be encoded, never an exception out of the protocol.

Every case here crashed the connection (1011) or answered ``internal`` before."""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from wsinfer.messages import JsonCodec, Limits, MsgpackCodec
from wsinfer.protocol import ConnectionProtocol

CODECS = {"json": JsonCodec(), "msgpack": MsgpackCodec()}


def answer(codec_name: str, frame: str | bytes) -> dict[str, Any]:
    """The single reply to a frame, checked to survive its own codec's encoding."""
    proto = ConnectionProtocol(CODECS[codec_name], Limits())
    assert proto.receive(frame) is None
    (out,) = proto.data_to_send()
    decoded = CODECS[codec_name].decode(out.frame)
    assert decoded == out.message
    # What websockets does with a text frame: it must be valid UTF-8.
    if isinstance(out.frame, str):
        out.frame.encode("utf-8")
    return out.message


def frame_of(codec_name: str, text: str) -> str | bytes:
    """A JSON text as a frame of either codec (msgpack: the same value, packed)."""
    if codec_name == "json":
        return text
    return bytes(msgpack.packb(json.loads(text), use_bin_type=True))


HOSTILE_JSON = {
    "role is a list": '{"type":"generate","messages":[{"role":["user"],"content":"x"}]}',
    "role is a map": '{"type":"generate","messages":[{"role":{"a":1},"content":"x"}]}',
    "surrogate in content": '{"type":"generate","messages":[{"role":"user","content":"\\ud800"}]}',
    "surrogate in prompt": '{"type":"generate","prompt":"a\\udfff"}',
    "surrogate in stop": '{"type":"generate","prompt":"a","params":{"stop":["\\ud800"]}}',
    "surrogate in a key": '{"type":"generate","prompt":"a","\\ud800":1}',
    "surrogate in type": '{"type":"\\ud800"}',
    "tiny temperature": '{"type":"generate","prompt":"a","params":{"temperature":1e-300}}',
    "tiny penalty": '{"type":"generate","prompt":"a","params":{"repetition_penalty":5e-324}}',
    "NaN temperature": '{"type":"generate","prompt":"a","params":{"temperature":NaN}}',
    "huge after": '{"type":"resume","session":"s","token":"t","after":1' + "0" * 30 + "}",
    "long session": '{"type":"stop","session":"' + "s" * 300 + '","token":"t"}',
    "long unknown field": '{"type":"stop","' + "k" * 5000 + '":1}',
}


@pytest.mark.parametrize("codec_name", ["json", "msgpack"])
@pytest.mark.parametrize("case", sorted(HOSTILE_JSON))
def test_hostile_values_get_bad_request(codec_name: str, case: str) -> None:
    text = HOSTILE_JSON[case]
    if codec_name == "msgpack" and ("\\ud" in text or "NaN" in text or "1000000" in text):
        pytest.skip("msgpack cannot carry this value (its strings are UTF-8, ints 64-bit)")
    message = answer(codec_name, frame_of(codec_name, text))
    assert message["type"] == "error" and message["code"] == "bad_request", message
    assert len(message["message"]) < 300


@pytest.mark.parametrize("codec_name", ["json", "msgpack"])
def test_deep_nesting_is_refused_without_recursing(codec_name: str) -> None:
    deep = '{"type":"generate","prompt":"a","params":' + "[" * 1000 + "]" * 1000 + "}"
    frame = deep if codec_name == "json" else b"\x91" * 100_000 + b"\x90"
    message = answer(codec_name, frame)
    assert message["code"] == "bad_request"


@pytest.mark.parametrize("id_value", ["\ud800", "a\udfffb"])
def test_an_unencodable_id_is_not_echoed(id_value: str) -> None:
    frame = json.dumps({"type": "stop", "id": id_value, "session": "s", "token": "t"})
    message = answer("json", frame)
    assert message["code"] == "bad_request" and "id" not in message


def test_an_id_beyond_64_bits_is_refused_and_not_echoed() -> None:
    frame = json.dumps({"type": "stop", "id": 2**70, "session": "s", "token": "t"})
    message = answer("json", frame)  # msgpack cannot carry such an integer at all
    assert message["code"] == "bad_request" and "id" not in message


@pytest.mark.parametrize(
    "value", [b"bytes", msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 0)], ids=str
)
def test_msgpack_types_no_message_has_are_refused(value: Any) -> None:
    frame = msgpack.packb({"type": "generate", "prompt": "a", "params": {"seed": value}})
    assert answer("msgpack", bytes(frame))["code"] == "bad_request"


@pytest.mark.parametrize("temperature", [0, 0.01, 5])
def test_the_temperature_range_ends_are_accepted(temperature: float) -> None:
    proto = ConnectionProtocol(JsonCodec(), Limits())
    frame = json.dumps({"type": "generate", "prompt": "a", "params": {"temperature": temperature}})
    assert proto.receive(frame) is not None
