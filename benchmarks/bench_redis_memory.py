"""Redis memory per session, idle and active, and per 1,000 tokens of stream.

No model: sessions are created through the frontend's store and their turns
published through the engine's store, one stream entry per token (what a
decode step writes for one session), so the keys are exactly the service's.

    python benchmarks/bench_redis_memory.py --redis-url redis://127.0.0.1:6379/15
    python benchmarks/bench_redis_memory.py --redis-url redis+cluster://127.0.0.1:7000

The Redis must be empty (a spare db or a fresh server): the numbers are
``used_memory`` deltas, summed over the primaries of a cluster.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from wsinfer.sessions.connect import async_client, is_cluster, ready, sync_client
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, GenerationParams
from wsinfer.sessions.store import SessionStore, TurnInput
from wsinfer.sessions.worker import Publish, WorkerStore

PROMPT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper, please."}]
WORD = " lighthouse"  # one token of text, ~5 bytes on average in English


def used_memory(client: Any) -> int:
    if is_cluster(client):
        info = client.info("memory", target_nodes=client.PRIMARIES)
        return sum(int(v["used_memory"]) for v in info.values())
    return int(client.info("memory")["used_memory"])


async def create(url: str, count: int) -> list[str]:
    client = async_client(url)
    await ready(client)
    store = SessionStore(client)
    turn = TurnInput("chat", PROMPT, None, GenerationParams(temperature=0))
    sessions = [(await store.create(turn))[0] for _ in range(count)]
    await client.aclose()
    return sessions


def generate(worker: WorkerStore, tokens: int, finish: bool) -> int:
    """Claim every queued turn and publish ``tokens`` one-token deltas each."""
    items = worker.read_work(100_000, None)
    claims = [(i, worker.claim(i.request, takeover=False)) for i in items]
    for _, c in claims:
        if c is not None:  # the engine stores the rendered prompt's token ids
            worker.save_prompt(c, list(range(60)))
    for seq in range(1, tokens + 1):
        worker.publish_many(
            [
                Publish(c.session, c.turn, c.epoch, seq, [DeltaEvent(seq, WORD, [seq])])
                for _, c in claims
                if c is not None
            ]
        )
    if finish:
        worker.publish_many(
            [
                Publish(c.session, c.turn, c.epoch, tokens, [DoneEvent(tokens, "length")])
                for _, c in claims
                if c is not None
            ]
        )
    return len(claims)


def measure(url: str, sessions: int, tokens: int, finish: bool) -> float:
    client = sync_client(url)
    worker = WorkerStore(client, "bench-engine")
    worker.ensure_group()
    before = used_memory(client)
    asyncio.run(create(url, sessions))
    generate(worker, tokens, finish)
    return (used_memory(client) - before) / sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=500)
    args = parser.parse_args()
    queued = measure(args.redis_url, args.sessions, 0, finish=False)
    active = measure(args.redis_url, args.sessions, 100, finish=False)
    idle = measure(args.redis_url, args.sessions, args.tokens, finish=True)
    print(f"redis: {args.redis_url}  sessions per row: {args.sessions}")
    print(f"queued session (no tokens yet):          {queued:8.0f} bytes")
    print(f"active session, 100 tokens streamed:     {active:8.0f} bytes")
    print(f"idle session, one finished turn of {args.tokens}: {idle:8.0f} bytes")
    print(
        "per 1,000 tokens of stream:             ",
        f"{(idle - queued) * 1000 / args.tokens:8.0f} bytes",
    )


if __name__ == "__main__":
    main()
