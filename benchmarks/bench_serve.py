"""Service-level benchmark: ``wsinfer serve`` under N concurrent WebSocket sessions,
against the engine alone in the same run, plus a long prompt arriving mid-decode.

    python benchmarks/bench_serve.py [--model DIR|.gguf|tiny|random-1b] [--device auto]
        [--streams 1,16,64,256] [--tokens 128] [--long-prompt 2000] [--running 64]

Tables:

(a) for each number of concurrent sessions, one sampled turn per session
    (--tokens new tokens): aggregate tok/s, time to first token p50/p99 and the
    gap between consecutive deltas of a stream p50/p99, for ``EngineCore`` in
    this process (its outputs' times after each ``step()``; also its median step
    time) and for the service (``wsinfer serve`` as a child: private Redis, one
    engine, one frontend; raw WebSocket clients in worker processes of at most
    --per-client streams each, so the client is never the bottleneck);
(b) interference: --running streams decode, and once each has
    --settle deltas a --long-prompt-token prompt arrives: its time to first token,
    and the longest gap of any running stream while it was prefilled.

The engine alone runs first and is freed before the service starts, so the two
never share the GPU's memory. ``--device auto`` (the default) is CUDA where there
is one, else the CPU; ``--model random-1b`` builds (once, cached) a
Llama-3.2-1B-shaped model with random bf16 weights and SmolLM2's tokenizer, the
model of issue 7's targets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest
from wsinfer.engine.model import LoadedModel, build_model_dir, load_model
from wsinfer.engine.prompts import render_chat
from wsinfer.sessions.schema import GenerationParams
from wsinfer.supervisor import _die_with_parent

BENCH_DIR = Path(__file__).resolve().parent
# ws_load and bench_engine beside us; the test suite (--model tiny) at the root. Appended,
# not prepended: the root's wsinfer/ must not shadow an installed wsinfer (whose
# wsinfer.engine maps to engine/), as on a GPU machine with a --target install.
for path in (BENCH_DIR, BENCH_DIR.parent):
    if str(path) not in sys.path:
        sys.path.append(str(path))

from ws_load import Stream, open_sockets, run_turns, turn  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]
FILLER = (
    "The keeper wrote down the weather, the ships that passed, the oil he burned "
    "and the birds that struck the glass, every night for thirty years. "
)


@dataclass
class Run:
    """One measured batch of concurrent turns, from either side."""

    streams: list[Stream]
    step: float | None = None  # engine alone: median step time while all rows decode

    @property
    def rate(self) -> float:
        start = min(s.sent for s in self.streams)
        return sum(s.tokens for s in self.streams) / (max(s.end for s in self.streams) - start)

    @property
    def ttfts(self) -> list[float]:
        return [s.ttft for s in self.streams if s.arrivals]

    @property
    def gaps(self) -> list[float]:
        return [g for s in self.streams for g in s.gaps()]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def ms(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 1000:.1f}"


# --- engine alone ---------------------------------------------------------------------


def engine_run(core: EngineCore, prompt: list[int], params: GenerationParams, n: int) -> Run:
    streams = {f"bench-{uuid.uuid4().hex}-{i}": Stream() for i in range(n)}
    for rid, stream in streams.items():
        stream.sent = time.monotonic()
        core.add(EngineRequest(rid, prompt, params))
    steps: list[float] = []
    while core.has_unfinished():
        before = time.monotonic()
        outputs = core.step()
        now = time.monotonic()
        if core.num_running == n and not core.num_waiting:  # every row decoding
            steps.append(now - before)
        for out in outputs:
            stream = streams[out.request_id]
            if out.new_token_ids:
                stream.arrivals.append(now)
            if out.finished:
                stream.tokens, stream.end = out.num_generated, now
    return Run(list(streams.values()), statistics.median(steps) if steps else None)


def engine_interference(
    core: EngineCore, prompt: list[int], long_ids: list[int], running: int, settle: int, tokens: int
) -> tuple[Stream, list[Stream]]:
    """``running`` turns decode; once each has ``settle`` outputs the long prompt is added."""
    params = GenerationParams(max_new_tokens=tokens, temperature=0.7)
    streams = {f"run-{uuid.uuid4().hex}-{i}": Stream() for i in range(running)}
    long_id, long = f"long-{uuid.uuid4().hex}", Stream()
    for rid, stream in streams.items():
        stream.sent = time.monotonic()
        core.add(EngineRequest(rid, prompt, params))
    while core.has_unfinished():
        if not long.sent and all(len(s.arrivals) >= settle for s in streams.values()):
            long.sent = time.monotonic()
            core.add(EngineRequest(long_id, long_ids, GenerationParams(max_new_tokens=8)))
        outputs = core.step()
        now = time.monotonic()
        for out in outputs:
            stream = long if out.request_id == long_id else streams[out.request_id]
            if out.new_token_ids:
                stream.arrivals.append(now)
            if out.finished:
                stream.tokens, stream.end = out.num_generated, now
    return long, list(streams.values())


# --- the service ------------------------------------------------------------------------


@contextlib.contextmanager
def serve(args: argparse.Namespace, model: str | None, max_batch: int) -> Iterator[int]:
    """``wsinfer serve`` on a free port; yields the port once the engine is up."""
    command = [
        sys.executable, "-m", "wsinfer", "serve", "--port", "0",
        *(["--model", model] if model else []),
        "--device", args.device, "--dtype", args.dtype, "--max-batch-size", str(max_batch),
        "--max-queued-turns", str(max(256, 2 * max_batch)),
        "--log-level", "warning",
        *(["--threads", str(args.threads)] if args.threads else []),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        cwd=tempfile.gettempdir(),  # not the repository: its wsinfer/ is not the package
        preexec_fn=_die_with_parent,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode()  # printed once the engine has registered
        if "ws://" not in line:
            raise RuntimeError(f"wsinfer serve did not start: {line!r}, exit {process.wait()}")
        yield int(line.split("ws://")[1].split("/")[0].rsplit(":", 1)[1])
    finally:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def served_run(port: int, n: int, request: dict[str, Any], per_client: int) -> Run:
    """``n`` concurrent turns from ceil(n / per_client) client processes (one: in-process)."""
    if n <= per_client:
        return Run(asyncio.run(run_turns(port, n, request)))
    sizes = [per_client] * (n // per_client) + ([n % per_client] if n % per_client else [])
    workers = [spawn_client(port, size, request) for size in sizes]
    try:
        for worker in workers:  # every connection open before any turn starts
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"client worker failed: exit {worker.wait()}")
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        streams = [Stream(**s) for w in workers for s in json.loads(w.communicate()[0])]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    return Run(streams)


def spawn_client(port: int, n: int, request: dict[str, Any]) -> subprocess.Popen[str]:
    args = [str(port), str(n), json.dumps(request["params"]), json.dumps(request["messages"])]
    return subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "ws_load.py"), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent,
    )


async def served_interference(
    port: int, long_messages: list[dict[str, str]], running: int, settle: int, tokens: int
) -> tuple[Stream, list[Stream]]:
    """As ``engine_interference``, through the service; the long prompt's connection is
    opened with the others, before any turn starts."""
    request = {"messages": MESSAGES, "params": {"max_new_tokens": tokens, "temperature": 0.7}}
    streams, long = [Stream() for _ in range(running)], Stream()
    *sockets, long_ws = await open_sockets(port, running + 1)

    async def long_turn() -> None:
        while not all(len(s.arrivals) >= settle for s in streams):
            await asyncio.sleep(0.001)
        await turn(long_ws, {"messages": long_messages, "params": {"max_new_tokens": 8}}, long)

    try:
        await asyncio.gather(
            *(turn(ws, request, s) for ws, s in zip(sockets, streams, strict=True)), long_turn()
        )
    finally:
        await asyncio.gather(*(ws.close() for ws in [*sockets, long_ws]))
    return long, streams


# --- tables ---------------------------------------------------------------------------------


SERVICE_HEADER = [
    "| streams | tokens/stream | engine tok/s | service tok/s | service / engine "
    "| engine TTFT p50 / p99 ms | service TTFT p50 / p99 ms | engine gap p50 / p99 ms "
    "| service gap p50 / p99 ms | engine step ms | service gap p99 / engine step "
    "| failed turns |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def service_row(n: int, engine: Run, served: Run) -> str:
    def pair(values: list[float]) -> str:
        return f"{ms(pct(values, 50))} / {ms(pct(values, 99))}"

    step = engine.step if engine.step is not None else math.nan
    tokens = statistics.fmean(s.tokens for s in served.streams)
    return (
        f"| {n} | {tokens:.0f} | {engine.rate:.1f} | {served.rate:.1f} "
        f"| {served.rate / engine.rate:.2f}x | {pair(engine.ttfts)} | {pair(served.ttfts)} "
        f"| {pair(engine.gaps)} | {pair(served.gaps)} | {ms(step)} "
        f"| {pct(served.gaps, 99) / step:.1f}x | {failures(served.streams)} |"
    )


def failures(streams: list[Stream]) -> str:
    """``0``, or how many failed and the first reason (say, ``overloaded``)."""
    failed = [s.error for s in streams if s.error]
    return f"{len(failed)}: {failed[0][:80]}" if failed else "0"


INTERFERENCE_HEADER = [
    "| side | running streams | long prompt tokens | long prompt TTFT ms "
    "| running streams' max gap while it prefilled, ms | their gap p50 before, ms "
    "| still running at its first token |",
    "|---|---|---|---|---|---|---|",
]


def interference_row(side: str, long: Stream, running: list[Stream], prompt_tokens: int) -> str:
    if not long.arrivals:
        return f"| {side} | {len(running)} | {prompt_tokens} | failed: {long.error[:80]} | | | |"
    first = long.arrivals[0]
    worst = max(s.max_gap_within(long.sent, first) for s in running)
    before = [
        b - a
        for s in running
        for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)
        if b < long.sent
    ]
    alive = sum(1 for s in running if s.arrivals and s.arrivals[-1] > first)
    return (
        f"| {side} | {len(running)} | {prompt_tokens} | {ms(first - long.sent)} | {ms(worst)} "
        f"| {ms(pct(before, 50))} | {alive} / {len(running)} |"
    )


# --- workloads and models -----------------------------------------------------------------


def long_messages(tokenizer: Any, target: int) -> list[dict[str, str]]:
    """A one-message chat whose rendered prompt has about ``target`` tokens."""
    words = FILLER.split()
    content: list[str] = []
    while len(render_chat(tokenizer, [{"role": "user", "content": " ".join(content)}])) < target:
        content.extend(words[: max(1, min(len(words), (target - len(content)) // 2))])
    return [{"role": "user", "content": " ".join(content) + " Summarise this."}]


def random_1b_dir(tokenizer_from: str | None) -> Path:
    """The random Llama-3.2-1B-shaped model of bench_engine's section c, saved once, with
    the tokenizer of ``tokenizer_from`` (default: the test suite's tiny model, SmolLM2's)."""
    from bench_engine import gpu_model

    if tokenizer_from is None:
        from tests.models import tiny_model_dir

        tokenizer_from = str(tiny_model_dir())

    def build(out: Path) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        loaded = gpu_model(load_model(tokenizer_from), device)
        loaded.model.save_pretrained(out)
        loaded.tokenizer.save_pretrained(out)

    root = Path(os.environ.get("WSINFER_CACHE_DIR") or Path.home() / ".cache" / "wsinfer")
    return build_model_dir(root / "bench-models" / "llama-1b-random-v1", build)


def resolve_model(spec: str | None, tokenizer_from: str | None) -> str | None:
    """A path for ``wsinfer serve --model`` (absolute: the service runs elsewhere)."""
    if spec == "tiny":
        from tests.models import tiny_model_dir

        return str(tiny_model_dir())
    if spec == "random-1b":
        return str(random_1b_dir(tokenizer_from))
    return str(Path(spec).resolve()) if spec and Path(spec).exists() else spec


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    add = parser.add_argument
    add("--model", default=None, help="model dir, .gguf, 'tiny' or 'random-1b' (default: SmolLM2)")
    add("--device", default="auto", help="cuda, cpu, or auto (CUDA where there is one)")
    add("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    add("--streams", default="1,16,64,256", help="concurrent sessions, comma-separated")
    add("--tokens", type=int, default=128, help="new tokens per turn")
    add("--per-client", type=int, default=64, help="streams per client process")
    add("--long-prompt", type=int, default=2000, help="interference: prompt tokens (0: skip)")
    add("--running", type=int, default=64, help="interference: decoding streams")
    add("--running-tokens", type=int, default=512, help="interference: their new tokens")
    add("--settle", type=int, default=16, help="interference: their deltas before it arrives")
    add("--threads", type=int, default=0, help="torch threads here and in the engine")
    add("--tokenizer-from", default=None, help="random-1b: a model dir whose tokenizer to use")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def measure_engine(
    args: argparse.Namespace, loaded: LoadedModel, streams: list[int], long_ids: list[int]
) -> tuple[list[Run], tuple[Stream, list[Stream]] | None]:
    prompt = render_chat(loaded.tokenizer, MESSAGES)
    params = GenerationParams(max_new_tokens=args.tokens, temperature=0.7)
    core = EngineCore(loaded, EngineConfig(max_batch_size=max_batch(args, streams)))
    engine_run(core, prompt, GenerationParams(max_new_tokens=4), 2)  # warm-up
    runs = []
    for n in streams:
        runs.append(engine_run(core, prompt, params, n))
        print(f"engine alone, {n} streams: {runs[-1].rate:.1f} tok/s", file=sys.stderr)
    interference = None
    if args.long_prompt:
        interference = engine_interference(
            core, prompt, long_ids, args.running, args.settle, args.running_tokens
        )
    return runs, interference


def measure_service(
    args: argparse.Namespace, model: str | None, streams: list[int], long_chat: list[dict[str, str]]
) -> tuple[list[Run], tuple[Stream, list[Stream]] | None]:
    request = {"messages": MESSAGES, "params": {"max_new_tokens": args.tokens, "temperature": 0.7}}
    with serve(args, model, max_batch(args, streams)) as port:
        warm_up = {"messages": MESSAGES, "params": {"max_new_tokens": 4}}
        served_run(port, 2, warm_up, args.per_client)
        runs = []
        for n in streams:
            runs.append(served_run(port, n, request, args.per_client))
            print(f"service, {n} streams: {runs[-1].rate:.1f} tok/s", file=sys.stderr)
        interference = None
        if args.long_prompt:
            interference = asyncio.run(
                served_interference(port, long_chat, args.running, args.settle, args.running_tokens)
            )
    return runs, interference


def max_batch(args: argparse.Namespace, streams: list[int]) -> int:
    return max(*streams, args.running + 1 if args.long_prompt else 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    model = resolve_model(args.model, args.tokenizer_from)
    streams = [int(n) for n in args.streams.split(",")]
    loaded = load_model(model, device=args.device, dtype=args.dtype)
    long_chat = long_messages(loaded.tokenizer, args.long_prompt) if args.long_prompt else []
    long_ids = render_chat(loaded.tokenizer, long_chat) if long_chat else []
    print(
        f"# bench_serve: {loaded.name} on {args.device} ({args.dtype}), sampling, "
        f"{args.tokens} new tokens per turn; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n",
        flush=True,
    )
    engine_runs, engine_long = measure_engine(args, loaded, streams, long_ids)
    del loaded
    release_memory()
    served_runs, served_long = measure_service(args, model, streams, long_chat)
    print("## (a) concurrent sessions: the service vs the engine alone\n")
    rows = [service_row(n, e, s) for n, e, s in zip(streams, engine_runs, served_runs, strict=True)]
    print("\n".join([*SERVICE_HEADER, *rows]) + "\n")
    if engine_long is not None and served_long is not None:
        print(f"## (b) a {len(long_ids)}-token prompt arrives while {args.running} decode\n")
        print("\n".join([
            *INTERFERENCE_HEADER,
            interference_row("engine alone", *engine_long, len(long_ids)),
            interference_row("service", *served_long, len(long_ids)),
        ]) + "\n")  # fmt: skip


def release_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the service is stopped by then; no traceback for Ctrl-C
        sys.exit(130)
