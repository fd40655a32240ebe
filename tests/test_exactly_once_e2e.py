"""Exactly once, end to end, with real processes and kill -9 (issue 18, item 3).

50 turns stream at once from two fake engines (``fake:RATE``: token ``i`` of a
turn is always the same word, so every turn's text is known, and a turn taken
over from the token log goes on with the same words) through two frontends.
Each turn gets 1-3 followers that join at random times and positions (0, the
turn's current seq, or anywhere between: a follower behind another one on the
same frontend is the case the fan-in once got wrong), over a raw WebSocket
``resume``, the SSE stream with ``Last-Event-ID``, the Python client's
automatic resume, the Responses API's WebSocket mode (``response.resume``),
TGI's ``/generate_stream`` (by token index), the v2 ``generate_stream`` (by
event count), its gRPC ``ModelStreamInfer`` (the same count, through a cutter of
the frontends' gRPC ports) or DJL's JSON lines (by line count).
Each follower reaches the frontends through a ``Cutter`` of its own that aborts
its connection at random times; one frontend and one engine are killed with -9
mid-run (the frontend comes back on its port).
Every follower's joined text must equal the turn's text from its start.
Seeded (``WSINFER_E2E_SEED``); the counts are printed.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import random
import time
from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.cutter import Cutter
from tests.followers import COUNTED, FOLLOW, Follower
from tests.ports import free_ports
from tests.stack import Client, Stack, joined
from wsinfer.engine.fake import WORDS
from wsinfer.sessions.connect import async_client
from wsinfer.sessions.schema import DeltaEvent
from wsinfer.sessions.store import SessionStore

SEED = int(os.environ.get("WSINFER_E2E_SEED", "18"))
SESSIONS = 50
RATE = 10  # tokens per second per turn
TOKENS = 250  # so a turn streams for 25 s, the kills land mid-turn
ENGINE_FLAGS = ("--max-batch-size", "64", "--threads", "1")
KINDS = ("ws", "sse", "python", "responses_ws", "tgi", "v2", "djl", "grpc")
MEAN_CUT_S = 2.5  # mean time between two cuts of one follower's connection

pytestmark = pytest.mark.timeout(240)


def expected(after: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(min(after, TOKENS), TOKENS))


# --- the run -----------------------------------------------------------------------------


@pytest.fixture
async def cutters() -> AsyncIterator[list[Cutter]]:
    made: list[Cutter] = []
    yield made
    for cutter in made:
        await cutter.stop()


async def start_turns(port: int) -> list[tuple[str, str]]:
    """Every turn accepted before anything is cut: (session, token) each."""

    async def one(i: int) -> tuple[str, str]:
        client = await Client.open(port)
        params = {"max_new_tokens": TOKENS}
        await client.send(type="generate", prompt=f"turn {i}", params=params, id=i)
        answer = await client.recv()
        await client.close()  # the turn goes on: followers join it
        assert answer["type"] == "session", answer
        return answer["session"], answer["token"]

    return list(await asyncio.gather(*(one(i) for i in range(SESSIONS))))


class Positions:
    """Where a joining follower starts: 0, the turn's seq now, or a seq it had
    when an earlier follower joined (behind the others, on the same frontend
    or not). Always a seq the server reported, as a client's ``after`` is: a
    position inside a merged delta would get that whole delta."""

    def __init__(self, port: int, rng: random.Random, store: SessionStore) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.rng = rng
        self.store = store
        self.seen: dict[str, list[int]] = {}

    async def pick(self, session: str, token: str) -> int:
        async with httpx.AsyncClient(base_url=self.url) as http:
            answer = await http.get(f"/v1/sessions/{session}", headers={"X-Wsinfer-Token": token})
        seen = self.seen.setdefault(session, [0])
        seen.append(answer.json()["seq"])
        return self.rng.choice([0, seen[-1], self.rng.choice(seen)])

    async def count(self, session: str, after: int) -> int:
        """How many events (v2) or lines (DJL) a reader at ``after`` has: the
        turn's text-bearing deltas up to it, as the token log has them."""
        events, _ = await self.store.read_turn(session, 1)
        return sum(1 for e in events if isinstance(e, DeltaEvent) and e.text and e.seq <= after)


async def run_follower(
    f: Follower, rng: random.Random, joins_at: float, positions: Positions, stats: Counter[str]
) -> None:
    await asyncio.sleep(joins_at)
    f.after = await positions.pick(f.session, f.token)
    if f.kind in COUNTED:
        f.received = await positions.count(f.session, f.after)
    task = asyncio.create_task(FOLLOW[f.kind](f))
    while not task.done():
        await asyncio.wait([task], timeout=rng.expovariate(1 / MEAN_CUT_S))
        if not task.done():
            # Half the cuts leave the server's side open a while: the old
            # request or connection still follows when the client comes back.
            stats["cuts"] += f.cutter.cut(linger=rng.choice([0.0, rng.uniform(0.2, 3.0)]))
    await task


