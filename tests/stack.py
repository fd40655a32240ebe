"""The one way tests start real stacks: Redis, engines, frontends, ``wsinfer serve``.

``Stack`` runs engine and frontend processes on a Redis; ``start_frontend`` runs a
frontend in the test's own event loop; ``start_serve`` runs the all-in-one
``wsinfer serve``. The fixtures in ``tests/conftest.py`` build on these: one
engine per module where a test does not need its own (starting one imports
torch and loads a model: seconds), with ``forget_sessions`` between tests.
``until`` waits for a condition, where a fixed sleep would be slow or flaky.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from wsinfer.server import Frontend, FrontendConfig
from wsinfer.sessions import keys
from wsinfer.sessions.connect import sync_client
from wsinfer.supervisor import _die_with_parent


@dataclass
class Stack:
    """Engines and frontends as ``wsinfer`` processes on one Redis, for tests and
    benchmarks alike."""

    redis_url: str
    model: str | None  # None: the engine's default model
    # Short, so that a takeover test does not wait long; None: the engine's default.
    lease_ms: int | None = 2000
    # The kernel stops the processes if this one dies (a benchmark interrupted).
    # Off for tests: the signal follows the *thread* that started a process.
    die_with_parent: bool = False
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _spawn(self, *args: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wsinfer",
                *args,
                "--redis-url",
                self.redis_url,
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            env=env,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        self.processes.append(process)
        return process

    def start_engine(
        self, engine_id: str, *extra: str, wait: bool = True, timeout_s: float = 120
    ) -> subprocess.Popen[bytes]:
        args = ["engine", "--engine-id", engine_id]
        args += ["--model", self.model] if self.model else []
        args += ["--lease-ms", str(self.lease_ms)] if self.lease_ms else []
        process = self._spawn(*args, *extra)
        if wait:
            self.wait_for_engine(engine_id, process, timeout_s)
        return process

    def wait_for_engine(
        self, engine_id: str, process: subprocess.Popen[bytes], timeout_s: float = 120
    ) -> None:
        wait_for_engine(self.redis_url, engine_id, process, timeout_s)

    def start_frontend(self, *extra: str, port: int = 0) -> tuple[subprocess.Popen[bytes], int]:
        process = self._spawn("frontend", "--port", str(port), *extra)
        assert process.stdout is not None
        port = port_from_banner(process.stdout.readline(), "frontend")
        return process, port

    def check_alive(self) -> None:
        """Fail if a process of this stack died: a shared engine that crashed in one
        test would otherwise show up as timeouts in every later test of the module."""
        dead = [p.args for p in self.processes if p.poll() is not None]
        assert not dead, f"stack processes exited: {dead}"

    def stop(self) -> None:
        # SIGINT, not SIGTERM: an engine's SIGTERM drains running turns first.
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in self.processes:
            _reap(process)

    def stop_one(self, process: subprocess.Popen[bytes]) -> None:
        """Stop one of the stack's processes (an engine replaced by another)."""
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        _reap(process)
        self.processes.remove(process)


def _reap(process: subprocess.Popen[bytes]) -> None:
    """Wait for a process told to stop; killed if it has not in 15 s."""
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def forget_sessions(redis_url: str) -> None:
    """Delete every session's keys, keeping the work queues and engine registry.

    What lets tests share one engine yet start from no sessions: the ``{q}``
    keys (the engines' consumer group, their registration) stay, so a running
    engine keeps serving; a turn it still runs for a deleted session ends at
    its next publish (the script answers ``not_found``). SCAN, not FLUSHALL:
    the engine's heartbeat would re-register it only a moment later.
    """
    client = sync_client(redis_url)
    try:
        for key in list(client.scan_iter(match=f"{keys.PREFIX}:*", count=1000)):
            if keys.QUEUE_TAG not in key.decode():
                client.delete(key)  # one by one: on a cluster, keys of many slots
    finally:
        client.close()


async def start_frontend(redis_url: str, **overrides: Any) -> Frontend:
    """A frontend in the test's own event loop (its state is there to inspect).

    It touches watched sessions every 0.3 s, so that an engine's short idle
    limit never pauses a turn a client is attached to.
    """
    settings: dict[str, Any] = {"port": 0, "touch_interval_s": 0.3, **overrides}
    frontend = Frontend(FrontendConfig(redis_url=redis_url, **settings))
    await frontend.start()
    return frontend


