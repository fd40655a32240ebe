"""What the Responses API's event stream costs next to a chat completion's, on one
``wsinfer serve``.

    python benchmarks/bench_responses.py [--model fake:inf|DIR|tiny] [--runs 10] [--tokens 256]

The same turn (a new session each time, streamed over one open keep-alive HTTP
connection, read raw: the server's cost, not a client's parsing) alternately as
``POST /v1/chat/completions`` (the baseline) and as ``POST /v1/responses``, then
read back whole once it has ended: ``GET /v1/sessions/{id}/stream`` against
``GET /v1/responses/{id}?stream=true``. A Responses event carries more JSON per
delta (item and content ids, its sequence number, an ``event:`` line) and eight
events around the text; the table shows what that costs a whole turn, as a ratio
to the chat stream measured in the same run. ``fake:inf`` (the default) takes the
model out, so the frontend and Redis are all there is to measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the shared process helpers of the test suite
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.bench_http import serve  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]


def turn(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[float, httpx.Headers, bytes]:
    """(seconds, headers, body) of one streamed request, read to its end."""
    start = time.perf_counter()
    with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        data = response.read()
    return time.perf_counter() - start, response.headers, data


def replay(http: httpx.Client, path: str, headers: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    response = http.get(path, headers=headers)
    response.raise_for_status()
    return time.perf_counter() - start


def response_id(data: bytes) -> str:
    first = data.split(b"data: ", 1)[1].split(b"\n", 1)[0]
    return str(json.loads(first)["response"]["id"])


def measure(port: int, runs: int, tokens: int) -> list[str]:
    chat = {"model": "wsinfer", "messages": MESSAGES, "max_tokens": tokens, "stream": True}
    resp = {"model": "wsinfer", "input": MESSAGES, "max_output_tokens": tokens, "stream": True}
    times: dict[str, list[float]] = {k: [] for k in ("chat", "resp", "chat_replay", "resp_replay")}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
        turn(http, "/v1/chat/completions", chat), turn(http, "/v1/responses", resp)  # warm-up
        for run in range(runs):  # alternating (and which goes first), so load hits both alike
            for which in ["chat", "resp"] if run % 2 else ["resp", "chat"]:
                if which == "chat":
                    took, headers, _ = turn(http, "/v1/chat/completions", chat)
                    path = f"/v1/sessions/{headers['x-wsinfer-session']}/stream"
                    token = {"X-Wsinfer-Token": headers["x-wsinfer-token"]}
                    times["chat_replay"].append(replay(http, path, token))
                else:
                    took, _, data = turn(http, "/v1/responses", resp)
                    path = f"/v1/responses/{response_id(data)}?stream=true"
                    times["resp_replay"].append(replay(http, path))
                times[which].append(took)
    med = {k: statistics.median(v) for k, v in times.items()}
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    return [
        "| what | chat completions (baseline) | Responses API | ratio |",
        "|---|---|---|---|",
        f"| a streamed turn, to its end | {ms(med['chat'])} | {ms(med['resp'])} | "
        f"{med['resp'] / med['chat']:.2f}x |",
        f"| the ended turn read back whole | {ms(med['chat_replay'])} | "
        f"{ms(med['resp_replay'])} | {med['resp_replay'] / med['chat_replay']:.2f}x |",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="fake:inf", help="fake:RATE, model dir, or 'tiny'")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=256, help="max new tokens per turn")
    args = parser.parse_args(argv)
    model = args.model
    if model == "tiny":
        from tests.models import tiny_model_dir

        model = str(tiny_model_dir())
    with serve(model) as port:
        table = measure(port, args.runs, args.tokens)
    print(f"# bench_responses: {args.model}, {args.tokens} tokens a turn, median of {args.runs}\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
