"""How far one frontend process goes: fan-out of deltas, idle sessions, reconnects.

    python benchmarks/bench_fanout.py [--streams 1,50,200,1000] [--tokens 40000]
        [--idle 10000] [--paced-streams 200] [--paced-rate 20] [--reconnects 300]
        [--repeat 3]

(``--tokens`` is split over each row's streams, at most 4096 per stream.)

Everything real except the model: a private redis-server, one ``wsinfer engine
--model fake:inf:stamp`` (tokens as fast as its loop goes, each token's text
its production time in µs), one ``wsinfer frontend`` process, and WebSocket
clients in this process (JSON subprotocol). Sections:

1. Relay: N streams at once, ``--tokens`` tokens in all; tokens/s the clients
   received (each token is one engine delta), frames/s (a frame may carry
   several tokens when a client falls behind: the coalescing), and the delay
   from each token's production in the engine to its receipt (p50/p99,
   saturated). The same clients against a bare ``websockets`` relay in another
   process that sends the same JSON deltas, one frame per token, round-robin
   over its streams (the ceiling), and the ratio. Both compress as the frontend
   does (messages under 1 KiB plain: ``wsinfer/sendpath.py``), so both send the
   same bytes. CPU is counted from the moment every socket is open, like the
   wall time: handshakes are not relaying. With ``--repeat N`` each row runs N
   times, service and bare alternating, and shows the median run with every
   run's tokens/s: this machine's throughput drifts by 20% from run to run.
2. Paced: ``--paced-streams`` streams at ``--paced-rate`` tokens/s each (an
   engine ``fake:RATE:stamp``): publish-to-receive p50/p99 below saturation.
3. Idle: ``--idle`` connections, each holding a session whose turn is done,
   then ``--idle-followed`` connections each following a paused turn (its
   stream stays in the fan-in's XREAD); the frontend's RSS per connection.
4. Reconnect: a new connection resumes a finished 50-token turn; time from
   starting the connection (and from sending ``resume``) to the first replayed
   delta, p50/p99, one at a time.

CPU columns are each process's CPU time over the row's wall time (1.0 = one
core); client, frontend, engine and Redis share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve

from wsinfer.sendpath import DeflateLargeFactory
from wsinfer.supervisor import EmbeddedRedis, _die_with_parent

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import Stack  # noqa: E402

JSON: Any = ["wsinfer.v1.json"]
CONNECT_BATCH = 200  # handshakes in flight at once
# Turns started at once: a frontend answers each generate with several Redis
# round trips from a bounded pool; the streams still all run together.
START_BATCH = 50
MAX_NEW_TOKENS = 4096  # the protocol's limit for one turn


# --- processes --------------------------------------------------------------------


def spawn(*args: str) -> subprocess.Popen[bytes]:
    """A Python script as a child that dies with this process (the bare relay; the
    service's processes are ``tests/stack.py``'s)."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=_die_with_parent,
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class Service:
    redis: EmbeddedRedis
    stack: Stack
    frontend: subprocess.Popen[bytes]
    port: int
    engine: subprocess.Popen[bytes] | None = None

    def start_engine(self, spec: str, max_batch: int) -> None:
        if self.engine is not None:
            self.stack.stop_one(self.engine)
        self.stack.model = spec
        self.engine = self.stack.start_engine(
            f"bench-{uuid.uuid4().hex[:6]}",
            *("--max-batch-size", str(max_batch), "--exit-with-parent"),
        )

    def pids(self) -> dict[str, int]:
        assert self.engine is not None and self.redis.process is not None
        return {
            "frontend": self.frontend.pid,
            "engine": self.engine.pid,
            "redis": self.redis.process.pid,
        }


@contextlib.contextmanager
def service() -> Iterator[Service]:
    with contextlib.ExitStack() as cleanup:
        state = Path(tempfile.mkdtemp(prefix="wsinfer-fanout-"))
        cleanup.callback(shutil.rmtree, state, ignore_errors=True)
        redis = EmbeddedRedis(state)
        cleanup.callback(redis.stop)
        redis.start()
        stack = Stack(redis.url, None, lease_ms=None, die_with_parent=True)
        cleanup.callback(stack.stop)
        frontend, port = stack.start_frontend("--max-queued-turns", "1000000")
        yield Service(redis, stack, frontend, port)


@contextlib.contextmanager
def bare_relay() -> Iterator[tuple[int, int]]:
    """The ceiling: this script's --bare-relay mode in its own process; (port, pid)."""
    process = spawn(str(Path(__file__).resolve()), "--bare-relay")
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline()), process.pid
    finally:
        stop(process)


# --- the bare relay (its own process) ---------------------------------------------------


