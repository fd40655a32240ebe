"""Fuzzing the HTTP door of a real frontend with generated requests (hypothesis),
while a well-behaved SSE client streams beside them.

Methods, paths, queries, header fields, bodies, framings (Content-Length right
or wrong, chunked, both) and the points where the bytes are split are all
generated, over real sockets, one connection per example. Every request
must get a well-formed answer (h11 parses it) that is not a 5xx; a
connection closed with no answer, or stuck, fails the test. The
bystander's turns must come out exactly as with no fuzzing, and the
frontend must log nothing at WARNING or above.

Among the inputs: repeated and non-ASCII values of the headers the app reads
(``Authorization``, ``Origin``, ``X-Wsinfer-*``, ``Last-Event-ID``, ``Host``),
Hosts that are not the server's (DNS rebinding), non-digit Unicode in
``?after=``, JSON nested thousands deep, and lone surrogates in field names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import h11
import pytest
import structlog
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.stack import Stack, start_frontend
from wsinfer.http import connection
from wsinfer.server import Frontend

EXAMPLES = int(os.environ.get("WSINFER_FUZZ_HTTP_EXAMPLES", "400"))
# Short deadlines, so that a request generated incomplete is answered (408) quickly.
DEADLINE_S = 0.3
ANSWER_TIMEOUT_S = 10.0
BYSTANDER = {
    "model": "wsinfer",
    "messages": [{"role": "user", "content": "a story"}],
    "max_tokens": 40,
    "stream": True,
}

# --- what hypothesis generates ----------------------------------------------------

SESSION = "0123456789abcdef0123456789abcdef"
PATHS = [
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/wsinfer",
    "/v1/models/gpt-4",
    f"/v1/sessions/{SESSION}",
    f"/v1/sessions/{SESSION}/stream",
    f"/v1/sessions/{SESSION}/stop",
    f"/v1/sessions/{SESSION}/pause",
    f"/v1/sessions/{SESSION}/resume",
    "/v1/ws",
    "/v1/",
    "/healthz",
    "/metrics",
    "/",
    "/static/wsinfer.js",
    "/static/../../etc/passwd",
    "*",
    "http://x/v1/models",
]
METHODS = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS", "PATCH", "TRACE", "CONNECT", "BREW"]
ascii_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
any_bytes = st.binary(max_size=40)
query = st.lists(
    st.tuples(
        st.sampled_from(["after", "turn", "session_token", "token", "include_usage", "x"]),
        st.sampled_from(["0", "1", "-1", "abc", "", "%00", "%ff", "99999999999999999999"])
        | st.sampled_from(["%C2%B2", "\u00b2", "%ED%A0%80", "%C3%A9", "1" * 5000])
        | ascii_text,
    ),
    max_size=3,
)
targets = st.one_of(
    st.tuples(st.sampled_from(PATHS), query).map(
        lambda pq: pq[0] + ("?" + "&".join(f"{k}={v}" for k, v in pq[1]) if pq[1] else "")
    ),
    ascii_text.map(lambda t: "/" + t.replace(" ", "")),
)
# Headers the app reads, each meant to come once: generated repeated too.
SINGLE = ["Origin", "X-Wsinfer-Session", "X-Wsinfer-Token", "Last-Event-ID", "Authorization"]
header_values = (
    st.sampled_from(
        ["0", "5", "-1", "chunked", "gzip", "close", "100-continue", "websocket", "", "a" * 300]
    )
    | st.sampled_from(["Bearer \u00e9", "bearer k", "http://rebind.example", "\u00b2", "null"])
    | ascii_text
)
latin1 = any_bytes.map(lambda b: b.decode("latin-1"))
single_headers = st.lists(st.tuples(st.sampled_from(SINGLE), header_values | latin1), max_size=4)
hosts = st.lists(
    st.sampled_from(["127.0.0.1", "localhost:1", "rebind.attacker.example", "", "[::1]", "\u00e9"]),
    min_size=0,
    max_size=2,
).map(lambda h: h or ["127.0.0.1"])
other_headers = st.lists(
    st.tuples(
        st.sampled_from(["Content-Type", "Connection", "Expect", "Upgrade", "Accept", "X-Junk"])
        | ascii_text.filter(lambda t: t.isalnum()),
        st.one_of(header_values, latin1),
    ),
    max_size=4,
)
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=6,
)
chat = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["wsinfer", "gpt-4"]) | values,
        "messages": st.just([{"role": "user", "content": "hi"}]) | values,
    },
    optional={
        "max_tokens": st.integers(1, 3) | values,
        "stream": st.booleans() | values,
        "temperature": st.floats(-1, 6) | values,
        "stream_options": values,
        "bogus": values,
    },
)
deep = st.integers(100, 20_000).flatmap(
    lambda n: st.sampled_from([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n])
)
bodies = st.one_of(
    st.just(b""),
    deep,
    st.just(b'{"model": "wsinfer", "messages": [], "\\ud800": 1}'),
    st.just(b'{"model": "wsinfer", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    chat.map(lambda d: json.dumps(d).encode()),
    values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
)
framings = st.sampled_from(["length", "none", "short", "long", "chunked", "both", "bad-chunk"])


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """One request's bytes and where to split them (a list of offsets)."""
    method = draw(st.sampled_from(["GET", "POST"]) | st.sampled_from(METHODS) | ascii_text)
    head = [f"{method} {draw(targets)} HTTP/1.1"] + [f"Host: {h}" for h in draw(hosts)]
    head += [f"{k}: {v}" for k, v in draw(single_headers)]
    head += [f"{k}: {v}" for k, v in draw(other_headers)]
    body, framing = draw(bodies), draw(framings)
    if framing in ("length", "short", "long", "both"):
        skew = {"length": 0, "both": 0, "short": -1, "long": 1}[framing]
        head.append(f"Content-Length: {max(0, len(body) + skew)}")
    if framing in ("chunked", "both", "bad-chunk"):
        head.append("Transfer-Encoding: chunked")
        size = draw(st.integers(1, 64))
        pieces = [body[i : i + size] for i in range(0, len(body), size)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
        if framing == "bad-chunk":
            body = b"zz\r\n" + body
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1", "replace") + body
    splits = draw(st.lists(st.integers(0, len(raw)), max_size=6).map(sorted))
    return raw, splits


# --- one request, over a real socket -------------------------------------------------


def send_and_read(port: int, raw: bytes, splits: list[int]) -> int | str:
    """The answer's status, or "close" if the server closed without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = 0
        for end in [*splits, len(raw)]:
            if end > start:
                try:
                    sock.sendall(raw[start:end])
                except (BrokenPipeError, ConnectionResetError):
                    break  # refused and closed before the rest was sent: read the answer
                start = end
        method = raw.split(b" ", 1)[0]
        return read_answer(sock, b"HEAD" if method == b"HEAD" else b"GET")


def read_answer(sock: socket.socket, method: bytes) -> int | str:
    """Parse the answer with h11 (it must be well-formed HTTP/1.1)."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method=method, target="/", headers=[("Host", "x")]))
    status: int | str = "close"
    while True:
        event = client.next_event()
        if event is h11.NEED_DATA:
            try:
                client.receive_data(sock.recv(65536))
            except ConnectionResetError:
                client.receive_data(b"")
            continue
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.InformationalResponse):
            continue
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return status


