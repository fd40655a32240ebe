"""The asyncio client against the stand-in server of conftest.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import wsinfer
from tests.stack import until
from wsinfer.clients import (
    BadRequest,
    ClientClosed,
    Conflict,
    ConnectionLost,
    EngineUnavailable,
    NotFound,
    Overloaded,
    ReconnectPolicy,
    Unauthorized,
    connect,
)

pytestmark = pytest.mark.timeout(30)

FAST = ReconnectPolicy(max_attempts=6, max_time=10.0, base_delay=0.01, max_delay=0.1)


def words(n: int, start: int = 1) -> str:
    return "".join(f"w{i} " for i in range(start, n + 1))


def sent(server: Any, kind: str) -> list[dict[str, Any]]:
    return [m for m in server.received if m.get("type") == kind]


@pytest.mark.parametrize("codec", ["msgpack", "json"])
async def test_generate_streams_the_whole_text(fake_server: Any, codec: str) -> None:
    async with wsinfer.connect(fake_server.url, codec=codec) as client:  # type: ignore[arg-type]
        assert client.codec == codec
        parts = [t async for t in client.generate(prompt="hi", params={"max_new_tokens": 5})]
    assert parts == [f"w{i} " for i in range(1, 6)]
    assert fake_server.subprotocols_seen == [f"wsinfer.v1.{codec}"]


async def test_turn_exposes_its_state(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        turn = await client.start(messages=[{"role": "user", "content": "hi"}])
        assert (turn.turn, turn.seq, turn.finish_reason) == (1, 0, None)
        text = await turn.wait()
    assert text == turn.text == words(8)
    assert (turn.seq, turn.finish_reason) == (8, "length")
    assert turn.usage is not None and turn.usage.completion_tokens == 8
    assert turn.session in fake_server.sessions


async def test_client_falls_back_to_the_servers_choice(fake_server: Any) -> None:
    fake_server.subprotocols = ["wsinfer.v1.json"]
    async with connect(fake_server.url, codec="msgpack") as client:
        assert client.codec == "json"
        assert await (await client.start(prompt="x")).wait() == words(8)


async def test_requests_carry_ids_and_answers_are_matched(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        turns = await asyncio.gather(
            *(client.start(prompt=f"p{i}", params={"max_new_tokens": 2 + i}) for i in range(4))
        )
        texts = await asyncio.gather(*(t.wait() for t in turns))
    ids = [m["id"] for m in sent(fake_server, "generate")]
    assert len(set(ids)) == 4
    # Each caller got the session of its own request, not of a neighbour's.
    assert texts == [words(2 + i) for i in range(4)]


async def test_concurrent_turns_share_one_connection(fake_server: Any) -> None:
    async def collect(n: int) -> str:
        return "".join([t async for t in client.generate(prompt="x", params={"max_new_tokens": n})])

    async with connect(fake_server.url) as client:
        texts = await asyncio.gather(*(collect(n) for n in (3, 9, 14)))
    assert texts == [words(3), words(9), words(14)]
    assert fake_server.connections == 1


async def test_reconnect_resumes_and_every_delta_is_seen_once(fake_server: Any) -> None:
    fake_server.cut_plan = [3, 5, 1]
    async with connect(fake_server.url, reconnect=FAST) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 20})
        parts = [t async for t in turn]
        assert client.reconnects == 3
    assert parts == [f"w{i} " for i in range(1, 21)]
    resumes = sent(fake_server, "resume")
    assert [(r["after"], r["turn"], r["token"]) for r in resumes] == [
        (3, 1, turn.token),
        (8, 1, turn.token),
        (9, 1, turn.token),
    ]


async def test_dedup_survives_overlapping_replays_and_duplicates(fake_server: Any) -> None:
    fake_server.cut_plan = [4, 4]
    fake_server.replay_overlap = 3
    fake_server.duplicate_deltas = True
    async with connect(fake_server.url, reconnect=FAST) as client:
        parts = [t async for t in client.generate(prompt="x", params={"max_new_tokens": 15})]
    assert "".join(parts) == words(15)
    assert len(parts) == 15


async def test_reconnect_backs_off_through_refused_handshakes(fake_server: Any) -> None:
    fake_server.cut_plan = [2]
    async with connect(fake_server.url, reconnect=FAST) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 6})
        fake_server.refuse_handshakes = 3
        assert await turn.wait() == words(6)
        assert client.reconnects == 1
    assert fake_server.refuse_handshakes == 0


async def test_many_turns_all_resume_after_one_cut(fake_server: Any) -> None:
    fake_server.cut_plan = [7]
    async with connect(fake_server.url, reconnect=FAST) as client:
        turns = [await client.start(prompt="x", params={"max_new_tokens": 12}) for _ in range(3)]
        texts = await asyncio.gather(*(t.wait() for t in turns))
    assert texts == [words(12)] * 3
    assert len(sent(fake_server, "resume")) == 3


async def test_gives_up_after_bounded_attempts(fake_server: Any) -> None:
    fake_server.delay = 0.02
    policy = ReconnectPolicy(max_attempts=3, max_time=2.0, base_delay=0.01, max_delay=0.02)
    async with connect(fake_server.url, reconnect=policy) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 500})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        await fake_server.stop()  # the whole server goes away
        with pytest.raises(ConnectionLost):
            await turn.wait()
        assert isinstance(turn.error, ConnectionLost) and 0 < turn.seq < 500


async def test_without_reconnect_a_cut_fails_the_turn(fake_server: Any) -> None:
    fake_server.cut_plan = [2]
    async with connect(fake_server.url, reconnect=False) as client:
        turn = await client.start(prompt="x")
        with pytest.raises(ConnectionLost):
            async for _ in turn:
                pass
        assert turn.text == words(2)
        with pytest.raises(ConnectionLost):
            await client.start(prompt="again")


async def test_idle_drop_reconnects_on_the_next_request(fake_server: Any) -> None:
    async with connect(fake_server.url, reconnect=FAST) as client:
        assert await (await client.start(prompt="x", params={"max_new_tokens": 2})).wait()
        assert client._ws is not None
        client._ws.transport.abort()
        await asyncio.sleep(0.05)
        assert not client.connected
        assert await (await client.start(prompt="x", params={"max_new_tokens": 2})).wait()
    assert fake_server.connections == 2


async def test_errors_raise_the_mapped_exception(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        fake_server.refuse_generate = {"code": "overloaded", "retry_after": 1.5}
        with pytest.raises(Overloaded) as overloaded:
            await client.start(prompt="x")
        assert overloaded.value.retry_after == 1.5
        with pytest.raises(BadRequest):
            await client.start(prompt="x", params={"nonsense": 1})
        turn = await client.start(prompt="x", params={"max_new_tokens": 30})
        with pytest.raises(Conflict):
            await client.start(prompt="y", session=turn.session)
        with pytest.raises(NotFound):
            await client.start(prompt="y", session=turn.session, token="wrong")
        await turn.stop()
        # The connection is still usable after refusals.
        assert await (await client.start(prompt="x", params={"max_new_tokens": 1})).wait()


async def test_done_with_error_raises_after_the_text(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        turn = await client.start(prompt="FAIL", params={"max_new_tokens": 3})
        seen: list[str] = []
        with pytest.raises(EngineUnavailable):
            async for text in turn:
                seen.append(text)
    assert "".join(seen) == words(3)
    assert turn.finish_reason == "error" and isinstance(turn.error, EngineUnavailable)


async def test_stop_cancels_the_turn(fake_server: Any) -> None:
    fake_server.delay = 0.02
    async with connect(fake_server.url) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 200})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        assert await turn.stop() == "cancelled"
        assert 0 < turn.seq < 200 and turn.text == words(turn.seq)
        assert await turn.stop() == "cancelled"  # idempotent


async def test_pause_and_resume(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 40})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        seq = await turn.pause()
        assert turn.paused and seq == turn.seq
        await asyncio.sleep(0.05)
        assert turn.seq == seq  # nothing generated while paused
        await turn.resume()
        assert await turn.wait() == words(40)
        assert not turn.paused


async def test_a_paused_turn_is_not_unpaused_by_a_reconnect(fake_server: Any) -> None:
    async with connect(fake_server.url, reconnect=FAST) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 40})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        seq = await turn.pause()
        assert client._ws is not None
        client._ws.transport.abort()
        await asyncio.sleep(0.1)
        session = fake_server.sessions[turn.session]
        assert session.turns[0].paused and session.turns[0].seq == seq
        await turn.resume()  # reconnects on demand
        assert await turn.wait() == words(40)


async def test_stop_of_a_paused_turn_after_a_drop(fake_server: Any) -> None:
    async with connect(fake_server.url, reconnect=FAST) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 40})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        await turn.pause()
        assert client._ws is not None
        client._ws.transport.abort()
        await until(lambda: not client.connected, what="the client to notice the drop")
        assert await turn.stop() == "cancelled"


async def test_leaving_generate_early_stops_the_turn(fake_server: Any) -> None:
    fake_server.delay = 0.02
    async with connect(fake_server.url) as client:
        agen = client.generate(prompt="x", params={"max_new_tokens": 100})
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(50):
            if sent(fake_server, "stop"):
                break
            await asyncio.sleep(0.01)
    assert len(sent(fake_server, "stop")) == 1


async def test_conversation_keeps_the_session(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        chat = client.conversation(system="be brief", params={"max_new_tokens": 3})
        first = "".join([t async for t in chat.send("hi")])
        second = "".join([t async for t in chat.send("again", params={"max_new_tokens": 2})])
        assert chat.last_turn is not None and chat.last_turn.turn == 2
        session = chat.session
        await chat.close()
        await until(lambda: session not in fake_server.sessions, what="the server to close it")
    assert (first, second) == (words(3), words(2))
    generates = sent(fake_server, "generate")
    assert generates[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert "session" not in generates[0]
    assert generates[1]["session"] == session and generates[1]["token"]
    assert generates[1]["messages"] == [{"role": "user", "content": "again"}]
    assert generates[1]["params"] == {"max_new_tokens": 2}
    assert session not in fake_server.sessions


async def test_conversation_after_leaving_an_answer_early(fake_server: Any) -> None:
    fake_server.delay = 0.01
    async with connect(fake_server.url) as client:
        chat = client.conversation(params={"max_new_tokens": 100})
        async for _ in chat.send("long"):
            break
        second = "".join([t async for t in chat.send("short", params={"max_new_tokens": 2})])
    assert second == words(2)
    assert chat.last_turn is not None and chat.last_turn.turn == 2
    assert [m["type"] for m in fake_server.received].count("stop") == 1


async def test_close_session_ends_it(fake_server: Any) -> None:
    async with connect(fake_server.url) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 2})
        await turn.wait()
        await client.close_session(turn.session)
        await until(lambda: turn.session not in fake_server.sessions, what="the server to close it")
        with pytest.raises(NotFound):
            await client.start(prompt="y", session=turn.session, token=turn.token)
        with pytest.raises(ValueError):
            await client.close_session("never-seen")


async def test_attach_follows_a_turn_from_another_client(fake_server: Any) -> None:
    async with connect(fake_server.url) as one, connect(fake_server.url) as two:
        turn = await one.start(prompt="x", params={"max_new_tokens": 10})
        await until(lambda: turn.seq > 0, what="the turn's first delta")
        follower = await two.attach(turn.session, turn.token)
        assert await follower.wait() == await turn.wait() == words(10)
        with pytest.raises(NotFound):
            await (await two.attach(turn.session, "bad-token")).wait()


async def test_api_key_goes_in_the_handshake(keyed_server: Any) -> None:
    async with connect(keyed_server.url, api_key="sekret") as client:
        assert await (await client.start(prompt="x", params={"max_new_tokens": 1})).wait()
    with pytest.raises(Unauthorized):
        await connect(keyed_server.url, api_key="wrong").open()
    with pytest.raises(Unauthorized):
        await connect(keyed_server.url).open()


async def test_connect_failure_is_connection_lost() -> None:
    with pytest.raises(ConnectionLost):
        await connect("ws://127.0.0.1:9/v1/ws", open_timeout=2).open()


async def test_close_fails_running_turns(fake_server: Any) -> None:
    client = await connect(fake_server.url)
    turn = await client.start(prompt="x", params={"max_new_tokens": 1000})
    await client.close()
    with pytest.raises(ClientClosed):
        await turn.wait()
    with pytest.raises(ClientClosed):
        await client.start(prompt="x")


async def test_a_generate_whose_answer_was_lost_is_resent_with_its_key(fake_server: Any) -> None:
    """Issue 9, bug 2: the server took the generate, the connection dropped
    before its answer; the resend (same id, same key) gets that turn, not a second one."""
    fake_server.drop_answers = 1
    async with connect(fake_server.url, reconnect=FAST) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 6})
        assert await turn.wait() == words(6)
    first, again = sent(fake_server, "generate")
    assert first == again and len(first["idempotency_key"]) == 32
    assert int(first["idempotency_key"], 16) >= 0
    assert len(fake_server.sessions) == 1
    assert [len(s.turns) for s in fake_server.sessions.values()] == [1]


async def test_without_reconnect_a_lost_generate_fails(fake_server: Any) -> None:
    fake_server.drop_answers = 1
    async with connect(fake_server.url, reconnect=False) as client:
        with pytest.raises(ConnectionLost) as lost:
            await client.start(prompt="x")
    assert lost.value.code == "connection_lost"


async def test_status_is_the_servers_word(fake_server: Any) -> None:
    fake_server.delay = 0.02
    async with connect(fake_server.url) as client:
        turn = await client.start(prompt="x", params={"max_new_tokens": 40})
        assert turn.status == "running"
        await turn.pause()
        assert turn.status == "paused"
        seq = turn.seq
        await turn.resume()
        # The resume's answer says queued (the server's word for a resumed
        # paused turn); its next delta says running.
        assert turn.status in ("queued", "running")
        async for _ in turn:
            if turn.seq > seq:
                break
        assert turn.status == "running"
        await turn.stop()
        assert turn.status == "done"
