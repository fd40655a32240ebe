"""Capacity: how deltas/s and open sessions scale with frontend processes, on
one Redis and on a 3-primary Redis Cluster, and Redis memory per session.

    python benchmarks/bench_capacity.py [--frontends 1,2,4] [--redis single,cluster]
        [--streams 200] [--tokens 60] [--sessions 500] [--memory-sessions 100]

Everything real except the model: redis-server on TCP (one server, or three
``--cluster-enabled`` primaries joined by ``redis-cli --cluster create``), one
``wsinfer engine --model fake:inf`` (a token for every stream at every step,
as fast as its loop goes), up to 4 ``wsinfer frontend`` processes, and
``--client-procs`` WebSocket client processes that spread their connections
round-robin over the frontends of the row. Per Redis and frontend count:

- Relay: ``--streams`` turns of ``--tokens`` tokens at once; deltas/s the
  clients received (``seq`` counts them: one engine delta is one token), how
  many a WebSocket frame carried (a frontend that falls behind merges them,
  which makes each cheaper), and each process's CPU over the row (1.0 = one
  core): frontends in all and the busiest one, engine, Redis in all and its
  busiest node, clients. CPU
  microseconds per delta for the frontends and for Redis give the ceilings:
  one frontend process relays at most 1e6 / (its µs per delta) deltas/s on a
  core of its own, and a Redis node as much for its share of the sessions.
- Open sessions: ``--sessions`` connections, each opened and given a one-token
  turn, then held open: sessions opened per second, the frontends' RSS per
  held session, and their CPU while the sessions idle.

Redis memory per queued, active and idle session is
``bench_redis_memory.measure`` on the fresh Redis of each kind, before the
engine starts. All processes share this machine's cores: with fewer cores
than processes the rows are CPU-bound, so read the µs per delta, not the
totals, to size a deployment (``os.cpu_count()`` and the load average are
printed with the table).
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

import redis
from websockets.asyncio.client import ClientConnection, connect

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the process helpers of the test suite and benchmarks
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_fanout import cpu_seconds, rss_bytes  # noqa: E402
from benchmarks.bench_redis_memory import measure as redis_memory  # noqa: E402
from tests.cluster import LocalCluster, free_ports  # noqa: E402
from tests.stack import Stack  # noqa: E402
from wsinfer.supervisor import _die_with_parent  # noqa: E402

JSON: Any = ["wsinfer.v1.json"]
CONNECT_BATCH = 100  # handshakes in flight at once per client process
# Nothing for this long means a stuck turn (the cluster fan-in can stall: see
# deploy/README.md): fail the run rather than wait.
TURN_TIMEOUT_S = 60.0
MEMORY_TOKENS = 500  # the idle session's finished turn, as in bench_redis_memory


# --- Redis -------------------------------------------------------------------------------


@dataclass
class Redis:
    """The Redis of a row: its URL and its server processes."""

    kind: str
    url: str
    pids: list[int]


@contextlib.contextmanager
def single_redis(state: Path) -> Iterator[Redis]:
    (port,) = free_ports(1)
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    command += ["--appendonly", "no", "--dir", str(state), "--logfile", str(state / "redis.log")]
    process = subprocess.Popen(command, preexec_fn=_die_with_parent)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while not _pings(client):
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.05)
        yield Redis("one server", f"redis://127.0.0.1:{port}/0", [process.pid])
    finally:
        process.terminate()
        process.wait(10)


def _pings(client: redis.Redis) -> bool:
    with contextlib.suppress(redis.ConnectionError):
        return bool(client.ping())
    return False


@contextlib.contextmanager
def cluster_redis(state: Path) -> Iterator[Redis]:
    cluster = LocalCluster(state, primaries=3, replicas=0)
    try:
        cluster.start()
        pids = [p.pid for p in cluster.processes.values()]
        yield Redis("3-primary cluster", cluster.url, pids)
    finally:
        cluster.stop()


def flush(url: str) -> None:
    """Empty every primary (the memory section leaves sessions behind)."""
    from wsinfer.sessions.connect import sync_client

    client = sync_client(url)
    client.flushall()  # on a cluster: every primary
    client.close()


# --- the service -------------------------------------------------------------------------


@dataclass
class Service:
    redis: Redis
    stack: Stack
    engine: subprocess.Popen[bytes]
    frontends: list[tuple[subprocess.Popen[bytes], int]] = field(default_factory=list)

    def add_frontends(self, total: int) -> None:
        while len(self.frontends) < total:
            self.frontends.append(self.stack.start_frontend("--max-queued-turns", "1000000"))

    def pids(self, frontends: int) -> dict[str, list[int]]:
        return {
            "frontend": [p.pid for p, _ in self.frontends[:frontends]],
            "engine": [self.engine.pid],
            "redis": self.redis.pids,
        }


@contextlib.contextmanager
def service(kind: str, args: argparse.Namespace) -> Iterator[tuple[Service, str]]:
    """The Redis of ``kind`` with an engine; also the memory lines, measured first."""
    state = Path(tempfile.mkdtemp(prefix="wsinfer-capacity-"))
    starter = cluster_redis if kind == "cluster" else single_redis
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, state, ignore_errors=True)
        store = cleanup.enter_context(starter(state))
        memory = memory_line(store, args.memory_sessions)
        flush(store.url)
        stack = Stack(store.url, "fake:inf", lease_ms=None, die_with_parent=True)
        cleanup.callback(stack.stop)
        engine = stack.start_engine(
            f"capacity-{uuid.uuid4().hex[:6]}",
            *("--max-batch-size", str(max(args.streams, args.sessions, 16))),
            "--exit-with-parent",
        )
        yield Service(store, stack, engine), memory


def memory_line(store: Redis, sessions: int) -> str:
    queued = redis_memory(store.url, sessions, 0, finish=False)
    active = redis_memory(store.url, sessions, 100, finish=False)
    idle = redis_memory(store.url, sessions, MEMORY_TOKENS, finish=True)
    per_1k = (idle - queued) * 1000 / MEMORY_TOKENS
    return (
        f"| {store.kind} | {queued / 1024:.1f} KB | {active / 1024:.1f} KB "
        f"| {idle / 1024:.1f} KB | {per_1k / 1024:.0f} KB |"
    )


# --- client processes ----------------------------------------------------------------------


@dataclass
class Load:
    """One phase of a client process (it reads one as a JSON line on stdin)."""

    ports: list[int]
    connections: int  # this process's
    tokens: int
    connect_in_turn: bool  # time the connections too (open sessions), else open first
    hold: bool  # keep the connections open until told to close them


async def worker_main() -> None:
    """Phase after phase, until stdin ends: a JSON line of results for each."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        await phase(Load(**json.loads(line)), loop)


