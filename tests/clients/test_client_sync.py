"""The blocking wrapper, against the stand-in server running in its own thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from wsinfer.clients import NotFound, Overloaded, ReconnectPolicy, sync

pytestmark = pytest.mark.timeout(30)

FAST = ReconnectPolicy(max_attempts=6, base_delay=0.01, max_delay=0.1)


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(1, n + 1))


def test_generate_is_an_iterator_of_str(threaded_server: Any) -> None:
    with sync.connect(threaded_server.url) as client:
        parts = list(client.generate(prompt="x", params={"max_new_tokens": 4}))
    assert parts == ["w1 ", "w2 ", "w3 ", "w4 "]


def test_errors_raise_from_the_call(threaded_server: Any) -> None:
    with sync.connect(threaded_server.url, codec="json") as client:
        threaded_server.refuse_generate = {"code": "overloaded", "retry_after": 1.5}
        with pytest.raises(Overloaded):
            client.generate(prompt="x")
        with pytest.raises(NotFound):
            client.generate(prompt="x", session="nope", token="nope")


def test_turn_controls_and_reconnect(threaded_server: Any) -> None:
    threaded_server.cut_plan = [3]
    with sync.connect(threaded_server.url, reconnect=FAST) as client:
        turn = client.start(prompt="x", params={"max_new_tokens": 30})
        seq = turn.pause()
        assert turn.seq == seq and turn.status == "paused"
        turn.resume()
        assert "".join(turn) == words(30) == turn.text
        assert (turn.finish_reason, turn.turn, turn.status) == ("length", 1, "done")
        assert turn.usage is not None and turn.usage.completion_tokens == 30
        more = client.start(prompt="y", session=turn.session, params={"max_new_tokens": 500})
        assert more.stop() == "cancelled"
        client.close_session(turn.session)


def test_breaking_out_stops_the_turn(threaded_server: Any) -> None:
    threaded_server.delay = 0.02
    with sync.connect(threaded_server.url) as client:
        deltas = client.generate(prompt="x", params={"max_new_tokens": 200})
        next(iter(deltas))
        deltas.close()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5
        while not any(m["type"] == "stop" for m in threaded_server.received):
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_close_stops_the_background_thread(threaded_server: Any) -> None:
    before = threading.active_count()
    client = sync.connect(threaded_server.url)
    assert threading.active_count() == before + 1
    client.close()
    client.close()  # idempotent
    assert threading.active_count() == before
