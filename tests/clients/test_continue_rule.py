"""A ``continue`` whose answer was lost (docs/protocol.md "Clients"): one script,
both clients (the Python ``ClientProtocol`` and the browser client under node)
held to every step of it, including the refusals."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .model_world import NODE, ClientUnderTest, Message, NodeClient, PythonClient

CLIENTS: dict[str, Callable[[], ClientUnderTest]] = {"python": PythonClient}
if NODE is not None:
    CLIENTS["browser"] = NodeClient


def _turn(seq: int, kind: str, **extra: object) -> Message:
    return {"session": "s1", "turn": 1, "seq": seq, "type": kind, **extra}


def _done(seq: int) -> Message:
    return _turn(seq, "done", finish_reason="length", usage={"completion_tokens": seq})


def _answer(request: Message, status: str) -> Message:
    return {"type": "session", "id": request["id"], "session": "s1", "token": "k1",
            "turn": 1, "status": status}  # fmt: skip


def _ended_by_length(client: ClientUnderTest) -> None:
    client.start()
    [generate] = client.connect()
    client.receive(_answer(generate, "running"))
    client.receive(_turn(2, "delta", text="ab"))
    client.receive(_done(3))  # its last token had no text: seq 3 is past the text's 2
    assert client.state()["done"]


@pytest.fixture(params=list(CLIENTS))
def client(request: pytest.FixtureRequest) -> ClientUnderTest:
    return CLIENTS[request.param]()


def test_a_lost_continue_is_sent_again_only_once_the_replay_shows_it_was_not_applied(
    client: ClientUnderTest,
) -> None:
    _ended_by_length(client)
    [sent] = client.continue_()
    assert sent["type"] == "continue" and not client.state()["done"]  # followed again
    client.drop()
    [resume] = client.connect()  # a resume, not a blind second continue
    assert (resume["type"], resume["after"]) == ("resume", 2)
    assert client.receive(_answer(resume, "done")) == []
    [again] = client.receive(_done(3))  # the very end it went on from: not applied
    assert again["type"] == "continue" and not client.state()["done"]
    # A conflict now: the first was applied after all (still in flight when we
    # resumed). The client follows the turn instead of failing it.
    [follow] = client.receive({"type": "error", "id": again["id"], "code": "conflict"})
    assert (follow["type"], follow["after"]) == ("resume", 2)
    client.receive(_answer(follow, "running"))
    client.receive(_turn(5, "delta", text="cd"))
    client.receive(_done(6))
    state = client.state()
    assert state["done"] and state["text"] == state["app_text"] == "abcd"


def test_a_continue_applied_and_finished_while_away_is_not_applied_twice(
    client: ClientUnderTest,
) -> None:
    _ended_by_length(client)
    client.continue_()
    client.drop()
    [resume] = client.connect()
    client.receive(_answer(resume, "done"))
    client.receive(_turn(5, "delta", text="cd"))
    assert client.receive(_done(6)) == []  # nothing sent: no second continue
    state = client.state()
    assert state["done"] and state["text"] == "abcd" and not state["wants"]


def test_a_refused_continue_leaves_the_turn_as_it_ended(client: ClientUnderTest) -> None:
    _ended_by_length(client)
    [sent] = client.continue_()
    assert client.receive({"type": "error", "id": sent["id"], "code": "conflict"}) == []
    state = client.state()
    assert state["done"] and state["text"] == "ab" and not state["wants"]
    client.drop()
    assert client.connect() == []  # nothing to re-join
