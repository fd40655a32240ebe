"""Time to first token through the two doors of one ``wsinfer serve``: WebSocket and SSE.

    python benchmarks/bench_http.py [--model DIR|tiny] [--runs 5] [--tokens 16]

The same greedy chat turn (a new session each time) alternately over an open
WebSocket (from sending ``generate`` to the first ``delta``) and over an open
keep-alive HTTP connection (from sending ``POST /v1/chat/completions`` with
``stream: true`` to the first byte of the response, and to the first chunk that
carries text). Prints medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path

from websockets.asyncio.client import ClientConnection, connect

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import served  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]


def serve(model: str | None) -> AbstractContextManager[int]:
    """``wsinfer serve`` of ``model`` (None: the default); its port."""
    return served(*(["--model", model] if model else []))


async def ws_first_delta(ws: ClientConnection, tokens: int) -> tuple[float, float]:
    """(the ``session`` answer, the first ``delta``), from sending ``generate``."""
    params = {"temperature": 0, "max_new_tokens": tokens}
    start = time.perf_counter()
    await ws.send(json.dumps({"type": "generate", "messages": MESSAGES, "params": params}))
    accepted = first = 0.0
    while True:
        message = json.loads(await ws.recv())
        accepted = accepted or time.perf_counter() - start
        if message["type"] == "delta" and not first:
            first = time.perf_counter() - start
        if message["type"] in ("done", "error"):
            return accepted, first


async def sse_first(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tokens: int
) -> tuple[float, float]:
    """(first response byte, first chunk with text), from sending the request."""
    body = json.dumps(
        {"model": "wsinfer", "messages": MESSAGES, "temperature": 0, "max_tokens": tokens,
         "stream": True}
    ).encode()  # fmt: skip
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    start = time.perf_counter()
    writer.write(head + body)
    first_byte = first_text = 0.0
    seen = b""
    while not seen.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked body
        data = await reader.read(65536)
        if not data:
            raise RuntimeError("the server closed the connection")
        first_byte = first_byte or time.perf_counter() - start
        seen += data
        if not first_text and b'"delta": {"content": "' in seen.split(b"[DONE]")[0]:
            first_text = time.perf_counter() - start
    return first_byte, first_text


async def measure(port: int, runs: int, tokens: int) -> list[str]:
    ws = await connect(f"ws://127.0.0.1:{port}/v1/ws", subprotocols=["wsinfer.v1.json"])  # type: ignore[list-item]
    await ws_first_delta(ws, tokens)  # warm-up, not counted
    # Opened now: a connection that sends no request for 10 s is dropped.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await sse_first(reader, writer, tokens)
        ws_bytes, ws_times, sse_bytes, sse_texts = [], [], [], []
        for run in range(runs):  # alternating (and which goes first), so load hits both alike
            if run % 2:
                ws_bytes.append((times := await ws_first_delta(ws, tokens))[0])
                ws_times.append(times[1])
            first_byte, first_text = await sse_first(reader, writer, tokens)
            sse_bytes.append(first_byte)
            sse_texts.append(first_text)
            if not run % 2:
                ws_bytes.append((times := await ws_first_delta(ws, tokens))[0])
                ws_times.append(times[1])
    finally:
        await ws.close()
        writer.close()
    ms = lambda xs: f"{statistics.median(xs) * 1000:.1f} ms"  # noqa: E731
    return [
        "| door | first byte | first text |",
        "|---|---|---|",
        f"| WebSocket (`session`, then `delta`) | {ms(ws_bytes)} | {ms(ws_times)} |",
        f"| HTTP SSE (`chat.completion.chunk`) | {ms(sse_bytes)} | {ms(sse_texts)} |",
        "",
        f"each run, first text (ms): WebSocket {[round(t * 1000) for t in ws_times]}, "
        f"SSE {[round(t * 1000) for t in sse_texts]}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=None, help="model dir, .gguf, or 'tiny' (test model)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16, help="max_new_tokens per turn")
    args = parser.parse_args(argv)
    model = args.model
    if model == "tiny":
        from tests.models import tiny_model_dir

        model = str(tiny_model_dir())
    with serve(model) as port:
        table = asyncio.run(measure(port, args.runs, args.tokens))
    print(f"# bench_http: {args.model or 'default model'}, greedy, median of {args.runs}\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