async def bare_relay_main() -> None:
    """Per connection: {"n": N} in, N delta frames out, then done. One producer sends
    one delta to each active stream per round, as an engine step would."""
    active: dict[ServerConnection, list[int]] = {}  # -> [sent, n]
    more = asyncio.Event()
    deflate = [DeflateLargeFactory()]

    async def handler(ws: ServerConnection) -> None:
        async for raw in ws:
            active[ws] = [0, int(json.loads(raw)["n"])]
            more.set()

    async def producer() -> None:
        while True:
            await more.wait()
            more.clear()
            while active:
                stamp = f" {time.time_ns() // 1000}"
                for ws, state in list(active.items()):
                    await _bare_send(ws, state, stamp, active)
                await asyncio.sleep(0)

    # Compression as the frontend does it, so both send the same bytes.
    async with serve(handler, "127.0.0.1", 0, max_size=None, extensions=deflate) as server:
        task = asyncio.create_task(producer())
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.Future()
        task.cancel()


async def _bare_send(
    ws: ServerConnection, state: list[int], stamp: str, active: dict[Any, Any]
) -> None:
    state[0] += 1
    sid = "b" * 32
    message = {"type": "delta", "session": sid, "turn": 1, "seq": state[0], "text": stamp}
    try:
        await ws.send(json.dumps(message))
        if state[0] >= state[1]:
            await ws.send(json.dumps({"type": "done", "session": sid, "turn": 1, "seq": state[0]}))
            active.pop(ws, None)
    except Exception:  # a client gone: forget it
        active.pop(ws, None)


# --- clients ------------------------------------------------------------------------------


@dataclass
class StreamResult:
    tokens: int = 0
    frames: int = 0
    delays: list[float] = field(default_factory=list)  # seconds, per token
    session: dict[str, str] = field(default_factory=dict)


async def open_many(url: str, n: int) -> list[ClientConnection]:
    sockets: list[ClientConnection] = []
    for start in range(0, n, CONNECT_BATCH):
        batch = min(CONNECT_BATCH, n - start)
        sockets += await asyncio.gather(
            *(connect(url, subprotocols=JSON, max_size=None, open_timeout=60) for _ in range(batch))
        )
    return sockets


async def read_stream(ws: ClientConnection, result: StreamResult) -> StreamResult:
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 300))
        kind = message["type"]
        if kind == "delta":
            now_us = time.time_ns() / 1000
            stamps = message["text"].split()
            result.frames += 1
            result.tokens = message["seq"]
            result.delays += [(now_us - int(s)) / 1e6 for s in stamps]
        elif kind == "done":
            return result
        elif kind == "error":
            raise RuntimeError(f"refused: {message}")


async def run_streams(
    url: str, n: int, tokens: int, *, bare: bool, opened: Any = None
) -> tuple[list[StreamResult], float]:
    """N streams of ``tokens`` each; ``opened()`` is called once every socket is open."""
    sockets = await open_many(url, n)
    if opened is not None:
        opened()
    try:
        if bare:
            request = json.dumps({"n": tokens})
        else:
            params = {"max_new_tokens": tokens, "temperature": 0}
            request = json.dumps({"type": "generate", "prompt": "x", "params": params})
        results = [StreamResult() for _ in sockets]
        start = time.perf_counter()
        for first in range(0, n, START_BATCH):
            batch = list(zip(sockets, results, strict=True))[first : first + START_BATCH]
            await asyncio.gather(*(_start(ws, request, result, bare) for ws, result in batch))
        await asyncio.gather(*(read_stream(ws, r) for ws, r in zip(sockets, results, strict=True)))
        wall = time.perf_counter() - start
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    return results, wall


async def _start(ws: ClientConnection, request: str, result: StreamResult, bare: bool) -> None:
    """Send the request; for the service, wait for its ``session`` answer."""
    await ws.send(request)
    if not bare:
        answer = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if answer["type"] != "session":
            raise RuntimeError(f"refused: {answer}")
        result.session = {"session": answer["session"], "token": answer["token"]}


# --- sections -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Row:
    streams: int
    tokens_per_s: float
    frames_per_s: float
    p50_ms: float
    p99_ms: float
    cpu: dict[str, float]
    relay_us_per_token: float  # CPU time of the relaying process (frontend or bare) per token


async def measure(url: str, n: int, tokens: int, pids: dict[str, int], *, bare: bool) -> Row:
    before: dict[str, float] = {}

    def opened() -> None:  # CPU from here, as the wall time: handshakes are not relaying
        before.update({name: cpu_seconds(pid) for name, pid in pids.items()})
        before["client"] = time.process_time()

    results, wall = await run_streams(url, n, tokens, bare=bare, opened=opened)
    client_spent = time.process_time() - before.pop("client")
    spent = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    cpu = {name: value / wall for name, value in spent.items()}
    cpu["client"] = client_spent / wall
    got = sum(r.tokens for r in results)
    if got != n * tokens:
        raise RuntimeError(f"{n} streams: got {got} tokens, expected {n * tokens}")
    frames = sum(r.frames for r in results)
    delays = [d for r in results for d in r.delays]
    p50, p99 = pct(delays, 0.5) * 1e3, pct(delays, 0.99) * 1e3
    relay = spent.get("frontend", spent.get("bare", 0.0))
    return Row(n, got / wall, frames / wall, p50, p99, cpu, relay / got * 1e6)


