"""The HTTP connection against hostile and careless clients, over real sockets:
flow control, deadlines on every request, head limits, smuggling, HEAD, the
request rate, and a client that hangs up while its request is in flight."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import h11
import httpx
import pytest

from tests.stack import start_serve, stop_serve
from wsinfer.http import connection, door
from wsinfer.server import Frontend, FrontendConfig

IDLE_PAUSE_S = 1.5
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, int]]:
    """A fake-model ``wsinfer serve`` (port, state dir, pid) with a short idle limit:
    100 tokens/s, so that a 4000-token turn runs 40 s."""
    state = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", "fake:100", "--idle-pause", str(IDLE_PAUSE_S))
    yield port, state, process.pid
    assert stop_serve(process) == 0


async def own_frontend(serve: tuple[int, Path, int], **config: Any) -> Frontend:
    """A frontend in this test's loop on the serve's Redis (so it shares its engine)."""
    (socket,) = serve[1].glob("wsinfer-*/redis.sock")
    settings: dict[str, Any] = {"port": 0, "touch_interval_s": 0.3, **config}
    frontend = Frontend(FrontendConfig(redis_url=f"unix://{socket}", **settings))
    await frontend.start()
    return frontend


async def read_response(
    reader: asyncio.StreamReader, head_only: bool = False, timeout: float = 10
) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length response: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    fields = (line.split(":", 1) for line in lines[1:] if line)
    headers = {name.lower(): value.strip() for name, value in fields}
    length = 0 if head_only else int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), timeout)
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader, timeout: float = 10) -> bool:
    return await asyncio.wait_for(reader.read(), timeout) == b""


def completion(max_tokens: int, stream: bool = False, headers: str = "") -> bytes:
    body = json.dumps(
        {
            "model": "wsinfer",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens,
            "stream": stream,
        }
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n{headers}"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


# --- flow control ---------------------------------------------------------------------


def flood_benchmark() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_http_flood.py"
    spec = importlib.util.spec_from_file_location("bench_http_flood", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_pipelined_floods_do_not_grow_the_frontend(serve: tuple[int, Path, int]) -> None:
    """48 MiB behind a running request, and 48 MiB of GET /v1/models never read
    (each grew the frontend by its whole size before)."""
    port, _, pid = serve
    for name, outcome in flood_benchmark().attacks(port, pid, 48, 20.0).items():
        assert outcome.growth_mib < 16, (name, outcome)


async def test_request_rate_applies_to_http_requests(serve: tuple[int, Path, int]) -> None:
    frontend = await own_frontend(serve, request_rate=1.0)  # bursts of 2
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(MODELS * 6)
        answers = [await read_response(reader) for _ in range(6)]
        statuses = [status for status, _, _ in answers]
        assert statuses[:2] == [200, 200] and statuses.count(429) >= 3, statuses
        for status, headers, body in answers:
            if status == 429:
                assert int(headers["retry-after"]) >= 1
                assert json.loads(body)["error"]["code"] == "overloaded"
        writer.close()
    finally:
        await frontend.stop()


# --- deadlines ------------------------------------------------------------------------


async def test_every_request_head_has_a_deadline(
    serve: tuple[int, Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second head of a keep-alive connection, one byte at a time, is cut off."""
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", 0.5)
    frontend = await own_frontend(serve)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(MODELS)
        assert (await read_response(reader))[0] == 200
        answer = asyncio.ensure_future(read_response(reader, timeout=5))
        for byte in MODELS[:-2]:
            if answer.done():
                break
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)
        status, _, body = await answer
        assert status == 408 and json.loads(body)["error"]["code"] == "timeout"
        assert await closed(reader)
        writer.close()
    finally:
        await frontend.stop()


