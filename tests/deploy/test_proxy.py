"""Through deploy/nginx/wsinfer.conf (Debian's nginx, TLS): a WebSocket session
started on one frontend resumes on the other after its frontend is stopped
(SIGTERM: it closes with 1012), and the joined text is the uninterrupted one."""

from __future__ import annotations

import asyncio
import shutil
import signal
import ssl
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.deploy.nginx import NginxProxy
from tests.ports import free_ports
from tests.stack import Client, Stack, joined

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx")
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
GREEDY = {"temperature": 0, "max_new_tokens": 300}


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[NginxProxy]:
    proxy = NginxProxy(tmp_path, upstreams=free_ports(2))
    yield proxy
    proxy.stop()


async def open_tls(proxy: NginxProxy) -> Client:
    context = ssl.create_default_context(cafile=str(proxy.state / "tls.crt"))
    context.check_hostname = False
    ws = await connect(
        f"wss://127.0.0.1:{proxy.tls_port}/v1/ws",
        ssl=context,
        subprotocols=["wsinfer.v1.json"],  # type: ignore[list-item]
    )
    return Client(ws)


def connections(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("wsinfer_connections "):
                return float(line.split()[1])
    return 0.0


async def test_a_session_resumes_through_nginx_after_its_frontend_stops(
    stack: Stack, proxy: NginxProxy
) -> None:
    upstreams = proxy.upstreams
    frontends = {}
    for port in upstreams:
        frontends[port] = stack.start_frontend(port=port)[0]
    stack.start_engine("engine-1")
    proxy.start()

    client = await open_tls(proxy)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    reference, _ = joined(await client.until("done"))

    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = await client.recv()
    head = [await client.recv() for _ in range(2)]
    counts = {p: await asyncio.to_thread(connections, p) for p in upstreams}
    serving = max(counts, key=lambda p: counts[p])
    assert counts[serving] == 1 and sum(counts.values()) == 1
    frontends[serving].send_signal(signal.SIGTERM)
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            head.append(await client.recv())
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    assert frontends[serving].wait(30) == 0
    text, seq = joined(head)

    resumed = await open_tls(proxy)  # nginx sends it to the frontend still up
    await resumed.send(type="resume", session=session["session"], token=session["token"], after=seq)
    tail, _ = joined(await resumed.until("done"), after=seq)
    await resumed.close()
    assert text + tail == reference
