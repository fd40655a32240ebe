"""The client against the real server (`wsinfer serve` with the tiny test model).

Connections are cut with a TCP proxy between client and server, so the server
sees a real drop, not a polite close. Greedy decoding (temperature 0) makes
"the same text as an uninterrupted run" an exact comparison.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tests.stack import start_serve, stop_serve, until
from wsinfer.clients import (
    BadRequest,
    Conflict,
    NotFound,
    ReconnectPolicy,
    Turn,
    Unauthorized,
    connect,
)

pytestmark = pytest.mark.timeout(180)

API_KEY = "e2e-key"
GREEDY = {"temperature": 0, "max_new_tokens": 48}
FAST = ReconnectPolicy(max_attempts=20, max_time=30.0, base_delay=0.05, max_delay=0.5)


@pytest.fixture(scope="module")
def server_port(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> Iterator[int]:
    state = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", tiny_model, "--api-key", API_KEY)
    yield port
    assert stop_serve(process) == 0


class CutProxy:
    """A TCP proxy whose connections a test can cut (abort both sides) at will."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.refuse = False
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> CutProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        if self.refuse:
            down_w.transport.abort()
            return
        self.accepted += 1
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.pairs.append((down_w, up_w))
        await asyncio.gather(_pump(down_r, up_w), _pump(up_r, down_w))

    def cut(self) -> None:
        for down_w, up_w in self.pairs:
            down_w.transport.abort()
            up_w.transport.abort()
        self.pairs.clear()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


@pytest.fixture
async def proxy(server_port: int) -> AsyncIterator[CutProxy]:
    cut_proxy = await CutProxy(server_port).start()
    try:
        yield cut_proxy
    finally:
        await cut_proxy.stop()


def direct_url(port: int) -> str:
    return f"ws://127.0.0.1:{port}/v1/ws"


async def reference(port: int, prompt: str, **params: Any) -> str:
    """The text of an uninterrupted greedy run."""
    async with connect(direct_url(port), api_key=API_KEY) as client:
        turn = await client.start(prompt=prompt, params={**GREEDY, **params})
        return await turn.wait()


async def joined(deltas: AsyncIterator[str]) -> str:
    return "".join([text async for text in deltas])


async def consume_cutting(turn: Turn, proxy: CutProxy, cut_at: set[int]) -> list[str]:
    """Iterate the turn, cutting the connection after the given delta counts."""
    parts: list[str] = []
    async for text in turn:
        parts.append(text)
        if len(parts) in cut_at:
            proxy.cut()
    return parts


@pytest.mark.parametrize("codec", ["msgpack", "json"])
async def test_greedy_text_survives_connection_cuts(
    server_port: int, proxy: CutProxy, codec: str
) -> None:
    # Long enough to be still running after the cuts: a resume replays what was
    # missed as one delta, so a short turn on a fast machine may have too few
    # deltas left to reach a later cut.
    params = {**GREEDY, "max_new_tokens": 300}
    expected = await reference(server_port, "The history of the world", **params)
    async with connect(proxy.url, api_key=API_KEY, codec=codec, reconnect=FAST) as client:  # type: ignore[arg-type]
        assert client.codec == codec
        turn = await client.start(prompt="The history of the world", params=params)
        parts = await consume_cutting(turn, proxy, {1, 2, 4})
        assert client.reconnects >= 2
    assert "".join(parts) == turn.text == expected
    assert turn.finish_reason in ("length", "stop") and turn.usage is not None
    assert turn.seq == turn.usage.completion_tokens


@pytest.mark.parametrize("codec", ["msgpack", "json"])
async def test_logprobs_arrive_once_per_token_across_connection_cuts(
    server_port: int, proxy: CutProxy, codec: str
) -> None:
    """Every token's entry exactly once, in order, through cuts and replays; the same
    entries as an uninterrupted run's."""
    params = {**GREEDY, "max_new_tokens": 120, "ignore_eos": True, "logprobs": True}
    params["top_logprobs"] = 2
    async with connect(direct_url(server_port), api_key=API_KEY) as client:
        whole = await client.start(prompt="The history of the world", params=params)
        await whole.wait()
    assert len(whole.logprobs) == 120
    assert all(len(e["top_logprobs"]) == 2 for e in whole.logprobs)
    async with connect(proxy.url, api_key=API_KEY, codec=codec, reconnect=FAST) as client:  # type: ignore[arg-type]
        turn = await client.start(prompt="The history of the world", params=params)
        await consume_cutting(turn, proxy, {1, 2, 4})
    assert turn.text == whole.text
    assert [e["token"] for e in turn.logprobs] == [e["token"] for e in whole.logprobs]
    assert [e["logprob"] for e in turn.logprobs] == pytest.approx(
        [e["logprob"] for e in whole.logprobs], abs=1e-5
    )


async def test_generation_goes_on_while_disconnected(server_port: int, proxy: CutProxy) -> None:
    expected = await reference(server_port, "Once upon a time", max_new_tokens=64)
    async with connect(proxy.url, api_key=API_KEY, reconnect=FAST) as client:
        params = {**GREEDY, "max_new_tokens": 64}
        turn = await client.start(prompt="Once upon a time", params=params)
        async for _ in turn:
            proxy.refuse = True
            proxy.cut()
            break
        await asyncio.sleep(1.0)  # reconnects are refused meanwhile
        proxy.refuse = False
        assert await turn.wait() == expected


