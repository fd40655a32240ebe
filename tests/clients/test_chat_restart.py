"""`wsinfer chat` carries an answer across a restart of the whole server: killed
with -9 mid-answer, started again on the same port and data directory, the
chat prints exactly the answer an uninterrupted run would have, and goes on."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path

import pytest

from tests.clients.test_client_chat import args_for
from tests.ports import free_ports
from tests.stack import start_serve, stop_serve
from wsinfer.clients import chat
from wsinfer.engine.fake import WORDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKENS = 250  # 10 s at the fake engine's 25 tokens per second


async def test_an_answer_survives_kill_9_of_the_server(tmp_path: Path) -> None:
    [port] = free_ports(1)
    serve = ("--model", "fake:25")
    process, _ = start_serve(tmp_path, *serve, port=port, start_new_session=True)
    out, err = io.StringIO(), io.StringIO()
    script = io.StringIO("tell me a story\nand another\n/quit\n")
    args = args_for(f"ws://127.0.0.1:{port}/v1/ws", "--max-new-tokens", str(TOKENS))
    talk = asyncio.create_task(chat._run(args, script, out, err))
    try:
        while len(out.getvalue()) < 200:  # mid-answer
            assert not talk.done(), err.getvalue()
            await asyncio.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        process, _ = start_serve(tmp_path, *serve, port=port, start_new_session=True)
        assert await asyncio.wait_for(talk, 120) == 0, err.getvalue()
    finally:
        stop_serve(process)
    answer = "".join(WORDS[i % len(WORDS)] for i in range(TOKENS))
    assert out.getvalue() == f"{answer}\n{answer}\n"  # nothing lost, nothing repeated
