"""Client input never gets a 500 on either door (issue 19, item 3): a clear 4xx,
OpenAI's error shape on ``/v1/*``, a rate-limited INFO line, no traceback. Real
frontend processes (their logs are read), real sockets, a real tiny-model engine
for a prompt longer than the model's context."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.stack import Client, Stack, start_frontend
from tests.wsinfer.test_hostile_clients import spawn_frontend, stop

KEY = "sekrit"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
UPGRADE = (
    b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


async def exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One request on its own connection: (status, body) of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
        if b"Upgrade:" not in head:
            head += b"Connection: close\r\n"
        writer.write(head + b"\r\n" + body)
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert answer.startswith(b"HTTP/1.1 "), answer[:200]
        status = int(answer[9:12])
        if status != 101:  # else the connection is a WebSocket now
            answer += await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return status, answer.partition(b"\r\n\r\n")[2]


def request(method: str, target: str, *headers: bytes) -> bytes:
    return f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode() + b"".join(headers)


COMPLETION = {"model": "wsinfer", "messages": [{"role": "user", "content": "hi"}]}
NESTED = b'{"model": "wsinfer", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
SURROGATE_FIELD = b'{"model": "wsinfer", "\\ud800' + b"x" * 300 + b'": 1}'

# (name, request head, body, status): every one was a 500 or a dropped connection.
V1_CASES: list[tuple[str, bytes, bytes, int]] = [
    ("non-ASCII key", request("GET", "/v1/models", b"Authorization: Bearer \xe9\r\n"), b"", 401),
    ("non-ASCII ?token=", request("GET", "/v1/models?token=%C3%A9"), b"", 401),
    ("two Authorization", request("GET", "/v1/models", AUTH, AUTH), b"", 400),
    (
        "two Origin",
        request("GET", "/v1/models", AUTH, b"Origin: http://a\r\nOrigin: http://b\r\n"),
        b"",
        400,
    ),
    (
        "two X-Wsinfer-Session",
        request(
            "POST",
            "/v1/chat/completions",
            AUTH,
            b"X-Wsinfer-Session: a\r\nX-Wsinfer-Session: b\r\n",
        ),
        json.dumps(COMPLETION).encode(),
        400,
    ),
    (
        "two X-Wsinfer-Token",
        request("GET", "/v1/sessions/abc", AUTH, b"X-Wsinfer-Token: a\r\nX-Wsinfer-Token: b\r\n"),
        b"",
        400,
    ),
    (
        "two Last-Event-ID",
        request(
            "GET",
            "/v1/sessions/abc/stream",
            AUTH,
            b"X-Wsinfer-Token: t\r\nLast-Event-ID: 1\r\nLast-Event-ID: 2\r\n",
        ),
        b"",
        400,
    ),
    (
        "Last-Event-ID: \u00b2",
        request(
            "GET",
            "/v1/sessions/abc/stream",
            AUTH,
            b"X-Wsinfer-Token: t\r\nLast-Event-ID: " + "\u00b2".encode() + b"\r\n",
        ),
        b"",
        400,
    ),
    (
        "?after=%C2%B2",
        request("GET", "/v1/sessions/abc/stream?after=%C2%B2&session_token=t", AUTH),
        b"",
        400,
    ),
    (
        "a 5000-digit Last-Event-ID",
        request("GET", f"/v1/sessions/abc/stream?after={'9' * 5000}&session_token=t", AUTH),
        b"",
        400,
    ),
    ("nested JSON", request("POST", "/v1/chat/completions", AUTH), NESTED, 400),
    ("surrogate field", request("POST", "/v1/chat/completions", AUTH), SURROGATE_FIELD, 400),
    ("a target that is no URL", request("GET", "//[", AUTH), b"", 400),
]

WS_CASES: list[tuple[str, bytes, int]] = [
    ("non-ASCII key", request("GET", "/v1/ws", UPGRADE, b"Authorization: Bearer \xe9\r\n"), 401),
    ("non-ASCII ?token=", request("GET", "/v1/ws?token=%C3%A9", UPGRADE), 401),
    ("two Authorization", request("GET", "/v1/ws", UPGRADE, AUTH, AUTH), 400),
    (
        "two Origin",
        request("GET", "/v1/ws", UPGRADE, AUTH, b"Origin: http://a\r\nOrigin: http://b\r\n"),
        400,
    ),
    ("a target that is no URL", request("GET", "//[", UPGRADE, AUTH), 400),
]


@pytest.mark.slow  # a frontend process
async def test_client_input_gets_a_4xx_on_both_doors_and_the_log_stays_quiet(
    redis_url: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "frontend.log"
    process, port = spawn_frontend(redis_url, log_path, "--api-key", KEY)
    try:
        for _ in range(20):  # repeats: the log must not grow with them
            for name, head, body, expected in V1_CASES:
                status, answer = await exchange(port, head, body)
                assert status == expected, (name, answer[:300])
                error = json.loads(answer)["error"]
                assert error["type"] == "invalid_request_error", (name, error)
                assert len(answer) < 2000, name  # client input is quoted cut short
            for name, head, expected in WS_CASES:
                status, answer = await exchange(port, head)
                assert status == expected, (name, answer[:300])
        await asyncio.sleep(0.2)  # let the last log lines reach the file
        text = log_path.read_text()
        assert "Traceback" not in text and "[error" not in text, text[-3000:]
        refused = [line for line in text.splitlines() if "request refused" in line]
        assert refused and all("[info" in line for line in refused), refused
        assert len(refused) <= 40, len(refused)  # 5 per code per window, not one per request
    finally:
        stop(process)


async def test_the_right_key_with_any_case_of_bearer_is_accepted(redis_url: str) -> None:
    frontend = await start_frontend(redis_url, api_keys=frozenset({KEY}))
    try:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            head = request("GET", "/v1/models", f"Authorization: {scheme} {KEY}\r\n".encode())
            assert (await exchange(frontend.port, head))[0] == 200, scheme
            ws_head = request(
                "GET", "/v1/ws", UPGRADE, f"authorization: {scheme}  {KEY}\r\n".encode()
            )
            assert (await exchange(frontend.port, ws_head))[0] == 101, scheme
        wrong = request("GET", "/v1/models", f"Authorization: Basic {KEY}\r\n".encode())
        assert (await exchange(frontend.port, wrong))[0] == 401
    finally:
        await frontend.stop()


# --- a prompt longer than the model's context -------------------------------------------

LONG = [{"role": "user", "content": "lighthouse keeper " * 1700}]  # ~5,000 tokens; context 2,048


@pytest.fixture
async def engine_port(stack: Stack) -> Any:
    stack.start_engine("engine-ctx")
    frontend = await start_frontend(stack.redis_url)
    yield frontend.port
    await frontend.stop()


async def test_a_prompt_over_the_context_is_the_clients_error_on_every_door(
    engine_port: int,
) -> None:
    base = f"http://127.0.0.1:{engine_port}"
    body = {"model": "wsinfer", "messages": LONG, "max_tokens": 4}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        whole = await http.post("/v1/chat/completions", json=body)
        assert whole.status_code == 400, whole.text
        error = whole.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "too_large"
        assert error["param"] == "messages" and "context" in error["message"]
        streamed = await http.post("/v1/chat/completions", json={**body, "stream": True})
        events = [
            line[6:] for line in streamed.text.split("\n") if line.startswith('data: {"error"')
        ]
        assert len(events) == 1, streamed.text
        assert json.loads(events[0])["error"]["type"] == "invalid_request_error"
        assert streamed.text.endswith("data: [DONE]\n\n")
    client = await Client.open(engine_port)
    try:
        await client.send(type="generate", messages=LONG, params={"max_new_tokens": 4})
        done = (await client.until("done"))[-1]
        assert done["finish_reason"] == "error" and done["error"]["code"] == "too_large"
    finally:
        await client.close()