def cpu_text(cpu: dict[str, float]) -> str:
    return " ".join(f"{name[0].upper()}{value:.2f}" for name, value in cpu.items())


async def relay_section(svc: Service, bare_port: int, bare_pid: int, args: Any) -> list[str]:
    lines = [
        "| streams | tokens each | service tok/s | frames/s | tokens/frame | delay p50 / p99 "
        "| bare ws tok/s | bare delay p50 / p99 | service / bare | CPU service (F E R C) "
        "| CPU bare (B C) | relay CPU µs/token: frontend / bare "
        "| service tok/s, all runs | bare tok/s, all runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    service_url = f"ws://127.0.0.1:{svc.port}/v1/ws"
    bare_url = f"ws://127.0.0.1:{bare_port}"
    for n in args.streams:
        tokens = min(MAX_NEW_TOKENS, max(20, args.tokens // n))
        await measure(service_url, n, 20, svc.pids(), bare=False)  # warm-up
        ours_runs: list[Row] = []
        bare_runs: list[Row] = []
        for _ in range(args.repeat):  # alternating, so a drifting machine hits both alike
            ours_runs.append(await measure(service_url, n, tokens, svc.pids(), bare=False))
            bare_runs.append(await measure(bare_url, n, tokens, {"bare": bare_pid}, bare=True))
        ours, bare = median_row(ours_runs), median_row(bare_runs)
        lines.append(
            f"| {n} | {tokens} | {ours.tokens_per_s:,.0f} | {ours.frames_per_s:,.0f} "
            f"| {ours.tokens_per_s / ours.frames_per_s:.2f} "
            f"| {ours.p50_ms:.1f} / {ours.p99_ms:.1f} ms | {bare.tokens_per_s:,.0f} "
            f"| {bare.p50_ms:.1f} / {bare.p99_ms:.1f} ms "
            f"| {ours.tokens_per_s / bare.tokens_per_s:.0%} | {cpu_text(ours.cpu)} "
            f"| {cpu_text(bare.cpu)} "
            f"| {ours.relay_us_per_token:.1f} / {bare.relay_us_per_token:.1f} "
            f"| {runs_text(ours_runs)} | {runs_text(bare_runs)} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def median_row(rows: list[Row]) -> Row:
    """The run with the median tokens/s (the lower middle one of an even count)."""
    return sorted(rows, key=lambda row: row.tokens_per_s)[(len(rows) - 1) // 2]


def runs_text(rows: list[Row]) -> str:
    return " / ".join(f"{row.tokens_per_s:,.0f}" for row in rows)


async def paced_section(svc: Service, args: Any) -> str:
    svc.start_engine(f"fake:{args.paced_rate}:stamp", max(args.paced_streams, 16))
    url = f"ws://127.0.0.1:{svc.port}/v1/ws"
    tokens = max(10, int(args.paced_rate * args.paced_seconds))
    row = await measure(url, args.paced_streams, tokens, svc.pids(), bare=False)
    return (
        f"Paced: {args.paced_streams} streams x {args.paced_rate} tok/s "
        f"({row.tokens_per_s:,.0f} tok/s in all): publish-to-receive p50 {row.p50_ms:.2f} ms, "
        f"p99 {row.p99_ms:.2f} ms; CPU {cpu_text(row.cpu)}; {row.frames_per_s:,.0f} frames/s"
    )


async def idle_section(svc: Service, n: int, *, followed: bool) -> str:
    """n connections, each holding a session (its turn done) or following a paused turn;
    the frontend's RSS per connection, and its CPU while they idle."""
    url = f"ws://127.0.0.1:{svc.port}/v1/ws"
    base = rss_bytes(svc.frontend.pid)
    start = time.perf_counter()
    sockets = await open_many(url, n)
    tokens = 4096 if followed else 1
    generate = json.dumps({"type": "generate", "prompt": "x", "params": {"max_new_tokens": tokens}})
    for first in range(0, n, START_BATCH):
        batch = sockets[first : first + START_BATCH]
        await asyncio.gather(*(_start_idle(ws, generate, followed) for ws in batch))
    setup = time.perf_counter() - start
    await asyncio.sleep(2)
    rss = rss_bytes(svc.frontend.pid)
    before, t0 = cpu_seconds(svc.frontend.pid), time.perf_counter()
    await asyncio.sleep(3)
    idle_cpu = (cpu_seconds(svc.frontend.pid) - before) / (time.perf_counter() - t0)
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
    what = "following a paused turn" if followed else "holding a session (its turn done)"
    return (
        f"Idle: {n:,} connections, each {what}: frontend RSS "
        f"{rss / 2**20:,.0f} MiB ({base / 2**20:,.0f} MiB before), "
        f"{(rss - base) / n / 1024:.1f} KiB per connection; set up in {setup:.1f} s "
        f"({n / setup:,.0f}/s); frontend CPU while they idle {idle_cpu:.2f}"
    )


async def _start_idle(ws: ClientConnection, generate: str, pause: bool) -> None:
    await ws.send(generate)
    session = json.loads(await ws.recv())
    if session["type"] != "session":
        raise RuntimeError(f"refused: {session}")
    if pause:
        ids = {"session": session["session"], "token": session["token"]}
        await ws.send(json.dumps({"type": "pause", **ids}))
    while json.loads(await asyncio.wait_for(ws.recv(), 120))["type"] != (
        "paused" if pause else "done"
    ):
        pass


async def reconnect_section(svc: Service, sessions: list[dict[str, str]], count: int) -> str:
    url = f"ws://127.0.0.1:{svc.port}/v1/ws"
    connect_to_first: list[float] = []
    resume_to_first: list[float] = []
    for i in range(count):
        session = sessions[i % len(sessions)]
        start = time.perf_counter()
        async with connect(url, subprotocols=JSON) as ws:
            sent = time.perf_counter()
            await ws.send(json.dumps({"type": "resume", "after": 0, **session}))
            while json.loads(await ws.recv())["type"] != "delta":
                pass
            now = time.perf_counter()
        connect_to_first.append(now - start)
        resume_to_first.append(now - sent)
    ms = [v * 1e3 for v in connect_to_first]
    rs = [v * 1e3 for v in resume_to_first]
    return (
        f"Reconnect to first replayed delta ({count} reconnects, one at a time): "
        f"p50 {pct(ms, 0.5):.2f} ms, p99 {pct(ms, 0.99):.2f} ms "
        f"(from sending resume: p50 {pct(rs, 0.5):.2f} ms, p99 {pct(rs, 0.99):.2f} ms)"
    )


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", default="1,50,200,1000")
    parser.add_argument("--tokens", type=int, default=40_000, help="tokens per relay row")
    parser.add_argument("--paced-streams", type=int, default=200)
    parser.add_argument("--paced-rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--paced-seconds", type=float, default=5.0)
    parser.add_argument("--idle", type=int, default=10_000, help="idle connections (0: skip)")
    parser.add_argument(
        "--idle-followed",
        type=int,
        default=1_000,
        help="idle connections each following a paused turn (0: skip)",
    )
    parser.add_argument("--reconnects", type=int, default=300)
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="relay runs per row, service and bare alternating; the table shows the median",
    )
    parser.add_argument("--bare-relay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s]  # "": no relay rows
    return args


async def run(args: argparse.Namespace) -> list[str]:
    out = [
        f"# bench_fanout: one frontend process; {os.cpu_count()} CPUs shared by client, "
        "frontend, engine (fake:inf:stamp) and Redis\n"
    ]
    with service() as svc, bare_relay() as (bare_port, bare_pid):
        svc.start_engine("fake:inf:stamp", max(1024, *args.streams, 0))
        relay = await relay_section(svc, bare_port, bare_pid, args)
        sessions = await _finished_sessions(svc)
        out += relay + [""]
        if args.reconnects:
            out.append(await reconnect_section(svc, sessions, args.reconnects))
            print(out[-1], file=sys.stderr, flush=True)
        if args.paced_streams:
            out.append(await paced_section(svc, args))
            print(out[-1], file=sys.stderr, flush=True)
        svc.start_engine(f"fake:{args.paced_rate}", max(args.idle, args.idle_followed, 16))
        for count, followed in ((args.idle, False), (args.idle_followed, True)):
            if count:
                out.append(await idle_section(svc, count, followed=followed))
                print(out[-1], file=sys.stderr, flush=True)
    return out


async def _finished_sessions(svc: Service) -> list[dict[str, str]]:
    """Ten sessions with a finished 50-token turn, to reconnect to."""
    results, _ = await run_streams(f"ws://127.0.0.1:{svc.port}/v1/ws", 10, 50, bare=False)
    return [r.session for r in results]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.bare_relay:
        asyncio.run(bare_relay_main())
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    lines = asyncio.run(run(args))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines.append(f"\nWhole run: {time.perf_counter() - started:.0f} s; load average {load}")
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