async def phase(load: Load, loop: asyncio.AbstractEventLoop) -> None:
    """Connections round-robin over ``ports``; after ``go``, one turn on each."""
    sockets: list[ClientConnection] = []
    if not load.connect_in_turn:
        sockets = await open_many(load.ports, load.connections)
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    start = time.monotonic()
    if load.connect_in_turn:
        sockets = await open_many(load.ports, load.connections)
    results = await asyncio.gather(*(turn(ws, load.tokens) for ws in sockets))
    end = time.monotonic()
    errors = [r[2] for r in results if r[2]]
    print(json.dumps({"start": start, "end": end, "tokens": sum(r[0] for r in results),
                      "frames": sum(r[1] for r in results), "errors": errors[:3],
                      "failed": len(errors)}), flush=True)  # fmt: skip
    if load.hold:
        await loop.run_in_executor(None, sys.stdin.readline)
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)


async def open_many(ports: list[int], n: int) -> list[ClientConnection]:
    urls = [f"ws://127.0.0.1:{ports[i % len(ports)]}/v1/ws" for i in range(n)]
    sockets: list[ClientConnection] = []
    for first in range(0, n, CONNECT_BATCH):
        sockets += await asyncio.gather(
            *(
                connect(url, subprotocols=JSON, max_size=None, open_timeout=120)
                for url in urls[first : first + CONNECT_BATCH]
            )
        )
    return sockets