async def test_every_follower_gets_the_whole_text_once(stack: Stack, cutters: list[Cutter]) -> None:
    rng = random.Random(SEED)
    stack.model = f"fake:{RATE}"
    grpc_ports = free_ports(2)
    frontends = [stack.start_frontend("--grpc-port", str(p)) for p in grpc_ports]
    ports = [port for _, port in frontends]
    engines = [stack.start_engine(f"engine-{i}", *ENGINE_FLAGS) for i in range(2)]
    turns = await start_turns(ports[0])
    began = time.monotonic()
    followers: list[tuple[Follower, float]] = []
    for session, token in turns:
        for _ in range(rng.randint(1, 3)):
            joins_at = rng.uniform(0, 0.6 * TOKENS / RATE)
            kind = rng.choice(KINDS)
            upstreams = grpc_ports if kind == "grpc" else ports
            cutter = await Cutter(upstreams, random.Random(rng.random())).start()
            cutters.append(cutter)
            followers.append((Follower(kind, session, token, -1, cutter), joins_at))
    stats: Counter[str] = Counter()
    redis = async_client(stack.redis_url)
    positions = Positions(ports[1], random.Random(rng.random()), SessionStore(redis))
    jobs = [
        asyncio.create_task(run_follower(f, random.Random(rng.random()), at, positions, stats))
        for f, at in followers
    ]

    await asyncio.sleep(0.35 * TOKENS / RATE)
    frontends[0][0].kill()  # -9: its followers are cut mid-stream
    assert await asyncio.to_thread(frontends[0][0].wait) == -9
    await asyncio.sleep(1)
    stack.start_frontend("--grpc-port", str(grpc_ports[0]), port=ports[0])
    await asyncio.sleep(max(0.0, 0.5 * TOKENS / RATE - (time.monotonic() - began)))
    engines[0].kill()  # -9: the other engine takes its turns over from the token log
    assert await asyncio.to_thread(engines[0].wait) == -9

    await asyncio.wait_for(asyncio.gather(*jobs), 180)
    took = time.monotonic() - began
    truths = [await replay(ports[1], f) for f, _ in followers]
    await redis.aclose()
    report([f for f, _ in followers], truths, stats, took)


async def replay(port: int, f: Follower) -> str:
    """The turn's text after the follower's start, as the token log in Redis has it."""
    client = await Client.open(port)
    await client.send(type="resume", session=f.session, token=f.token, turn=1, after=f.after)
    messages = await client.until("done")
    await client.close()
    text, _ = joined(messages)
    return text


def differences(want: str, got: str) -> tuple[int, int, str]:
    """Characters lost and repeated (a diff), and the first difference."""
    lost = repeated = 0
    first = ""
    matcher = difflib.SequenceMatcher(None, want, got, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            lost += i2 - i1
            repeated += j2 - j1
            first = first or f"at {i1}: {want[i1:i2]!r} -> {got[j1:j2]!r}"
    return lost, repeated, first


def report(followers: list[Follower], truths: list[str], stats: Counter[str], took: float) -> None:
    compared = lost = repeated = off_model = 0
    wrong = []
    for f, truth in zip(followers, truths, strict=True):
        compared += len(truth)
        if truth != expected(f.after):
            off_model += 1
        if f.text != truth:
            missing, extra, first = differences(truth, f.text)
            lost, repeated = lost + missing, repeated + extra
            wrong.append(f"{f.kind} {f.session} from {f.after}: {first}")
    kinds = Counter(f.kind for f in followers)
    print(
        f"\nsessions {SESSIONS}, followers {len(followers)} {dict(kinds)},"
        f" reconnects {sum(f.reconnects for f in followers)}, cuts {stats['cuts']},"
        f" kills 2 (a frontend, an engine), characters compared {compared},"
        f" lost {lost}, repeated {repeated}; token logs off the model {off_model}; {took:.1f} s"
    )
    for kind in sorted(kinds):
        mine = [f for f in followers if f.kind == kind]
        print(f"  {kind}: {len(mine)} followers, {sum(f.reconnects for f in mine)} reconnects")
    assert not wrong, f"{len(wrong)} followers got other text: {wrong[:10]}"
    assert not off_model, f"{off_model} token logs are not the fake model's words"
