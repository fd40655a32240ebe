"""`wsinfer serve` when its private Redis dies: restarted (and reaped), the
same engine and frontend carry on; if it keeps dying, serve exits non-zero.
Before, serve restarted only the engine, gave up after ~47 s and exited 0,
leaving the dead Redis a zombie."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from tests.models import tiny_model_dir
from tests.stack import Client, children_of, start_serve


def redis_child(serve_pid: int) -> int | None:
    for pid in children_of(serve_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            b"redis-server" in cmdline
            and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        ):
            return pid
    return None


def wait_new_redis(serve_pid: int, old: int | None, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = redis_child(serve_pid)
        if pid is not None and pid != old:
            return pid
        time.sleep(0.1)
    raise TimeoutError("no new redis-server child")


async def short_turn(port: int) -> dict[str, object]:
    """A turn, retried while the service says it is unavailable (for 60 s)."""
    deadline = time.monotonic() + 60
    client = await Client.open(port)
    try:
        while True:
            await client.send(
                type="generate", prompt="Hi", params={"temperature": 0, "max_new_tokens": 5}
            )
            first = await client.recv()
            if first["type"] == "session":
                return (await client.until("done"))[-1]
            assert first["code"] == "engine_unavailable" and time.monotonic() < deadline, first
            await asyncio.sleep(0.5)
    finally:
        await client.close()


@pytest.mark.timeout(300)
async def test_serve_restarts_its_redis_and_gives_up_non_zero(tmp_path: Path) -> None:
    process, port = start_serve(tmp_path, "--model", str(tiny_model_dir()))
    try:
        first = redis_child(process.pid)
        assert first is not None
        assert (await short_turn(port))["finish_reason"] == "length"
        os.kill(first, signal.SIGKILL)
        second = wait_new_redis(process.pid, first)
        assert not Path(f"/proc/{first}").exists()  # reaped, not a zombie
        assert (await short_turn(port))["finish_reason"] == "length"
        assert process.poll() is None

        # A Redis that keeps dying is a fault: serve stops, non-zero.
        current = second
        for _ in range(10):
            os.kill(current, signal.SIGKILL)
            try:
                current = wait_new_redis(process.pid, current, timeout=10)
            except TimeoutError:
                break
        assert process.wait(60) != 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