async def test_concurrent_turns_survive_a_cut(server_port: int, proxy: CutProxy) -> None:
    prompts = ["alpha beta", "gamma delta", "epsilon"]
    expected = [await reference(server_port, p) for p in prompts]
    async with connect(proxy.url, api_key=API_KEY, reconnect=FAST) as client:
        turns = [await client.start(prompt=p, params=GREEDY) for p in prompts]
        await until(lambda: all(t.seq > 0 for t in turns), 60, "every turn's first delta")
        proxy.cut()
        texts = await asyncio.gather(*(t.wait() for t in turns))
    assert texts == expected
    assert len({t.session for t in turns}) == 3


async def test_stop(server_port: int) -> None:
    expected = await reference(server_port, "Stop me", max_new_tokens=400)
    async with connect(direct_url(server_port), api_key=API_KEY) as client:
        turn = await client.start(prompt="Stop me", params={**GREEDY, "max_new_tokens": 400})
        async for _ in turn:
            break
        assert await turn.stop() == "cancelled"
    assert 0 < turn.seq < 400
    assert expected.startswith(turn.text)


async def test_pause_and_resume_give_the_uninterrupted_text(server_port: int) -> None:
    expected = await reference(server_port, "Pause here", max_new_tokens=80)
    async with connect(direct_url(server_port), api_key=API_KEY) as client:
        turn = await client.start(prompt="Pause here", params={**GREEDY, "max_new_tokens": 80})
        async for _ in turn:
            break
        seq = await turn.pause()
        assert turn.paused
        await asyncio.sleep(0.5)
        assert turn.seq == seq
        await turn.resume()
        assert await turn.wait() == expected


async def test_paused_turn_resumes_across_a_cut(server_port: int, proxy: CutProxy) -> None:
    expected = await reference(server_port, "Pause and cut", max_new_tokens=80)
    async with connect(proxy.url, api_key=API_KEY, reconnect=FAST) as client:
        turn = await client.start(prompt="Pause and cut", params={**GREEDY, "max_new_tokens": 80})
        async for _ in turn:
            break
        await turn.pause()
        proxy.cut()
        await asyncio.sleep(0.3)
        assert turn.paused and not turn.finished
        await turn.resume()
        assert await turn.wait() == expected


async def test_multi_turn_conversation(server_port: int) -> None:
    async def run_chat() -> tuple[list[str], Any]:
        async with connect(direct_url(server_port), api_key=API_KEY) as client:
            chat = client.conversation(params={"temperature": 0, "max_new_tokens": 12})
            answers = [await joined(chat.send(q)) for q in ("Hi!", "And then?")]
            turn = chat.last_turn
            await chat.close()
            return answers, turn

    first, turn = await run_chat()
    again, _ = await run_chat()
    assert first == again  # greedy and deterministic, warm cache or not
    assert turn is not None and turn.turn == 2


async def test_replay_of_a_finished_turn_from_another_client(server_port: int) -> None:
    async with connect(direct_url(server_port), api_key=API_KEY) as one:
        turn = await one.start(prompt="Replay me", params=GREEDY)
        text = await turn.wait()
    async with connect(direct_url(server_port), api_key=API_KEY, codec="json") as two:
        again = await two.attach(turn.session, turn.token, turn=turn.turn)
        assert await again.wait() == text
        assert again.finish_reason == turn.finish_reason
        await two.close_session(turn.session, turn.token)
        with pytest.raises(NotFound):
            await two.start(prompt="more", session=turn.session, token=turn.token)


async def test_error_codes_raise_the_right_exceptions(server_port: int) -> None:
    with pytest.raises(Unauthorized):
        await connect(direct_url(server_port), api_key="wrong").open()
    async with connect(direct_url(server_port), api_key=API_KEY) as client:
        with pytest.raises(BadRequest):
            await client.start(prompt="x", params={"no_such_param": 1})
        turn = await client.start(prompt="x", params={**GREEDY, "max_new_tokens": 400})
        with pytest.raises(Conflict):
            await client.start(prompt="y", session=turn.session)
        with pytest.raises(NotFound):
            await client.start(prompt="y", session=turn.session, token="not-the-token")
        await turn.stop()


async def test_chat_through_a_pipe(server_port: int) -> None:
    async with connect(direct_url(server_port), api_key=API_KEY) as client:
        chat = client.conversation(params={"temperature": 0, "max_new_tokens": 10})
        answers = [await joined(chat.send(q)) for q in ("hello", "again")]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "wsinfer",
        "chat",
        "--url",
        direct_url(server_port),
        "--api-key",
        API_KEY,
        "--temperature",
        "0",
        "--max-new-tokens",
        "10",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
    )
    out, err = await asyncio.wait_for(proc.communicate(b"hello\nagain\n/quit\n"), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == f"{answers[0]}\n{answers[1]}\n"
