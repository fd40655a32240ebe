"""Benchmark streaming through the whole service against the engine alone.

    python benchmarks/bench_stream.py [--model DIR|tiny] [--tokens 128] [--runs 3] [--streams 1,4]
        [--threads N]

For each number of concurrent streams, one greedy chat turn per stream (same
prompt, ``max_new_tokens`` = --tokens), timed two ways:

- engine alone: ``EngineCore`` in this process; time to first token from
  ``add()`` to the first output with text, tokens/s = generated tokens / wall
  time of the whole turn;
- service: a private redis-server, one ``wsinfer engine`` and one ``wsinfer
  frontend`` process, and raw WebSocket clients (``wsinfer.v1.json``); time to
  first token from sending ``generate`` to the first ``delta``, tokens/s = the
  ``done`` messages' ``seq`` / time from the first send to the last ``done``.

With several streams, tokens/s is the aggregate and time to first token the mean
over the streams. Each row warms both sides up once, then alternates them
--runs times and prints medians and the ratio service / engine alone.

On a CPU shared with other work, ``--threads 1`` keeps torch's OpenMP threads
from spinning against each other (the default, one per core, can be 5-10x
slower there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from websockets.asyncio.client import ClientConnection, connect

from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest
from wsinfer.engine.model import load_model
from wsinfer.engine.prompts import render_chat
from wsinfer.sessions.schema import GenerationParams
from wsinfer.supervisor import EmbeddedRedis

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import Stack  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]


@dataclass
class Sample:
    """One timed turn of ``streams`` concurrent requests."""

    ttft: float  # seconds, mean over the streams
    tokens: int  # generated, all streams together
    wall: float  # seconds from the first request to the last end

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


# --- engine alone -----------------------------------------------------------------


def engine_turn(core: EngineCore, prompt: list[int], params: GenerationParams, n: int) -> Sample:
    start = time.perf_counter()
    for i in range(n):
        core.add(EngineRequest(f"bench-{uuid.uuid4().hex}-{i}", prompt, params))
    first: dict[str, float] = {}
    tokens = 0
    while core.has_unfinished():
        for out in core.step():
            if out.text and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                tokens += out.num_generated
    wall = time.perf_counter() - start
    return Sample(statistics.fmean(first.values()) if first else wall, tokens, wall)


# --- the service --------------------------------------------------------------------


@contextlib.contextmanager
def service(model: str | None, max_batch: int) -> Iterator[int]:
    """Redis + engine + frontend; yields the frontend's port, stops everything after.

    An ExitStack runs every cleanup step even if one is interrupted (a second Ctrl-C).
    """
    with contextlib.ExitStack() as cleanup:
        state = Path(tempfile.mkdtemp(prefix="wsinfer-bench-"))
        cleanup.callback(shutil.rmtree, state, ignore_errors=True)
        embedded = EmbeddedRedis(state)
        cleanup.callback(embedded.stop)
        embedded.start()
        # The processes inherit this one's environment, OMP_NUM_THREADS (--threads) too.
        stack = Stack(embedded.url, model, lease_ms=None, die_with_parent=True)
        cleanup.callback(stack.stop)
        engine_id = f"bench-{uuid.uuid4().hex[:8]}"
        engine = stack.start_engine(
            engine_id, "--max-batch-size", str(max_batch), "--exit-with-parent", wait=False
        )
        _, port = stack.start_frontend()
        stack.wait_for_engine(engine_id, engine, timeout_s=300)
        yield port


async def ws_stream(ws: ClientConnection, params: dict[str, Any]) -> tuple[float, int, float]:
    """One turn on an open connection: (time to first delta, done.seq, end), from the send."""
    start = time.perf_counter()
    await ws.send(json.dumps({"type": "generate", "messages": MESSAGES, "params": params}))
    first = 0.0
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 300))
        kind = message["type"]
        if kind == "delta" and not first:
            first = time.perf_counter() - start
        elif kind == "done" and message["finish_reason"] != "error":
            return first, int(message["seq"]), time.perf_counter()
        elif kind in ("done", "error"):
            raise RuntimeError(f"turn failed: {message}")


async def service_turn(port: int, params: dict[str, Any], n: int) -> Sample:
    url = f"ws://127.0.0.1:{port}/v1/ws"
    subprotocols: Any = ["wsinfer.v1.json"]
    sockets = [await connect(url, subprotocols=subprotocols) for _ in range(n)]
    try:
        start = time.perf_counter()
        results = await asyncio.gather(*(ws_stream(ws, params) for ws in sockets))
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets))
    wall = max(end for _, _, end in results) - start
    return Sample(statistics.fmean(r[0] for r in results), sum(r[1] for r in results), wall)


# --- the table ------------------------------------------------------------------------


HEADER = [
    "| streams | tokens/stream | engine tok/s | service tok/s | tok/s service/engine "
    "| engine TTFT | service TTFT | TTFT service/engine |",
    "|---|---|---|---|---|---|---|---|",
]


def row(n: int, engine: list[Sample], served: list[Sample]) -> str:
    def med(samples: list[Sample], attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in samples)

    rate_e, rate_s = med(engine, "rate"), med(served, "rate")
    ttft_e, ttft_s = med(engine, "ttft"), med(served, "ttft")
    tokens = f"{med(engine, 'tokens') / n:.0f} / {med(served, 'tokens') / n:.0f}"
    return (
        f"| {n} | {tokens} | {rate_e:.1f} | {rate_s:.1f} | {rate_s / rate_e:.2f}x "
        f"| {ttft_e * 1000:.0f} ms | {ttft_s * 1000:.0f} ms | {ttft_s / ttft_e:.2f}x |"
    )


def measure(core: EngineCore, prompt: list[int], port: int, tokens: int, n: int, runs: int) -> str:
    params = GenerationParams(max_new_tokens=tokens, temperature=0.0)
    wire = {"max_new_tokens": tokens, "temperature": 0}
    engine_turn(core, prompt, params, n)  # warm-up, not counted
    asyncio.run(service_turn(port, wire, n))
    engine: list[Sample] = []
    served: list[Sample] = []
    for _ in range(runs):  # alternating, so load from elsewhere hits both sides alike
        engine.append(engine_turn(core, prompt, params, n))
        served.append(asyncio.run(service_turn(port, wire, n)))
    return row(n, engine, served)


# --- main -------------------------------------------------------------------------------


def resolve_model(spec: str | None) -> str | None:
    """``tiny``: the test suite's tiny random model; anything else is passed on as is."""
    if spec != "tiny":
        return spec
    from tests.models import tiny_model_dir

    return str(tiny_model_dir())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default=None, help="model dir, .gguf, or 'tiny' (test model)")
    parser.add_argument("--tokens", type=int, default=128, help="max_new_tokens per stream")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per row (median)")
    parser.add_argument("--streams", default="1", help="concurrent streams, e.g. 1,4")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads here and in the engine (0: default)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the service is stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process's torch
    model = resolve_model(args.model)
    streams = [int(s) for s in args.streams.split(",")]
    loaded = load_model(model)
    max_batch = max(16, *streams)
    core = EngineCore(loaded, EngineConfig(max_batch_size=max_batch))
    prompt = render_chat(loaded.tokenizer, MESSAGES)
    print(
        f"# bench_stream: {loaded.name}, greedy, {args.tokens} new tokens, {len(prompt)}-token "
        f"prompt, median of {args.runs}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n",
        flush=True,
    )
    with service(model, max_batch) as port:
        rows = [*HEADER]
        for n in streams:
            rows.append(measure(core, prompt, port, args.tokens, n, args.runs))
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the service is already stopped; no traceback for Ctrl-C
        sys.exit(130)
