"""`wsinfer chat` driven through pipes, against the stand-in server."""

from __future__ import annotations

import argparse
import asyncio
import io
import signal
import sys
from typing import Any

import pytest

from wsinfer.clients import chat

pytestmark = pytest.mark.timeout(60)


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(1, n + 1))


def args_for(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser.parse_args(["--url", url, *extra])


async def run_chat(url: str, script: str, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await chat._run(args_for(url, *extra), io.StringIO(script), out, err)
    return code, out.getvalue(), err.getvalue()


async def test_multi_turn_chat_through_a_pipe(fake_server: Any) -> None:
    code, out, err = await run_chat(
        fake_server.url, "hello\n\nagain\n/quit\nnot sent\n", "--max-new-tokens", "3"
    )
    assert code == 0
    assert out == f"{words(3)}\n{words(3)}\n"
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    assert len(generates) == 2
    assert generates[1]["session"] == generates[0].get("session", generates[1]["session"])
    assert generates[0]["params"] == {"max_new_tokens": 3}


async def test_params_and_system_prompt(fake_server: Any) -> None:
    script = "hi\n"
    extra = ("--temperature", "0", "--system", "sys", "--codec", "json")
    await run_chat(fake_server.url, script, *extra)
    (generate,) = [m for m in fake_server.received if m["type"] == "generate"]
    assert generate["params"] == {"temperature": 0.0}
    assert generate["messages"][0] == {"role": "system", "content": "sys"}
    assert fake_server.subprotocols_seen == ["wsinfer.v1.json"]


async def test_pause_resume_and_stop_commands(fake_server: Any) -> None:
    fake_server.delay = 0.01
    script = "one\n/pause\n/resume\ntwo\n/stop\n"
    code, out, err = await run_chat(fake_server.url, script, "--max-new-tokens", "40")
    assert code == 0
    first, second, _ = out.split("\n")
    assert first == words(40)  # paused and resumed: still whole, nothing twice
    assert second == words(len(second.split()))
    assert "paused at token" in err and "stopped" in err
    kinds = [m["type"] for m in fake_server.received]
    assert kinds.count("pause") == kinds.count("resume") == kinds.count("stop") == 1


async def test_new_session_and_unknown_command(fake_server: Any) -> None:
    script = "a\n/new\nb\n/bogus\n/pause\n"
    code, out, err = await run_chat(fake_server.url, script, "--max-new-tokens", "2")
    assert code == 0 and out == f"{words(2)}\n{words(2)}\n"
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    assert all("session" not in g for g in generates)  # /new started a fresh session
    assert any(m["type"] == "close" for m in fake_server.received)
    assert "unknown command /bogus" in err and "no answer in progress" in err


async def test_errors_are_reported_and_the_chat_goes_on(fake_server: Any) -> None:
    code, out, err = await run_chat(fake_server.url, "BUSY\nok\n", "--max-new-tokens", "1")
    assert code == 0 and out == f"{words(1)}\n"
    assert "overloaded" in err


async def test_unreachable_server_exits_1() -> None:
    code, _, err = await run_chat("ws://127.0.0.1:9/v1/ws", "hi\n")
    assert code == 1 and "cannot connect" in err


async def spawn_chat(url: str, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "wsinfer.clients.chat",
        "--url",
        url,
        *extra,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_subprocess_pipe(fake_server: Any) -> None:
    proc = await spawn_chat(fake_server.url, "--max-new-tokens", "4")
    out, err = await proc.communicate(b"hi\nthere\n")
    assert proc.returncode == 0, err
    assert out.decode() == f"{words(4)}\n{words(4)}\n"


async def test_ctrl_c_stops_the_answer_then_quits(fake_server: Any) -> None:
    fake_server.delay = 0.02
    proc = await spawn_chat(fake_server.url, "--max-new-tokens", "1000")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b"tell me everything\n")
    await proc.stdin.drain()
    await proc.stdout.readexactly(3)  # the answer is streaming
    proc.send_signal(signal.SIGINT)
    line = await proc.stderr.readline()
    assert b"stopping" in line
    assert b"stopped" in await proc.stderr.readline()
    assert any(m["type"] == "stop" for m in fake_server.received)
    proc.send_signal(signal.SIGINT)  # idle now: quits
    assert await asyncio.wait_for(proc.wait(), 10) == chat.EXIT_INTERRUPTED
