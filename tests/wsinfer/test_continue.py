"""``continue``: a turn cut by length goes on, the same turn, the same seq
numbering, from the kept KV cache; anything else is refused. Over real sockets
(real Redis, a real engine process with the tiny model) and through the plan."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.stack import Client, joined, start_frontend
from wsinfer.clients.client import connect
from wsinfer.commands import Control, Controlled, Lookup, ReadTurn, Refused, TurnFound, TurnRead
from wsinfer.contract import ClientMessageType, TurnStatus
from wsinfer.errors import Conflict
from wsinfer.messages import JsonCodec, Resume
from wsinfer.protocol import ConnectionProtocol
from wsinfer.server import Frontend
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, Usage

PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def _params(max_new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.8, "seed": 7, "max_new_tokens": max_new_tokens, "ignore_eos": True}


# --- the plan ----------------------------------------------------------------------


def _continue(after: int = 0) -> Resume:
    return Resume(1, "s", "k", after=after, type=ClientMessageType.CONTINUE)


def test_the_plan_applies_continue_to_a_done_turn_and_replays_past_its_end() -> None:
    proto = ConnectionProtocol(JsonCodec())
    plan = proto.plan(_continue(after=2))
    assert plan.start() == Lookup("s", "k")
    command = plan.send(TurnFound(1, TurnStatus.DONE, 2))
    assert command == Control("s", "k", 1, ClientMessageType.CONTINUE)
    command = plan.send(Controlled(TurnStatus.QUEUED, 2))
    assert isinstance(command, ReadTurn) and command.after == 2
    history = [DeltaEvent(1, "a"), DeltaEvent(2, "b"), DoneEvent(2, "length", Usage(3, 2, 0))]
    plan.send(TurnRead(history, "1-0"))
    sent = [json.loads(out.frame) for out in proto.data_to_send()]
    assert [(m["type"], m.get("status")) for m in sent] == [("session", "queued")]
    assert "s" in proto.feeds  # following the turn as it goes on


@pytest.mark.parametrize("status", [TurnStatus.QUEUED, TurnStatus.RUNNING, TurnStatus.PAUSED])
def test_continue_of_a_turn_that_has_not_ended_is_a_conflict(status: TurnStatus) -> None:
    plan = ConnectionProtocol(JsonCodec()).plan(_continue())
    plan.start()
    with pytest.raises(Conflict, match=f"cannot continue a turn that is {status.value}"):
        plan.send(TurnFound(1, status, 2))


@pytest.mark.parametrize(
    ("current", "said"),
    [
        ("done", "did not end by length"),
        ("queued", "is queued"),
        ("no longer the latest turn", "is no longer the latest turn"),
    ],
)
def test_continue_the_store_refused_is_a_conflict(current: str, said: str) -> None:
    """Ended otherwise than by length (the store's check), continued by another
    client first, or a later turn started: nothing to follow as it is."""
    plan = ConnectionProtocol(JsonCodec()).plan(_continue())
    plan.start()
    plan.send(TurnFound(1, TurnStatus.DONE, 2))
    with pytest.raises(Conflict, match=f"cannot continue a turn that {said}"):
        plan.send(Refused(current))


# --- end to end ----------------------------------------------------------------------


@pytest.fixture
async def frontend(engine_stack: Any) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(engine_stack.redis_url)
    yield frontend
    await frontend.stop()


async def _turn(client: Client, max_new_tokens: int, **extra: Any) -> list[dict[str, Any]]:
    await client.send(
        type="generate", id=1, messages=PROMPT, params=_params(max_new_tokens), **extra
    )
    return await client.until("done")


@pytest.mark.slow
async def test_a_continued_turn_is_the_turn_it_would_have_been_uncut(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    reference, seq = joined(await _turn(client, 24))
    assert seq == 24
    cut = await _turn(client, 12)
    session, token = cut[0]["session"], cut[0]["token"]
    text, seq = joined(cut)
    assert (cut[-1]["finish_reason"], seq) == ("length", 12)
    await client.send(type="continue", id=2, session=session, token=token, after=seq)
    more = await client.until("done")
    assert more[0]["type"] == "session" and more[0]["status"] == "queued" and more[0]["id"] == 2
    rest, end = joined(more, after=seq)
    # Seeded draws by position, and the same KV: as if it had never been cut.
    assert text + rest == reference and end == 24
    assert more[-1]["turn"] == 1 and more[-1]["usage"]["completion_tokens"] == 24
    assert more[-1]["usage"]["cached_tokens"] > 0  # from the kept KV cache
    # A replay of the whole turn: one text, one done (the first is stale).
    await client.send(type="resume", session=session, token=token, after=0)
    replay = await client.until("done")
    assert [m["type"] for m in replay] == ["session", "delta", "done"]
    assert replay[1]["text"] == reference
    await client.close()


@pytest.mark.slow
async def test_continue_is_refused_for_a_turn_that_did_not_end_by_length(
    frontend: Frontend,
) -> None:
    client = await Client.open(frontend.port)
    first = await _turn(client, 4)
    session, token = first[0]["session"], first[0]["token"]
    await client.send(type="continue", id=2, session=session, token=token, after=4)
    await client.send(type="continue", id=3, session=session, token=token, after=4)
    more = await client.until("done")
    # The first goes on with the turn; the second finds it not ended.
    assert (more[0]["type"], more[0]["id"]) == ("session", 2)
    errors = [m for m in more if m["type"] == "error"]
    assert [(m["id"], m["code"]) for m in errors] == [(3, "conflict")]
    assert more[-1]["finish_reason"] == "length" and more[-1]["seq"] == 8
    # A turn stopped: cancelled, not cut.
    await client.send(
        type="generate", id=3, session=session, token=token, messages=PROMPT, params=_params(200)
    )
    started = await client.recv()
    assert started["type"] == "session" and started["turn"] == 2
    await client.send(type="stop", session=session, token=token)
    assert (await client.until("done"))[-1]["finish_reason"] == "cancelled"
    await client.send(type="continue", id=4, session=session, token=token)
    refused = await client.recv()
    assert refused["type"] == "error" and refused["code"] == "conflict" and refused["id"] == 4
    # The turn before it: not the latest.
    await client.send(type="continue", id=5, session=session, token=token, turn=1)
    assert (await client.recv())["code"] == "conflict"
    await client.close()


async def _wait_done_over_http(port: int, session: str, token: str) -> dict[str, Any]:
    def get() -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/sessions/{session}",
            headers={"X-Wsinfer-Token": token},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.loads(answer.read()))

    for _ in range(600):
        info = await asyncio.to_thread(get)
        if info["status"] == "done":
            return info
        await asyncio.sleep(0.1)
    raise AssertionError("the continued turn did not end")


@pytest.mark.slow
async def test_the_python_client_and_the_session_route_continue_a_turn(frontend: Frontend) -> None:
    async with connect(f"ws://127.0.0.1:{frontend.port}/v1/ws") as client:
        turn = await client.start(messages=PROMPT, params=_params(8))
        text = await turn.wait()
        assert turn.finish_reason == "length" and turn.seq == 8
        await turn.control(ClientMessageType.CONTINUE)
        whole = await turn.wait()
        assert whole.startswith(text) and len(whole) > len(text)
        assert turn.finish_reason == "length" and turn.seq == 16
        session, token = turn.session, turn.token

    def post() -> dict[str, Any]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{frontend.port}/v1/sessions/{session}/continue",
            method="POST",
            headers={"X-Wsinfer-Token": token},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.loads(answer.read()))

    answer = await asyncio.to_thread(post)
    assert answer["status"] in ("queued", "running", "done") and answer["turn"] == 1
    info = await _wait_done_over_http(frontend.port, session, token)
    assert info["seq"] == 24
