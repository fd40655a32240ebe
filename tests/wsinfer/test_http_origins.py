"""Browsers and hosts (issue 19, item 5): DNS rebinding is refused without an API
key, pages on an ``--allowed-origin`` can call the HTTP API (CORS, preflight),
and only a client with the key learns which routes exist. In-process frontends
on a real Redis (no engine: nothing here needs a turn to run), real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tests.stack import start_frontend
from tests.wsinfer.test_http_answers import UPGRADE, exchange
from wsinfer.access import Access
from wsinfer.server import Frontend

KEY = "sekrit"
APP = "https://app.example"
REBIND = "rebind.attacker.example"


@pytest.fixture
async def open_frontend(redis_url: str) -> AsyncIterator[Frontend]:
    """No API key: Host and Origin are the only guards."""
    frontend = await start_frontend(
        redis_url, allowed_origins=frozenset({APP}), allowed_hosts=frozenset({"chat.example"})
    )
    yield frontend
    await frontend.stop()


@pytest.fixture
async def keyed_frontend(redis_url: str) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(
        redis_url, api_keys=frozenset({KEY}), allowed_origins=frozenset({APP})
    )
    yield frontend
    await frontend.stop()


def client(frontend: Frontend) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{frontend.port}", timeout=10)


async def handshake_status(frontend: Frontend, headers: dict[str, str]) -> int:
    """The status of a ``/v1/ws`` handshake with this Host (and Origin)."""
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head = f"GET /v1/ws HTTP/1.1\r\n{lines}".encode() + UPGRADE
    return (await exchange(frontend.port, head))[0]


async def test_dns_rebinding_is_refused_on_both_doors(open_frontend: Frontend) -> None:
    port = open_frontend.port
    rebound = {"Host": f"{REBIND}:{port}", "Origin": f"http://{REBIND}:{port}"}
    async with client(open_frontend) as http:
        for path in ("/v1/models", "/metrics", "/healthz", "/"):
            answer = await http.get(path, headers=rebound)
            assert answer.status_code == 403, (path, answer.text)
        assert (await http.get("/v1/models", headers={"Host": REBIND})).status_code == 403
    assert await handshake_status(open_frontend, rebound) == 403


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{port}",
        "localhost:{port}",
        "LOCALHOST.:{port}",
        "app.localhost:{port}",
        "[::1]:{port}",
        "10.1.2.3:{port}",  # an address: nothing to rebind
        "chat.example",  # --allowed-host
    ],
)
async def test_the_servers_own_names_are_answered(open_frontend: Frontend, host: str) -> None:
    headers = {"Host": host.format(port=open_frontend.port)}
    async with client(open_frontend) as http:
        assert (await http.get("/v1/models", headers=headers)).status_code == 200
    assert await handshake_status(open_frontend, headers) == 101


def test_host_rules() -> None:
    access = Access([], [], ["Chat.Example."], "myhost")
    assert access.host_allowed("myhost:8000") and access.host_allowed("chat.example")
    assert not access.host_allowed("chat.example.attacker.example")
    assert not access.host_allowed("[::1")  # malformed
    assert Access([], [], ["*"], "127.0.0.1").host_allowed(REBIND)


async def test_with_an_api_key_the_key_is_the_guard(keyed_frontend: Frontend) -> None:
    rebound = {"Host": REBIND, "Origin": f"http://{REBIND}"}
    async with client(keyed_frontend) as http:
        assert (await http.get("/v1/models", headers=rebound)).status_code == 401
        with_key = {**rebound, "Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/models", headers=with_key)).status_code == 200


async def test_a_page_on_an_allowed_origin_calls_the_api(keyed_frontend: Frontend) -> None:
    async with client(keyed_frontend) as http:
        preflight = await http.options(
            "/v1/chat/completions",
            headers={
                "Origin": APP,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )  # a preflight carries no key
        assert preflight.status_code == 204, preflight.text
        assert preflight.headers["access-control-allow-origin"] == APP
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed = preflight.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
        answer = await http.get(
            "/v1/models", headers={"Origin": APP, "Authorization": f"Bearer {KEY}"}
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == APP
        assert "X-Wsinfer-Token" in answer.headers["access-control-expose-headers"]
        refused = await http.get("/v1/models", headers={"Origin": APP})  # errors are readable
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == APP


async def test_other_origins_get_no_cors(keyed_frontend: Frontend) -> None:
    other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    async with client(keyed_frontend) as http:
        preflight = await http.options("/v1/chat/completions", headers=other)
        assert preflight.status_code == 403
        assert "access-control-allow-origin" not in preflight.headers
        answer = await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        assert "access-control-allow-origin" not in answer.headers  # no Origin: no CORS


async def test_routes_are_answered_only_after_the_key(keyed_frontend: Frontend) -> None:
    async with client(keyed_frontend) as http:
        unknown = [("GET", "/v1/nope"), ("PUT", "/v1/models"), ("GET", "/nope"), ("POST", "/x")]
        for method, path in unknown:
            answer = await http.request(method, path)
            assert answer.status_code == 401, (method, path, answer.text)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/v1/nope", headers=auth)).status_code == 404
        wrong = await http.put("/v1/models", headers=auth)
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, OPTIONS"
        for public in ("/healthz", "/metrics", "/"):
            assert (await http.get(public)).status_code in (200, 503), public