async def turn(ws: ClientConnection, tokens: int) -> tuple[int, int, str]:
    """One turn to its end: (tokens received, frames, the error if it failed)."""
    params = {"max_new_tokens": tokens, "temperature": 0}
    await ws.send(json.dumps({"type": "generate", "prompt": "x", "params": params}))
    seq = frames = 0
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), TURN_TIMEOUT_S))
        kind = message["type"]
        if kind == "delta":
            seq, frames = message["seq"], frames + 1
        elif kind == "done":
            return seq, frames, "" if message["seq"] == tokens else f"done at {message['seq']}"
        elif kind == "error":
            return seq, frames, f"{message.get('code')}: {message.get('message')}"


@contextlib.contextmanager
def client_processes(count: int) -> Iterator[list[subprocess.Popen[str]]]:
    """``count`` client processes for the whole run, started once."""
    workers = []
    try:
        for _ in range(count):
            workers.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--client-worker"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                preexec_fn=_die_with_parent,
            ))  # fmt: skip
        yield workers
    finally:
        for worker in workers:
            with contextlib.suppress(OSError):
                worker.kill()
            worker.wait()


def prepare(workers: list[subprocess.Popen[str]], load: Load) -> None:
    """Each process its share of ``load``; back when all are ready to go."""
    count = len(workers)
    for i, worker in enumerate(workers):
        share = load.connections // count + (i < load.connections % count)
        _say(worker, json.dumps({**load.__dict__, "connections": share}))
    for worker in workers:
        _expect(worker, "ready")


def _say(worker: subprocess.Popen[str], line: str) -> None:
    assert worker.stdin is not None
    worker.stdin.write(line + "\n")
    worker.stdin.flush()


def _expect(worker: subprocess.Popen[str], what: str) -> str:
    assert worker.stdout is not None
    line = worker.stdout.readline()
    if not line.startswith(what):
        raise RuntimeError(f"client process: expected {what!r}, got {line!r}")
    return line


def tell(workers: list[subprocess.Popen[str]]) -> None:
    for worker in workers:
        _say(worker, "go")


def results(workers: list[subprocess.Popen[str]]) -> tuple[float, int, int]:
    """(wall from the first start to the last end, tokens and frames received in all)."""
    parts = [json.loads(_expect(w, "{")) for w in workers]
    failed = sum(p["failed"] for p in parts)
    if failed:
        raise RuntimeError(f"{failed} turns failed: {[e for p in parts for e in p['errors']]}")
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return wall, sum(p["tokens"] for p in parts), sum(p["frames"] for p in parts)


def run_phase(workers: list[subprocess.Popen[str]], load: Load) -> tuple[float, int, int]:
    prepare(workers, load)
    tell(workers)
    return results(workers)


# --- rows -----------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of each process group between two readings."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.start = {pid: cpu_seconds(pid) for pids in groups.values() for pid in pids}

    def spent(self) -> dict[str, list[float]]:
        return {
            name: [cpu_seconds(pid) - self.start[pid] for pid in pids]
            for name, pids in self.groups.items()
        }


Workers = list[subprocess.Popen[str]]


def relay_cells(
    svc: Service, frontends: int, workers: Workers, args: argparse.Namespace
) -> list[str]:
    ports = [port for _, port in svc.frontends[:frontends]]
    run_phase(workers, Load(ports, args.streams, 5, connect_in_turn=False, hold=False))  # warm
    prepare(workers, Load(ports, args.streams, args.tokens, connect_in_turn=False, hold=False))
    meter = CpuMeter(svc.pids(frontends) | {"client": [w.pid for w in workers]})
    tell(workers)
    wall, deltas, frames = results(workers)
    spent = meter.spent()
    share = {name: [s / wall for s in values] for name, values in spent.items()}
    return [
        f"{deltas / wall:,.0f}",
        f"{deltas / frames:.2f}",
        f"{sum(share['frontend']):.2f} / {max(share['frontend']):.2f}",
        f"{share['engine'][0]:.2f}",
        f"{sum(share['redis']):.2f} / {max(share['redis']):.2f}",
        f"{sum(share['client']):.2f}",
        f"{sum(spent['frontend']) / deltas * 1e6:.0f}",
        f"{sum(spent['redis']) / deltas * 1e6:.1f}",
    ]


