"""CPU time each process of `wsinfer serve` spends per streamed token, one stream.

On a machine with few cores the engine's threads share them with the frontend,
Redis and the client: whatever those spend per token is taken from the engine,
and more than once when it stalls one of the engine's threads at a barrier
while the others wait. This prints each process's CPU per token beside the
stream's own rate, so that a change to the frontend, the store or the client
shows what it saves (compare within one run, as ratios; name the CPU).

    .venv/bin/python benchmarks/bench_cpu_per_token.py --tokens 400 --threads 2

``--model fake:RATE`` streams a model-free engine's words at RATE tokens a second:
the frontend's, Redis's and the client's shares without the engine's threads
competing for the cores, for changes to those three.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Tell a long story about a lighthouse."}]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> dict[int, str]:
    """``root`` and every process below it, each with a short name."""
    listing = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    ).stdout
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for line in listing.splitlines():
        pid, ppid, args = line.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        names[int(pid)] = _name(args)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        found[pid] = names.get(pid, "?")
        todo += children.get(pid, [])
    return found


def _name(args: str) -> str:
    if "redis-server" in args:
        return "redis"
    if "wsinfer serve" in args:
        return "serve (frontend)"
    if "engine" in args or "sys.path" in args:
        return "engine process"
    return args[:40]


async def stream(port: int, tokens: int) -> int:
    async with connect(f"ws://127.0.0.1:{port}/v1/ws") as ws:
        params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.8}
        await ws.send(
            json.dumps({"type": "generate", "id": 1, "messages": PROMPT, "params": params})
        )
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == "done":
                return int(message["seq"])


def wait_healthy(port: int) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("wsinfer serve did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2, help="serve --threads")
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="serve --model (default: serve's)")
    args = parser.parse_args()
    data = tempfile.mkdtemp(prefix="bench-cpu-")
    model = ["--model", args.model] if args.model else []
    serve = subprocess.Popen(
        [str(ROOT / ".venv/bin/wsinfer"), "serve", "--port", str(args.port),
         "--threads", str(args.threads), "--data-dir", data, *model],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_healthy(args.port)
        asyncio.run(stream(args.port, 32))  # warm
        procs = process_tree(serve.pid)
        what = f"serve --threads {args.threads}" + (f" --model {args.model}" if args.model else "")
        print(f"# one WebSocket stream of {args.tokens} tokens, {what}")
        print("\n| round | tok/s | " + " | ".join(sorted(set(procs.values()))) + " | client |")
        print("|---" * (len(set(procs.values())) + 3) + "|")
        for n in range(args.rounds):
            before = {pid: cpu_seconds(pid) for pid in procs}
            mine, began = cpu_seconds(os.getpid()), time.monotonic()
            tokens = asyncio.run(stream(args.port, args.tokens))
            took = time.monotonic() - began
            by_name: dict[str, float] = {}
            for pid, name in procs.items():
                spent = cpu_seconds(pid) - before[pid]
                by_name[name] = by_name.get(name, 0.0) + spent
            client = cpu_seconds(os.getpid()) - mine
            cells = [f"{1000 * by_name[k] / tokens:.2f} ms" for k in sorted(by_name)]
            row = [str(n), f"{tokens / took:.1f}", *cells, f"{1000 * client / tokens:.2f} ms"]
            print("| " + " | ".join(row) + " |")
        print("\n(CPU milliseconds per token; the engine's includes its threads' spinning.)")
    finally:
        serve.terminate()
        serve.wait(60)


if __name__ == "__main__":
    main()
