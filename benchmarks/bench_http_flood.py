"""The frontend under HTTP buffering attacks and slow request heads (issue 19, items 1, 2).

    python benchmarks/bench_http_flood.py [--mib 200] [--seconds 30] [--slow 50]

Against ``wsinfer serve --model fake:200`` (the frontend runs in the serve process):

- ``behind a running request``: a non-streamed completion is running; the
  same connection sends ``--mib`` MiB of pipelined requests behind it and
  reads nothing;
- ``GET /v1/models, never read``: ``--mib`` MiB of pipelined ``GET
  /v1/models`` (no API key needed) from a client that never reads.

For each: how many MiB the server took from the socket before it stopped
reading (or the time ran out), and the growth of the serve process's RSS from
before the attack to its peak during it (sampled from /proc every send).

Then ``--slow`` keep-alive connections each send one request, read its
answer, and send the next request head at 1 byte/s: how many are still open
after 30 s, and what the server answered before closing them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import start_serve, stop_serve  # noqa: E402

MIB = 1 << 20
# A request padded to ~8 KB, so that a flood is parsed in thousands of requests, not millions.
PADDED = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"p" * 8000 + b"\r\n\r\n"
# No progress for this long: the server has stopped reading.
STALL_S = 2.0


@dataclass
class Outcome:
    sent_mib: float
    growth_mib: float
    seconds: float


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def completion(max_tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "wsinfer",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens,
        }
    ).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    head += "Content-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


def flood(port: int, pid: int, first: bytes, total: int, seconds: float) -> Outcome:
    """Send ``first``, then up to ``total`` bytes of padded requests without reading."""
    chunk = PADDED * 8
    base = peak = rss_mib(pid)
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(first)
        sock.setblocking(False)
        sent, progress = 0, time.monotonic()
        while sent < total and time.monotonic() - started < seconds:
            if time.monotonic() - progress > STALL_S:
                break
            _, writable, _ = select.select([], [sock], [], 0.1)
            peak = max(peak, rss_mib(pid))
            if writable:
                try:
                    sent += sock.send(chunk[: total - sent])
                    progress = time.monotonic()
                except BlockingIOError:
                    pass
        for _ in range(10):  # what the server took in may still be growing it
            peak = max(peak, rss_mib(pid))
            time.sleep(0.1)
        return Outcome(sent / MIB, peak - base, time.monotonic() - started)
    finally:
        sock.close()


def attacks(port: int, pid: int, mib: int, seconds: float) -> dict[str, Outcome]:
    total = mib * MIB
    return {
        "behind a running request": flood(port, pid, completion(4000), total, seconds),
        "GET /v1/models, never read": flood(port, pid, PADDED, total, seconds),
    }


async def slow_head(port: int, seconds: float) -> tuple[bool, bytes]:
    """(still open after ``seconds``?, what the server sent in answer to the slow head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(PADDED)
    head = (await reader.readuntil(b"\r\n\r\n")).lower()
    await reader.readexactly(int(head.split(b"content-length: ")[1].split(b"\r\n")[0]))
    answer = b""
    try:
        for byte in PADDED[:-2][: int(seconds)]:
            writer.write(bytes([byte]))
            try:
                answer += await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                continue
            if reader.at_eof():
                return False, answer
        return True, answer
    except ConnectionError:
        return False, answer
    finally:
        writer.close()


async def slow_heads(port: int, count: int, seconds: float) -> tuple[int, set[str]]:
    """How many of ``count`` slow heads are open after ``seconds``; the answers' status lines."""
    results = await asyncio.gather(*(slow_head(port, seconds) for _ in range(count)))
    lines = {answer.split(b"\r\n", 1)[0].decode() for _, answer in results}
    return sum(open_ for open_, _ in results), lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--slow", type=int, default=50)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="wsinfer-bench-") as state:
        process, port = start_serve(Path(state), "--model", "fake:200")
        try:
            results = attacks(port, process.pid, args.mib, args.seconds)
            still_open, answers = asyncio.run(slow_heads(port, args.slow, 30.0))
        finally:
            stop_serve(process)
    print("| attack | MiB offered | MiB the client got sent | RSS growth (MiB) | seconds |")
    print("|---|---|---|---|---|")
    for name, out in results.items():
        row = [name, str(args.mib), f"{out.sent_mib:.1f}", f"{out.growth_mib:.1f}"]
        print("| " + " | ".join([*row, f"{out.seconds:.1f}"]) + " |")
    print(f"\nslow second heads (1 byte/s): {still_open} of {args.slow} open after 30 s; "
          f"answers: {sorted(answers)}")  # fmt: skip


if __name__ == "__main__":
    main()