def sessions_cells(
    svc: Service, frontends: int, workers: Workers, args: argparse.Namespace
) -> list[str]:
    ports = [port for _, port in svc.frontends[:frontends]]
    pids = svc.pids(frontends)["frontend"]
    before = sum(rss_bytes(pid) for pid in pids)
    wall, _, _ = run_phase(workers, Load(ports, args.sessions, 1, connect_in_turn=True, hold=True))
    time.sleep(1)  # let the last turns' clean-up run before reading memory
    rss = sum(rss_bytes(pid) for pid in pids) - before
    meter = CpuMeter({"frontend": pids})
    time.sleep(2)
    idle = sum(meter.spent()["frontend"]) / 2
    tell(workers)  # close them
    return [f"{args.sessions / wall:,.0f}", f"{rss / args.sessions / 1024:.1f}", f"{idle:.2f}"]


HEADER = [
    "| Redis | frontends | deltas/s | deltas per frame | CPU frontends: all / busiest | CPU engine "
    "| CPU Redis: all / busiest node | CPU clients | frontend µs CPU per delta "
    "| Redis µs CPU per delta | sessions opened/s | frontend RSS KiB per open session "
    "| CPU frontends, sessions idle |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def kind_rows(kind: str, workers: Workers, args: argparse.Namespace) -> tuple[list[str], str]:
    rows = []
    with service(kind, args) as (svc, memory):
        for frontends in args.frontends:
            svc.add_frontends(frontends)
            cells = relay_cells(svc, frontends, workers, args)
            cells += sessions_cells(svc, frontends, workers, args)
            rows.append(f"| {svc.redis.kind} | {frontends} | " + " | ".join(cells) + " |")
            print(rows[-1], file=sys.stderr, flush=True)
    return rows, memory


def run(args: argparse.Namespace) -> list[str]:
    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    out = [
        f"# bench_capacity: {os.cpu_count()} CPUs shared by every process below "
        f"(load average before: {load}); {args.streams} streams x {args.tokens} tokens "
        f"per relay row, {args.sessions} sessions per open-sessions row, "
        f"{args.client_procs} client processes, one fake:inf engine",
        "",
        *HEADER,
    ]
    memory = [
        "",
        f"Redis memory per session ({args.memory_sessions} sessions per cell, bench_redis_memory):",
        "",
        "| Redis | queued | active (100 tokens) | idle (one finished 500-token turn) "
        "| per 1,000 tokens |",
        "|---|---|---|---|---|",
    ]
    with client_processes(args.client_procs) as workers:
        for kind in args.redis:
            rows, line = kind_rows(kind, workers, args)
            out += rows
            memory.append(line)
    after = "/".join(f"{v:.1f}" for v in os.getloadavg())
    return [*out, "", f"Load average after: {after}.", *memory]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--frontends", default="1,2,4")
    parser.add_argument("--redis", default="single,cluster", help="single, cluster or both")
    parser.add_argument("--streams", type=int, default=200, help="turns at once per relay row")
    parser.add_argument("--tokens", type=int, default=60, help="tokens per relay turn")
    parser.add_argument("--sessions", type=int, default=500, help="open sessions per row")
    parser.add_argument("--memory-sessions", type=int, default=100)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.frontends = sorted(int(f) for f in args.frontends.split(","))
    args.redis = [k for k in args.redis.split(",") if k]
    if not set(args.redis) <= {"single", "cluster"}:
        parser.error("--redis takes single and/or cluster")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.client_worker:
        asyncio.run(worker_main())
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("\n".join(run(args)))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
