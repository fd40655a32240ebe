"""Each client message declared once (``contract.CLIENT_MESSAGES``), and what
derives from it: the parser's fields, the HTTP session routes, the plan's path,
the clients' one control call, and the replay of a turn that went on past an end."""

from __future__ import annotations

import json
from typing import Any

import pytest

from wsinfer.clients.protocol import ClientProtocol, TurnState
from wsinfer.contract import (
    CLIENT_MESSAGES,
    CONTROL_ANSWERS,
    ClientMessageType,
    FieldKind,
    ServerMessageType,
)
from wsinfer.errors import BadRequest
from wsinfer.http.app import _CONTROLS
from wsinfer.messages import JsonCodec, Limits, Resume, SessionCommand, parse_client_message
from wsinfer.protocol import ConnectionProtocol
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, PausedEvent, Usage
from wsinfer.sessions.states import CONTROL

CONTROLS = [kind for kind, spec in CLIENT_MESSAGES.items() if spec.controls_turn]
SESSION_MESSAGES = [kind for kind in CLIENT_MESSAGES if kind is not ClientMessageType.GENERATE]
VALUES: dict[FieldKind, Any] = {FieldKind.NAME: "x" * 8, FieldKind.COUNT: 0, FieldKind.ORDINAL: 1}
BAD: dict[FieldKind, Any] = {FieldKind.NAME: "", FieldKind.COUNT: -1, FieldKind.ORDINAL: 0}


def test_every_message_type_is_declared_and_every_control_has_its_rows() -> None:
    assert set(CLIENT_MESSAGES) == set(ClientMessageType)
    for kind, spec in CLIENT_MESSAGES.items():
        assert spec.type is kind
        has_rows = any(msg is kind for msg, _ in CONTROL)
        assert has_rows == spec.controls_turn, kind
    assert set(CONTROL_ANSWERS) == set(CONTROLS)


def _full(kind: ClientMessageType) -> dict[str, Any]:
    spec = CLIENT_MESSAGES[kind]
    return {"type": kind.value, **{f.name: VALUES[f.kind] for f in spec.fields}}


@pytest.mark.parametrize("kind", SESSION_MESSAGES, ids=str)
def test_the_parser_takes_exactly_the_declared_fields(kind: ClientMessageType) -> None:
    parsed = parse_client_message(_full(kind), Limits())
    assert parsed.type is kind
    assert isinstance(parsed, Resume if CLIENT_MESSAGES[kind].rejoins else SessionCommand)
    with pytest.raises(BadRequest, match="unknown fields"):
        parse_client_message({**_full(kind), "extra": 1}, Limits())
    for declared in CLIENT_MESSAGES[kind].fields:
        bad = {**_full(kind), declared.name: BAD[declared.kind]}
        with pytest.raises(BadRequest, match=declared.name):
            parse_client_message(bad, Limits())
        if declared.required:
            missing = {k: v for k, v in _full(kind).items() if k != declared.name}
            with pytest.raises(BadRequest, match=declared.name):
                parse_client_message(missing, Limits())


def test_the_session_routes_are_the_declared_controls() -> None:
    assert set(_CONTROLS.split("|")) == {kind.value for kind in CONTROLS}


def test_a_replay_drops_every_end_the_turn_went_on_past() -> None:
    """A ``done`` followed by more of the turn (a continued turn) is stale, as a
    resumed pause is: the replay ends at the last end only."""
    proto = ConnectionProtocol(JsonCodec())
    proto.follow("s", 1, after=0)
    events = [
        DeltaEvent(1, "a"),
        DoneEvent(1, "length", Usage(3, 1, 0)),
        DeltaEvent(2, "b"),
        PausedEvent(2),
        DeltaEvent(3, "c"),
        DoneEvent(3, "stop", Usage(3, 3, 0)),
    ]
    proto.replay("s", 1, events)
    sent = [json.loads(out.frame) for out in proto.data_to_send()]
    assert [(m["type"], m["seq"]) for m in sent] == [("delta", 3), ("done", 3)]
    assert sent[0]["text"] == "abc"


def _answered(core: ClientProtocol, status: str) -> list[Any]:
    (msg,) = core.data_to_send()
    return core.receive(
        {
            "type": "session",
            "id": msg["id"],
            "session": "s",
            "token": "k",
            "turn": 1,
            "status": status,
        }
    )


@pytest.mark.parametrize("kind", [k for k in CONTROLS if CLIENT_MESSAGES[k].rejoins], ids=str)
def test_a_rejoining_control_reopens_a_done_turn_only_if_the_server_says_it_went_on(
    kind: ClientMessageType,
) -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = TurnState("s", "k", 1, seq=2, parts=["ab"], finish_reason="length")
    core.control(turn, kind)
    _answered(core, "done")
    assert turn.done and "s" not in core.turns  # the server says it had ended: it stays so
    turn.following = False
    core.control(turn, kind)
    _answered(core, "queued")
    assert not turn.done and core.turns["s"] is turn
    core.receive({"type": "delta", "session": "s", "turn": 1, "seq": 3, "text": "c"})
    assert turn.text == "abc"


@pytest.mark.parametrize("kind", [k for k in CONTROLS if not CLIENT_MESSAGES[k].rejoins], ids=str)
def test_a_control_goes_out_with_a_follow_ordered_by_its_answers(
    kind: ClientMessageType,
) -> None:
    """Where the answer can be ``paused``, the follow goes first (a resume sent
    after it would un-pause the turn); else the control goes first."""
    core = ClientProtocol()
    core.connection_made()
    core.control(TurnState("s", "k", 1), kind)
    order = [m["type"] for m in core.data_to_send()]
    if ServerMessageType.PAUSED in CLIENT_MESSAGES[kind].answers:
        assert order == ["resume", kind.value]
    else:
        assert order == [kind.value, "resume"]