async def test_a_slow_body_is_408(
    serve: tuple[int, Path, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection, "BODY_TIMEOUT_S", 0.5)
    frontend = await own_frontend(serve)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(completion(4)[:-10])  # the last 10 bytes of the body never come
        status, headers, body = await read_response(reader)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "timeout"
        writer.close()
    finally:
        await frontend.stop()


# --- what a request head may be -----------------------------------------------------

BIG_HEADS = {
    "a 20 KB header": (b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"b" * 20_000 + b"\r\n\r\n", 431),
    "10,000 headers": (b"GET /v1/models HTTP/1.1\r\n" + b"A: b\r\n" * 10_000 + b"\r\n", 431),
    "150 headers": (b"GET /v1/models HTTP/1.1\r\n" + b"A: b\r\n" * 150 + b"\r\n", 431),
    "a 100 KB URL": (b"GET /v1/models?" + b"u" * 100_000 + b" HTTP/1.1\r\n\r\n", 431),
    "a 10 KB URL": (b"GET /v1/models?" + b"u" * 10_000 + b" HTTP/1.1\r\n\r\n", 414),
}


@pytest.mark.parametrize("piece", [None, 1000])
@pytest.mark.parametrize("after_a_request", [False, True])
@pytest.mark.parametrize("name", list(BIG_HEADS))
async def test_head_limits_hold_however_the_bytes_are_split(
    serve: tuple[int, Path, int], name: str, after_a_request: bool, piece: int | None
) -> None:
    head, status = BIG_HEADS[name]
    head = head.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nHost: localhost\r\n", 1)
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    if after_a_request:
        writer.write(MODELS)
        assert (await read_response(reader))[0] == 200
    for start in range(0, len(head), piece or len(head)):
        writer.write(head[start : start + (piece or len(head))])
        await writer.drain()
    answer, _, body = await read_response(reader)
    assert answer == status and json.loads(body)["error"]["code"] == "too_large"
    assert await closed(reader)
    writer.close()


async def test_content_length_and_chunked_together_are_refused(
    serve: tuple[int, Path, int],
) -> None:
    """RFC 9112 section 6.1: refused, and the connection closed (no smuggling)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    writer.write(MODELS)
    assert (await read_response(reader))[0] == 200
    writer.write(
        b"POST /v1/nowhere HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + MODELS
    )
    status, _, body = await read_response(reader)
    assert status == 400 and "Transfer-Encoding" in json.loads(body)["error"]["message"]
    assert await closed(reader)
    writer.close()


@pytest.mark.parametrize("first", [True, False], ids=["first-request", "later-request"])
@pytest.mark.parametrize(
    "framing",
    [b"Content-Length: 5\r\n\r\nhello", b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"],
    ids=["length", "chunked"],
)
async def test_a_websocket_handshake_with_a_body_is_answered(
    serve: tuple[int, Path, int], first: bool, framing: bytes
) -> None:
    """websockets drops a handshake that has a body without a word: the HTTP side
    answers it instead (426), whether it opens the connection or follows a request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    if not first:
        writer.write(MODELS)
        assert (await read_response(reader))[0] == 200
    writer.write(b"GET /v1/ws HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n" + framing)
    assert (await read_response(reader))[0] == 426
    writer.close()


def test_the_door_hands_a_bodiless_handshake_straight_to_websockets() -> None:
    def handshake(*extra: tuple[str, str]) -> h11.Request:
        headers = [("Host", "localhost"), ("Upgrade", "websocket"), *extra]
        return h11.Request(method="GET", target="/v1/ws", headers=headers)

    assert door._is_websocket(handshake())
    assert door._is_websocket(handshake(("Content-Length", "0")))
    assert not door._is_websocket(handshake(("Content-Length", "5")))
    assert not door._is_websocket(handshake(("Transfer-Encoding", "chunked")))


async def test_head_is_get_without_a_body_on_the_plain_routes_and_405_on_the_api(
    serve: tuple[int, Path, int],
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    for path, expected in ((b"/v1/models", 405), (b"/healthz", 200), (b"/", 200)):
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
        _, _, got = await read_response(reader)
        writer.write(b"HEAD " + path + b" HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, headers, _ = await read_response(reader, head_only=True)
        assert status == expected and int(headers["content-length"]) > 0
        if expected == 200:  # a monitor's HEAD /healthz: the GET's head, no body
            assert int(headers["content-length"]) == len(got)
    writer.write(MODELS)  # nothing of a body was sent: the next answer is whole
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["object"] == "list"
    writer.close()


# --- a client that hangs up -----------------------------------------------------------


async def test_a_non_streamed_turn_whose_client_hangs_up_is_paused_when_idle(
    serve: tuple[int, Path, int],
) -> None:
    """Issue 18: its frontend stops following it at once, so --idle-pause applies."""
    base = f"http://127.0.0.1:{serve[0]}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        first = await http.post(
            "/v1/chat/completions",
            json={"model": "wsinfer", "messages": [{"role": "user", "content": "a"}],
                  "max_tokens": 1},
        )  # fmt: skip
        session, token = first.headers["x-wsinfer-session"], first.headers["x-wsinfer-token"]
        auth = {"X-Wsinfer-Token": token}
        extra = f"X-Wsinfer-Session: {session}\r\nX-Wsinfer-Token: {token}\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
        writer.write(completion(4000, headers=extra))  # 40 s at 100 tokens/s
        info: dict[str, Any] = {}
        for _ in range(600):  # the machine may be busy: up to 30 s
            info = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
            if info["turn"] == 2 and info["seq"] > 0:
                break
            await asyncio.sleep(0.05)
        assert info["status"] == "running", info
        writer.close()  # hung up, the turn under way
        for _ in range(250):  # up to 25 s; on the old main it ran on (until 40 s)
            info = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
            if info["status"] != "running":
                break
            await asyncio.sleep(0.1)
        assert info["status"] == "paused" and info["seq"] < 4000, info
        await http.post(f"/v1/sessions/{session}/stop", headers=auth)


async def test_an_sse_client_that_hangs_up_during_a_pause_is_let_go_at_once(
    serve: tuple[int, Path, int],
) -> None:
    """No write is due (the turn is paused), yet the hang-up is noticed."""
    frontend = await own_frontend(serve)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(completion(4000, stream=True))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode().split("\r\n")[1:]
        fields = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines if ": " in line)}
        session, token = fields["x-wsinfer-session"], fields["x-wsinfer-token"]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{frontend.port}") as http:
            url = f"/v1/sessions/{session}"
            paused = await http.post(f"{url}/pause", headers={"X-Wsinfer-Token": token})
            assert paused.json()["status"] == "paused"
            await asyncio.wait_for(reader.readuntil(b": paused at seq"), 10)
            assert len(frontend.http.peers) == 1
            writer.close()
            for _ in range(60):  # 3 s; the next write (a keep-alive comment) is 15 s away
                if not frontend.http.peers and not frontend.fanin.owners:
                    break
                await asyncio.sleep(0.05)
            assert not frontend.http.peers and not frontend.fanin.owners
            await http.post(f"{url}/stop", headers={"X-Wsinfer-Token": token})
    finally:
        await frontend.stop()


@pytest.mark.parametrize(
    ("extra", "status"),
    [
        (b"X-Junk: d\x1bW\r\n", 400),  # h11 passes control characters in a value
        (b"Upgrade: h2c\r\nUpgrade: other\r\n", 200),  # a repeated Upgrade is no WebSocket
    ],
)
async def test_odd_header_fields_get_an_answer(
    serve: tuple[int, Path, int], extra: bytes, status: int
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    writer.write(MODELS.replace(b"Host: localhost\r\n", b"Host: localhost\r\n" + extra))
    assert (await read_response(reader))[0] == status
    writer.close()


async def test_error_answers_quote_client_input_cut_short(serve: tuple[int, Path, int]) -> None:
    """A 300 kB field name or an 8 kB malformed header line is not sent back whole."""
    name = "f" * 300_000
    body = json.dumps({"model": "wsinfer", "messages": [], name: 1}).encode()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{serve[0]}") as http:
        response = await http.post("/v1/chat/completions", content=body)
    assert response.status_code == 400 and len(response.content) < 1000
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n" + b"no colon here " * 600 + b"\r\n\r\n")
    status, _, answer = await read_response(reader)
    assert status == 400 and len(answer) < 1000, answer[:300]
    writer.close()
