"""The two wire encodings of protocol v1, chosen by WebSocket subprotocol."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from wsinfer.contract import Subprotocol

CodecName = Literal["msgpack", "json"]

JSON_SUBPROTOCOL = Subprotocol.JSON.value
MSGPACK_SUBPROTOCOL = Subprotocol.MSGPACK.value
SUBPROTOCOLS: dict[str, str] = {"json": JSON_SUBPROTOCOL, "msgpack": MSGPACK_SUBPROTOCOL}


class DecodeError(ValueError):
    """A frame that is not one map of the negotiated encoding."""


@dataclass(frozen=True)
class Codec:
    name: CodecName

    @property
    def subprotocol(self) -> str:
        return SUBPROTOCOLS[self.name]

    def encode(self, message: dict[str, Any]) -> str | bytes:
        # JSON goes in text frames, msgpack in binary ones: websockets picks
        # the frame type from str vs bytes.
        if self.name == "json":
            return json.dumps(message, separators=(",", ":"), ensure_ascii=False)
        return msgpack.packb(message, use_bin_type=True)

    def decode(self, frame: str | bytes) -> dict[str, Any]:
        # Decode by frame type, not by the negotiated name, so a server that
        # answers in the other encoding is still understood.
        try:
            data = (
                json.loads(frame)
                if isinstance(frame, str)
                else msgpack.unpackb(frame, raw=False, strict_map_key=False)
            )
        except (ValueError, msgpack.UnpackException) as exc:
            raise DecodeError(f"undecodable frame: {exc}") from exc
        if not isinstance(data, dict):
            raise DecodeError("frame is not a map")
        return data


def codec_for_subprotocol(subprotocol: str | None) -> Codec:
    """The codec the server picked; no subprotocol means JSON (protocol rule)."""
    if subprotocol == MSGPACK_SUBPROTOCOL:
        return Codec("msgpack")
    return Codec("json")


def offered_subprotocols(preferred: CodecName) -> list[str]:
    """Offer the preferred encoding first, the other as a fallback."""
    other: CodecName = "json" if preferred == "msgpack" else "msgpack"
    return [SUBPROTOCOLS[preferred], SUBPROTOCOLS[other]]
