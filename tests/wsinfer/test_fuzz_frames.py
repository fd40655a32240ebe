"""Fuzzing a real frontend process with generated frames (hypothesis), JSON and
msgpack, while a well-behaved client streams beside them.

Every frame must get exactly one direct answer (``error`` or ``session``), in
order, well-formed; the connection must stay open; the bystander's turns must
come out identical to a run with no fuzzing at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections import Counter
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection, connect

from tests.stack import Stack

FRAMES = int(os.environ.get("WSINFER_FUZZ_FRAMES", "20000"))
BATCH = 50
TYPES = ["generate", "stop", "pause", "resume", "close"]
SERVER_TYPES = {"session", "delta", "paused", "done", "error"}
CODES = {
    "bad_request",
    "unauthorized",
    "not_found",
    "conflict",
    "too_large",
    "overloaded",
    "engine_unavailable",
    "internal",
}
BYSTANDER = {
    "type": "generate",
    "prompt": "The lighthouse keeper said",
    "params": {"temperature": 0, "max_new_tokens": 40},
}

# --- what hypothesis generates ----------------------------------------------------

NASTY_STRINGS = ["\ud800", "a\udfffb", "", "x" * 300, "\x00", "generate", "user", "\u2028", "🦀"]
NASTY_NUMBERS = [
    1e-300,
    5e-324,
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    2**63,
    2**64,
    -(2**63) - 1,
    2**64 + 1,
    10**30,
    -1,
    0,
    1,
    4096,
    4097,
    1e308,
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(NASTY_STRINGS)
    | st.sampled_from(NASTY_NUMBERS)
)
keys = st.text(max_size=8) | st.sampled_from(["type", "id", "session", "token", "role", "\ud800"])
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=12,
)
message_items = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant"]) | values,
        "content": st.text() | values,
    }
)
params = st.fixed_dictionaries(
    # Kept short when valid: accepted turns must not swamp the engine.
    {"max_new_tokens": st.integers(1, 3) | values},
    optional={
        name: values | st.floats(-1, 11) | st.integers(-2, 5)
        for name in ["temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop"]
    }
    | {"bogus": values},
)
structured = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES) | values},
    optional={
        "id": st.integers() | st.text(max_size=300) | values,
        "session": st.text(max_size=40) | values,
        "token": st.text(max_size=40) | values,
        "messages": st.lists(message_items, max_size=3) | values,
        "prompt": st.text(min_size=1, max_size=30) | values,
        "params": params,
        "after": st.integers() | values,
        "turn": st.integers() | values,
    },
)
# Near-valid messages of each type: right fields, each value sometimes hostile.
ids = st.integers() | st.text(max_size=300) | values
names = st.text(min_size=1, max_size=40) | st.sampled_from(NASTY_STRINGS)
commands = st.fixed_dictionaries(
    {"type": st.sampled_from(["stop", "pause", "close"]), "session": names, "token": names},
    optional={"id": ids},
)
resumes = st.fixed_dictionaries(
    {"type": st.just("resume"), "session": names, "token": names},
    optional={"id": ids, "after": st.integers() | values, "turn": st.integers() | values},
)
generates = st.fixed_dictionaries(
    {"type": st.just("generate"), "params": params},
    optional={"id": ids, "prompt": names, "messages": st.lists(message_items, max_size=3)},
)
deep = st.integers(1, 3000)  # sent as raw frames: hypothesis cannot print deep values
raw_text = st.text(max_size=200) | st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)
raw_bytes = st.binary(max_size=200) | st.integers(1, 100_000).map(lambda n: b"\x91" * n + b"\x90")
frames = st.one_of(
    structured.map(lambda v: ("value", v)),
    commands.map(lambda v: ("value", v)),
    resumes.map(lambda v: ("value", v)),
    generates.map(lambda v: ("value", v)),
    values.map(lambda v: ("value", v)),
    deep.map(lambda n: ("deep", n)),
    raw_text.map(lambda t: ("text", t)),
    raw_bytes.map(lambda b: ("bytes", b)),
)


def _deep(codec: str, depth: int) -> str | bytes:
    """A generate whose params are lists nested ``depth`` deep."""
    if codec == "json":
        return '{"type":"generate","prompt":"a","params":' + "[" * depth + "]" * depth + "}"
    head = b"".join(msgpack.packb(v) for v in ("type", "generate", "prompt", "a", "params"))
    return b"\x83" + head + b"\x91" * (depth - 1) + b"\x90"


def encode(codec: str, kind: str, value: Any) -> str | bytes:
    """A frame for a connection of ``codec``; raw garbage is sent as it is."""
    if kind == "deep":
        return _deep(codec, value)
    if kind != "value":
        return value  # type: ignore[no-any-return]
    if codec == "json":
        try:
            return json.dumps(value)
        except (RecursionError, ValueError):
            return "[" * 5000
    try:
        return bytes(msgpack.packb(value, use_bin_type=True))
    except (RecursionError, ValueError, OverflowError, TypeError):
        return json.dumps(value, default=str).encode("utf-8", "surrogatepass")


# --- the test ------------------------------------------------------------------------


def open_ws(port: int, codec: str) -> ClientConnection:
    return connect(
        f"ws://127.0.0.1:{port}/v1/ws",
        subprotocols=[f"wsinfer.v1.{codec}"],  # type: ignore[list-item]
        max_size=None,
        open_timeout=30,
    )


def decode(codec: str, frame: str | bytes) -> dict[str, Any]:
    return dict(json.loads(frame) if codec == "json" else msgpack.unpackb(frame, raw=False))


def bystander_turn(port: int) -> str:
    with open_ws(port, "json") as ws:
        ws.send(json.dumps(BYSTANDER))
        text = ""
        while True:
            message = json.loads(ws.recv(timeout=120))
            assert message["type"] in ("session", "delta", "done"), message
            text += message.get("text", "") if message["type"] == "delta" else ""
            if message["type"] == "done":
                assert message["finish_reason"] == "length", message
                return text


def check_well_formed(message: dict[str, Any]) -> None:
    assert message.get("type") in SERVER_TYPES, message
    if message["type"] == "error":
        assert message["code"] in CODES and isinstance(message["message"], str), message
    if message["type"] == "done" and message["finish_reason"] == "error":
        assert message["error"]["code"] in CODES, message


class Fuzzer:
    def __init__(self, port: int) -> None:
        self.exits = contextlib.ExitStack()
        self.ws = {c: self.exits.enter_context(open_ws(port, c)) for c in ("json", "msgpack")}
        self.codes: Counter[str] = Counter()
        self.sent = 0
        self.batches = 0

    def run_batch(self, codec: str, batch: list[tuple[str, Any]]) -> None:
        ws = self.ws[codec]
        for kind, value in batch:
            ws.send(encode(codec, kind, value))
        self.batches += 1
        sentinel = f"sentinel-{self.batches}"
        ws.send(
            encode(codec, "value", {"type": "stop", "id": sentinel, "session": "s", "token": "t"})
        )
        answers = []
        while True:
            message = decode(codec, ws.recv(timeout=60))
            check_well_formed(message)
            if message.get("id") == sentinel:
                break
            if message["type"] in ("error", "session"):
                answers.append(message)
        assert len(answers) == len(batch), (len(answers), len(batch))
        self.sent += len(batch)
        for message in answers:
            self.codes[message["code"] if message["type"] == "error" else "session"] += 1


@pytest.mark.timeout(900)
# The bystander runs in a thread; hypothesis mistakes that thread's use of the
# random module (inside websockets) for the strategies' own.
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_generated_frames_never_break_a_connection_or_a_bystander(stack: Stack) -> None:
    stack.start_engine("engine-1", "--max-batch-size", "32")
    _, port = stack.start_frontend("--request-rate", "100000", "--max-queued-turns", "10000")
    reference = bystander_turn(port)
    assert reference
    bystander_texts: list[str] = []
    fuzzing = threading.Event()
    fuzzing.set()

    def bystander() -> None:
        while fuzzing.is_set():
            bystander_texts.append(bystander_turn(port))

    thread = threading.Thread(target=bystander, daemon=True)
    fuzzer = Fuzzer(port)

    @settings(
        max_examples=FRAMES // BATCH,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.sampled_from(["json", "msgpack"]), st.lists(frames, min_size=BATCH, max_size=BATCH))
    def fuzz(codec: str, batch: list[tuple[str, Any]]) -> None:
        fuzzer.run_batch(codec, batch)

    thread.start()
    try:
        fuzz()
    finally:
        fuzzing.clear()
        thread.join(300)
    print(
        f"\n{fuzzer.sent} fuzz frames; direct answers by code: {dict(fuzzer.codes)}; "
        f"bystander turns during the fuzz: {len(bystander_texts)}"
    )
    assert fuzzer.sent >= FRAMES
    assert bystander_texts and all(text == reference for text in bystander_texts)
    for codec in fuzzer.ws:  # both connections are still open and answering
        fuzzer.run_batch(codec, [("value", {"type": "close", "session": "s", "token": "t"})])
    fuzzer.exits.close()
