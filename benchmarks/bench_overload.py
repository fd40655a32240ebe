"""Overload: a burst of sessions arriving at once on one ``wsinfer serve``, each
client waiting the ``retry_after`` it is told when refused, then sending again.

    python benchmarks/bench_overload.py [--sessions 1000] [--tokens 32]
        [--model tiny|DIR|fake:RATE] [--batch 64] [--queue 256] [--modes before,after]

Per mode, on the same serve one after the other (compare them within one run):

- ``before``: each refused client waits 1 s, what main told every refused
  client (a constant ``retry_after`` of 1.0); the server is the same, so this
  is main's behaviour with today's refusal path.
- ``after``: each refused client waits the ``retry_after`` it was told.

Reported: retries per session (mean and max), refused ``generate``s, the wall
time from the first connection to the last ``done``, deltas/s (tokens the
clients received, counted by ``seq``, over the wall time), and the frontend's
CPU seconds (``serve`` runs the frontend, engine and Redis in its process tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_fanout import cpu_seconds  # noqa: E402
from tests.stack import start_serve, stop_serve  # noqa: E402

JSON: Any = ["wsinfer.v1.json"]
MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
CONNECT_BATCH = 100  # handshakes in flight at once
BEFORE_RETRY_AFTER_S = 1.0  # what main answered every refused generate


@dataclass
class Outcome:
    retries: list[int] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


class Start:
    """The burst's starting gun: fired once every client has its connection open."""

    def __init__(self, sessions: int) -> None:
        self.waiting = sessions
        self.all_open = asyncio.Event()
        self.go = asyncio.Event()
        self.connecting = asyncio.Semaphore(CONNECT_BATCH)

    async def ready(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.all_open.set()
        await self.go.wait()


async def one_session(port: int, tokens: int, told: bool, start: Start, outcome: Outcome) -> None:
    async with start.connecting:  # handshakes in batches; the burst itself is at once
        ws = await connect(f"ws://127.0.0.1:{port}/v1/ws", subprotocols=JSON, open_timeout=120)
    async with ws:
        await start.ready()
        retries = 0
        params = {"temperature": 0, "max_new_tokens": tokens}
        while True:
            await ws.send(json.dumps({"type": "generate", "messages": MESSAGES, "params": params}))
            answer = json.loads(await ws.recv())
            if answer["type"] == "session":
                break
            if answer.get("code") != "overloaded":
                outcome.errors.append(answer.get("code", answer["type"]))
                return
            retries += 1
            await asyncio.sleep(answer["retry_after"] if told else BEFORE_RETRY_AFTER_S)
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == "done":
                outcome.tokens += message["seq"]
                outcome.retries.append(retries)
                return


async def burst(port: int, sessions: int, tokens: int, told: bool) -> tuple[Outcome, float]:
    outcome, start = Outcome(), Start(sessions)
    tasks = [
        asyncio.create_task(one_session(port, tokens, told, start, outcome))
        for _ in range(sessions)
    ]
    await asyncio.wait_for(start.all_open.wait(), 120)
    started = time.perf_counter()
    start.go.set()
    await asyncio.gather(*tasks)
    return outcome, time.perf_counter() - started


def serve_pids(root: int) -> list[int]:
    """The serve and every process under it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        children = Path(f"/proc/{pid}/task/{pid}/children")
        if children.exists():
            todo += [int(c) for c in children.read_text().split()]
    return out


def name_of(pid: int) -> str:
    """What a process of the serve is: redis, the engine, or the serve (its frontend)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"redis-server" in argv[0]:
        return "redis"
    return "engine" if b"engine" in argv else "serve"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--queue", type=int, default=256)
    parser.add_argument("--modes", default="before,after")
    return parser.parse_args(argv)


def model_arg(model: str) -> str:
    if model != "tiny":
        return model
    from tests.models import tiny_model_dir

    return str(tiny_model_dir())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    rows = []
    with tempfile.TemporaryDirectory() as state:
        process, port = start_serve(
            Path(state), "--model", model_arg(args.model), "--max-batch-size", str(args.batch),
            "--max-queued-turns", str(args.queue), "--request-rate", "1000",
        )  # fmt: skip
        try:
            for mode in args.modes.split(","):
                pids = serve_pids(process.pid)
                cpu = {pid: cpu_seconds(pid) for pid in pids}
                outcome, wall = asyncio.run(
                    burst(port, args.sessions, args.tokens, told=mode == "after")
                )
                used = {name_of(pid): cpu_seconds(pid) - cpu[pid] for pid in pids}
                rows.append(row(mode, outcome, wall, used))
        finally:
            stop_serve(process)
    print(f"\n{args.sessions} sessions at once, {args.tokens} tokens each, model {args.model}, "
          f"batch {args.batch}, queue {args.queue}; {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| mode | retries/session (mean) | max | refused | wall s | deltas/s | CPU s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(r["cpu_s"].items()))
        print(
            f"| {r['mode']} | {r['retries_mean']:.2f} | {r['retries_max']} | {r['refused']} "
            f"| {r['wall_s']:.1f} | {r['deltas_per_s']:.0f} | {cpu} |"
        )
    return rows


def row(mode: str, outcome: Outcome, wall: float, cpu: dict[str, float]) -> dict[str, Any]:
    if outcome.errors:
        raise RuntimeError(f"{len(outcome.errors)} sessions failed: {outcome.errors[:5]}")
    return {
        "mode": mode,
        "retries_mean": statistics.fmean(outcome.retries),
        "retries_max": max(outcome.retries),
        "refused": sum(outcome.retries),
        "wall_s": wall,
        "deltas_per_s": outcome.tokens / wall,
        "cpu_s": cpu,
    }


if __name__ == "__main__":
    main()
