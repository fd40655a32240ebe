"""Automatic prefix caching through the OpenAI SDK: a long conversation resent in full,
and many sessions sharing one system prompt, with and without the cache, in one run.

    python benchmarks/bench_prefix_cache.py [--model DIR|tiny] [--history 2000]
        [--system 1000] [--sessions 32] [--rounds 3] [--tokens 8]

For each of two ``wsinfer serve`` (default, then ``--no-prefix-caching``), with the
official ``openai`` SDK, streamed, greedy:

- *cold*: a conversation of about ``--history`` tokens no one sent before (a fresh
  nonce opens its system prompt), then *resent*: the same history, the answer and
  one more question, as every standard client sends turn 2 (no session header).
  Medians of ``--rounds``; TTFT from sending to the first chunk with text.
- *shared system prompt*: ``--sessions`` concurrent sessions whose prompts open with
  the same ~``--system``-token system prompt (fresh per round) and ask different
  questions. Median TTFT across sessions, and prefill tokens per round.

"prefill tokens" are the prompt tokens that went through the model (the engine's
``wsinfer_engine_prefill_tokens_total``, scraped before and after); "cached" is
what the responses' ``usage.prompt_tokens_details.cached_tokens`` said.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from tests.stack import start_serve, stop_serve  # noqa: E402

SENTENCE = "Entry {i}: the keeper climbed the stairs, trimmed the wick and logged the weather."


def filler(tokens: int, start: int = 0) -> str:
    """About ``tokens`` tokens of varied text (some 20 tokens a sentence)."""
    return " ".join(SENTENCE.format(i=start + i) for i in range(max(1, tokens // 20)))


def conversation(tokens: int) -> list[dict[str, str]]:
    """A fresh chat of about ``tokens`` tokens: a system prompt and four exchanges."""
    part = tokens // 9
    messages = [{"role": "system", "content": f"{uuid.uuid4()} {filler(part)}"}]
    for k in range(4):
        messages.append({"role": "user", "content": f"Question {k}: {filler(part, 100 * k)}"})
        messages.append({"role": "assistant", "content": filler(part, 100 * k + 50)})
    messages.append({"role": "user", "content": "Summarize the log in one sentence."})
    return messages


@dataclass
class Turn:
    ttft: float
    prompt: int
    cached: int
    text: str


async def turn(client: openai.AsyncOpenAI, messages: list[Any], tokens: int) -> Turn:
    start = time.perf_counter()
    stream = await client.chat.completions.create(
        model="wsinfer", messages=messages, temperature=0, max_tokens=tokens,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    ttft, text, usage = 0.0, [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert usage is not None, "no usage chunk"
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Turn(ttft or time.perf_counter() - start, usage.prompt_tokens, cached, "".join(text))


def prefill_tokens(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("wsinfer_engine_prefill_tokens_total "):
                return float(line.split()[1])
    raise RuntimeError("the engine exports no wsinfer_engine_prefill_tokens_total")


@dataclass
class Row:
    case: str
    prompt: float
    cached: float
    prefill: float
    ttft: float


async def measure(port: int, metrics: int, args: argparse.Namespace) -> list[Row]:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    await turn(client, [{"role": "user", "content": "Hello."}], 2)  # warm up the path
    cold: list[tuple[Turn, float]] = []
    resent: list[tuple[Turn, float]] = []
    for _ in range(args.rounds):
        history = conversation(args.history)
        before = prefill_tokens(metrics)
        first = await turn(client, history, args.tokens)
        middle = prefill_tokens(metrics)
        follow = [*history, {"role": "assistant", "content": first.text}]
        follow.append({"role": "user", "content": "And what did the keeper do next?"})
        second = await turn(client, follow, args.tokens)
        cold.append((first, middle - before))
        resent.append((second, prefill_tokens(metrics) - middle))
    shared: list[tuple[list[Turn], float]] = []
    for _ in range(args.rounds):
        system = {"role": "system", "content": f"{uuid.uuid4()} {filler(args.system)}"}
        prompts = [
            [system, {"role": "user", "content": f"Question {i}: what happened on day {i}?"}]
            for i in range(args.sessions)
        ]
        before = prefill_tokens(metrics)
        turns = await asyncio.gather(*(turn(client, p, args.tokens) for p in prompts))
        shared.append((list(turns), prefill_tokens(metrics) - before))
    return [
        row("cold conversation", cold),
        row("the same, resent in full + 1 turn", resent),
        Row(
            f"{args.sessions} sessions, one system prompt",
            statistics.median(sum(t.prompt for t in ts) for ts, _ in shared),
            statistics.median(sum(t.cached for t in ts) for ts, _ in shared),
            statistics.median(p for _, p in shared),
            statistics.median(t.ttft for ts, _ in shared for t in ts),
        ),
    ]


def row(case: str, runs: list[tuple[Turn, float]]) -> Row:
    return Row(
        case,
        statistics.median(t.prompt for t, _ in runs),
        statistics.median(t.cached for t, _ in runs),
        statistics.median(p for _, p in runs),
        statistics.median(t.ttft for t, _ in runs),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_serve(model: str | None, caching: bool, args: argparse.Namespace) -> list[Row]:
    metrics = free_port()
    flags = ["--metrics-port", str(metrics), "--prefill-chunk", str(args.prefill_chunk)]
    flags += ["--model", model] if model else []
    flags += [] if caching else ["--no-prefix-caching"]
    with tempfile.TemporaryDirectory(prefix="wsinfer-bench-") as state:
        process, port = start_serve(Path(state), *flags)
        try:
            return asyncio.run(measure(port, metrics, args))
        finally:
            stop_serve(process)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model dir, or 'tiny' (tests)")
    parser.add_argument("--history", type=int, default=2000, help="conversation tokens")
    parser.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per turn")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    args = parser.parse_args(argv)
    model = args.model
    if model == "tiny":
        from tests.models import tiny_model_dir

        model = str(tiny_model_dir())
    results = {caching: run_serve(model, caching, args) for caching in (True, False)}
    print("| case | prefix caching | prompt tokens | cached | prefill tokens | TTFT (median) "
          "| TTFT vs cold | TTFT vs off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for caching, rows in results.items():
        for i, r in enumerate(rows):
            vs_cold = f"{r.ttft / rows[0].ttft:.2f}x" if i == 1 else ""
            vs_off = f"{r.ttft / results[False][i].ttft:.2f}x"
            print(
                f"| {r.case} | {'on' if caching else 'off'} | {r.prompt:.0f} | {r.cached:.0f} "
                f"| {r.prefill:.0f} | {r.ttft * 1000:.0f} ms | {vs_cold} | {vs_off} |"
            )


if __name__ == "__main__":
    main()