# --- the bystander and the frontend --------------------------------------------------


def bystander_turn(port: int) -> str:
    """One streamed completion, read to its [DONE]: its text."""
    body = json.dumps(BYSTANDER).encode()
    raw = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(raw)
        client = h11.Connection(h11.CLIENT)
        client.send(h11.Request(method="POST", target="/", headers=[("Host", "x")]))
        data = b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
    text, events = "", data.decode().split("\n\n")
    assert events[-2] == "data: [DONE]", events[-3:]
    for block in events[:-2]:
        for line in block.split("\n"):
            if line.startswith("data: "):
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["delta"].get("content") or "" if choices else ""
    return text


class ThreadedFrontend:
    """A frontend on an event loop of its own thread: the fuzzer's sockets block."""

    def __init__(self, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.frontend: Frontend = self._run(
            start_frontend(redis_url, request_rate=1e6, max_queued_turns=10_000)
        )

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(60)

    def stop(self) -> None:
        self._run(self.frontend.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def frontend(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Frontend]:
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(connection, "BODY_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(connection, "LINGER_S", DEADLINE_S)
    stack.start_engine("engine-1", "--max-batch-size", "32")
    threaded = ThreadedFrontend(stack.redis_url)
    yield threaded.frontend
    threaded.stop()


# --- the test ------------------------------------------------------------------------


@pytest.fixture
def stack(redis_url: str) -> Iterator[Stack]:
    """The fake engine: no model to load, tokens at 200 per second per stream."""
    stack = Stack(redis_url, "fake:200")
    yield stack
    stack.stop()


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_generated_requests_get_a_clean_answer_and_leave_a_bystander_exact(
    frontend: Frontend, caplog: pytest.LogCaptureFixture
) -> None:
    port = frontend.port
    reference = bystander_turn(port)
    assert reference
    texts: list[str] = []
    statuses: Counter[int | str] = Counter()
    fuzzing = threading.Event()
    fuzzing.set()

    def bystander() -> None:
        while fuzzing.is_set():
            texts.append(bystander_turn(port))

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(requests())
    def fuzz(request: tuple[bytes, list[int]]) -> None:
        status = send_and_read(port, *request)
        statuses[status] += 1
        assert status == "close" or status < 500, (status, request)

    thread = threading.Thread(target=bystander, daemon=True)
    caplog.set_level(logging.WARNING)
    with structlog.testing.capture_logs() as logs:
        thread.start()
        try:
            fuzz()
        finally:
            fuzzing.clear()
            thread.join(60)
    counts = dict(sorted(statuses.items(), key=str))
    print(f"\n{sum(statuses.values())} fuzz requests; answers by status: {counts}; "
          f"bystander turns during the fuzz: {len(texts)}")  # fmt: skip
    assert texts and all(text == reference for text in texts)
    loud = [e for e in logs if e.get("log_level") in ("warning", "error", "critical")]
    assert not loud, loud[:5]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records[:5]