def start_serve(
    state: Path, *args: str, port: int = 0, **popen: Any
) -> tuple[subprocess.Popen[str], int]:
    """``wsinfer serve`` keeping its runtime dir (the private Redis's socket) and its
    data dir (``state/data``, the sessions) under ``state``: a serve killed with -9
    cannot remove them, and tests leave nothing behind in /tmp or the home."""
    command = [sys.executable, "-m", "wsinfer", "serve", "--port", str(port)]
    env = {"PYTHONUNBUFFERED": "1", "TMPDIR": str(state), "WSINFER_DATA_DIR": str(state / "data")}
    process = subprocess.Popen(
        [*command, "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env, **popen.pop("env", {})},
        **popen,
    )
    assert process.stdout is not None
    try:
        return process, port_from_banner(process.stdout.readline(), "serve")
    except RuntimeError:
        process.kill()
        raise


def stop_serve(process: subprocess.Popen[str], timeout_s: float = 30) -> int:
    """Ctrl-C, as a user stops it; killed if it does not exit in time."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def served(*args: str) -> Iterator[int]:
    """``wsinfer serve ARGS`` with its state in a temporary directory, for a
    ``with`` block: yields its port, and stops it (then removes the state) after."""
    with tempfile.TemporaryDirectory(prefix="wsinfer-serve-") as state:
        process, port = start_serve(Path(state), *args)
        try:
            yield port
        finally:
            stop_serve(process)


def children_of(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines())
        except (OSError, ValueError):
            continue
        if int(fields.get("PPid", "0").strip()) == pid:
            found.append(int(status.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    """Children, their children, and so on: a process tree as it stands now."""
    found = []
    for child in children_of(pid):
        found += [child, *descendants(child)]
    return found


def port_from_banner(line: str | bytes, what: str) -> int:
    """The port in the ``ws://HOST:PORT/v1/ws`` line wsinfer prints once it listens."""
    text = line.decode() if isinstance(line, bytes) else line
    if "ws://" not in text:
        raise RuntimeError(f"{what} did not start: {text!r}")
    return int(text.split("ws://")[1].split("/")[0].rsplit(":", 1)[1])


def wait_for_engine(
    redis_url: str, engine_id: str, process: subprocess.Popen[bytes], timeout_s: float = 120
) -> None:
    """Until the engine's first heartbeat is in Redis (its model is loaded)."""
    client = sync_client(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.zscore(keys.ENGINES, engine_id) is not None:
            return
        if process.poll() is not None:
            raise RuntimeError(f"engine exited with {process.returncode}")
        time.sleep(0.1)
    raise TimeoutError(f"engine did not register within {timeout_s:.0f} s")


class Client:
    """A raw protocol client: JSON frames, nothing clever (the tests check the server)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws

    @classmethod
    async def open(cls, port: int, **kwargs: Any) -> Client:
        ws = await connect(
            f"ws://127.0.0.1:{port}/v1/ws",
            subprotocols=["wsinfer.v1.json"],  # type: ignore[list-item]
            **kwargs,
        )
        return cls(ws)

    async def send(self, **message: Any) -> None:
        await self.ws.send(json.dumps(message))

    async def recv(self, timeout: float = 60) -> dict[str, Any]:
        return dict(json.loads(await asyncio.wait_for(self.ws.recv(), timeout)))

    async def until(self, kind: str, timeout: float = 120) -> list[dict[str, Any]]:
        """Every message up to and including the first of type ``kind``."""
        out: list[dict[str, Any]] = []
        while True:
            message = await self.recv(timeout)
            out.append(message)
            if message["type"] == kind:
                return out

    async def close(self) -> None:
        await self.ws.close()


def joined(messages: list[dict[str, Any]], after: int = 0) -> tuple[str, int]:
    """Text of the deltas (checking seq strictly grows) and the last seq."""
    text, seq = "", after
    for message in messages:
        if message["type"] == "delta":
            assert message["seq"] > seq, f"seq went from {seq} to {message['seq']}"
            text += message["text"]
            seq = message["seq"]
    return text, seq


async def until(check: Any, timeout_s: float = 5.0, what: str = "", every_s: float = 0.01) -> None:
    """Poll ``check`` (awaited when it returns an awaitable) every ``every_s`` until
    it is true; fail the test, naming ``what`` it waited for, if it is not within
    ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        assert loop.time() < deadline, f"timed out after {timeout_s} s waiting for {what or check}"
        await asyncio.sleep(every_s)


@dataclass
class Logged:
    """A ``wsinfer`` process whose stdout and stderr go to files a test can read."""

    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path

    @classmethod
    def spawn(cls, folder: Path, name: str, *args: str) -> Logged:
        out, err = folder / f"{name}.out", folder / f"{name}.err"
        with out.open("wb") as stdout, err.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "wsinfer", *args],
                stdout=stdout,
                stderr=stderr,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return cls(process, out, err)

    def lines(self) -> list[str]:
        text = self.stdout.read_text() + self.stderr.read_text()
        return [line for line in text.splitlines() if line.strip()]

    def records(self) -> list[dict[str, Any]]:
        """Every line as JSON (fails the test on a line that is not)."""
        return [json.loads(line) for line in self.lines()]

    def wait_for(self, event: str, timeout_s: float = 60, **fields: Any) -> dict[str, Any]:
        """The first JSON log record with this event (and these fields)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines():
                record = json.loads(line) if line.startswith("{") else {}
                if record.get("event") == event and fields.items() <= record.items():
                    return dict(record)
            if self.process.poll() is not None:
                raise RuntimeError(f"exited with {self.process.returncode}: {self.lines()}")
            time.sleep(0.05)
        raise TimeoutError(f"no {event!r} in {self.lines()}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()
